"""The three wakegate dashboards: fleet overview, one model, gateway health.

Label contract the queries rely on:
- wakegate series carry `model` = the model key (`namespace/name` on Kubernetes,
  the name under `wakegate up`);
- backend series (vLLM and the simulator: `vllm:*`) get the same `model` label from
  the scrape configuration (the chart's backend PodMonitor sets it from the pod's
  namespace and `wakegate.io/model` label);
- Envoy series come from its /stats/prometheus; the gateway listener's connection
  manager has the stat prefix `wakegate`.
"""

from __future__ import annotations

from dashboards.grafana import Dashboard, Panel, Target

RI = "$__rate_interval"
M = 'model=~"$model"'
RATE = f"rate({{}}[{RI}])"


def engines(*series: str, wrap: str = "{}") -> str:
    """One vector of the same signal from every engine that has it (vLLM's, then llama.cpp's),
    each series selected by `$model` and put through `wrap` (e.g. `rate({}[...])`)."""
    return " or ".join(wrap.format(f"{name}{{{M}}}") for name in series)


def over_range(series: str) -> str:
    """How much a counter grew over the dashboard's range, exactly (no extrapolation, unlike
    increase()): its value now less its value a range ago, or all of it when it began within the
    range. `wakegate savings` cuts the same counters at the same ends."""
    return f"({series} - ({series} offset $__range or {series} * 0))"


def _quantiles(metric: str, selector: str, by: str = "") -> tuple[Target, ...]:
    group = f"{by}, le" if by else "le"
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RI}])))",
            f"p{round(q * 100)}" + (f" {{{{{by}}}}}" if by else ""),
        )
        for q in (0.5, 0.9, 0.99)
    )


FLEET = Dashboard(
    uid="wakegate-fleet",
    title="wakegate / Fleet overview",
    description="Every model at a glance: phases, accelerator use, cold starts, queues and GPU-group swaps.",
    panels=(
        Panel(
            "Models by phase",
            "Ready: at least one replica passes health. Loading: replicas exist, none ready yet. "
            "Idle: scaled to zero.",
            (
                Target("count(max by (model) (wakegate_model_ready_replicas) > 0) or vector(0)", "Ready", True),
                Target(
                    "count((max by (model) (wakegate_model_replicas) > 0) "
                    "unless (max by (model) (wakegate_model_ready_replicas) > 0)) or vector(0)",
                    "Loading",
                    True,
                ),
                Target("count(max by (model) (wakegate_model_replicas) == 0) or vector(0)", "Idle", True),
            ),
            kind="stat",
            width=8,
        ),
        Panel(
            "GPU use",
            "Backend replicas holding accelerators, by model, and their KV-cache usage.",
            (
                Target("sum by (model) (wakegate_model_replicas)", "replicas {{model}}"),
                Target(
                    "avg by (model) (vllm:kv_cache_usage_perc or llamacpp:kv_cache_usage_ratio)",
                    "KV cache {{model}}",
                ),
            ),
            width=16,
        ),
        Panel(
            "Cold starts",
            "Scale-from-zero activations per model.",
            (Target(f"sum by (model) (increase(wakegate_cold_starts_total[{RI}]))", "{{model}}"),),
            stacked=True,
            width=8,
        ),
        Panel(
            "Cold-start time (p90, decision to ready)",
            "90th percentile of the whole cold start, per model.",
            (
                Target(
                    "histogram_quantile(0.9, sum by (model, le) "
                    '(increase(wakegate_cold_start_seconds_bucket{stage="total"}[$__range])))',
                    "{{model}}",
                ),
            ),
            unit="s",
            width=8,
        ),
        Panel(
            "Queue depth",
            "Cold requests held, per model, over all gateways.",
            (Target("sum by (model) (wakegate_gateway_queue_depth)", "{{model}}"),),
            stacked=True,
            width=8,
        ),
        Panel(
            "Flow control: held requests dispatched",
            "Requests held while their model was saturated and then sent on, per second, by band.",
            (Target(f"sum by (band) (rate(wakegate_gateway_flow_dispatched_total[{RI}]))", "{{band}}"),),
            unit="reqps",
            stacked=True,
            width=12,
        ),
        Panel(
            "Flow control: wait (p90)",
            "90th percentile of the time a held request waited for a saturated model, by band.",
            (
                Target(
                    "histogram_quantile(0.9, sum by (band, le) "
                    "(increase(wakegate_gateway_flow_wait_seconds_bucket[$__range])))",
                    "{{band}}",
                ),
            ),
            unit="s",
            width=12,
        ),
        Panel(
            "GPU-group swap rate",
            "Hand-overs between models of a shared GPU group, per minute.",
            (Target(f"sum by (group) (rate(wakegate_gpu_swaps_total[{RI}])) * 60", "{{group}}"),),
            unit="short",
            width=12,
        ),
        Panel(
            "Requests by outcome",
            "Gateway decisions per second: routed, keepalive, or the status it answered.",
            (Target(f"sum by (code) (rate(wakegate_gateway_requests_total[{RI}]))", "{{code}}"),),
            unit="reqps",
            stacked=True,
            width=12,
        ),
    ),
)

MODEL = Dashboard(
    uid="wakegate-model",
    title="wakegate / Model",
    description="One model: traffic, errors, latency and time to first token, concurrency, cold-start stages.",
    model_variable=True,
    panels=(
        Panel(
            "Request rate",
            "Gateway decisions per second by outcome.",
            (Target(f"sum by (code) (rate(wakegate_gateway_requests_total{{{M}}}[{RI}]))", "{{code}}"),),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Error rate",
            "Share of requests the gateway answered with a 4xx or 5xx status.",
            (
                Target(
                    f'(sum(rate(wakegate_gateway_requests_total{{{M}, code=~"4..|5.."}}[{RI}])) or vector(0)) '
                    f"/ sum(rate(wakegate_gateway_requests_total{{{M}}}[{RI}]))",
                    "errors",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Request latency (backend, end to end)",
            "Percentiles of the backend's end-to-end request latency.",
            _quantiles("vllm:e2e_request_latency_seconds", M),
            unit="s",
        ),
        Panel(
            "Time to first token",
            "Percentiles of the backend's time to first token.",
            _quantiles("vllm:time_to_first_token_seconds", M),
            unit="s",
        ),
        Panel(
            "In flight",
            "Requests routed and not finished (gateway), running and waiting in the engine (vLLM: "
            "num_requests_running/waiting; llama.cpp: requests_processing/deferred). Ollama reports no "
            "load of its own: for its models the gateway's count is the signal (as for picking).",
            (
                Target(f"sum(wakegate_gateway_in_flight{{{M}}})", "gateway in flight"),
                Target(
                    f"sum({engines('vllm:num_requests_running', 'llamacpp:requests_processing')})", "backend running"
                ),
                Target(
                    f"sum({engines('vllm:num_requests_waiting', 'llamacpp:requests_deferred')})", "backend waiting"
                ),
            ),
        ),
        Panel(
            "Token throughput",
            "Prompt and generated tokens per second the engine processed (vLLM: prompt_tokens, "
            "generation_tokens; llama.cpp: prompt_tokens, tokens_predicted).",
            (
                Target(
                    f"sum({engines('vllm:prompt_tokens_total', 'llamacpp:prompt_tokens_total', wrap=RATE)})", "prompt"
                ),
                Target(
                    f"sum({engines('vllm:generation_tokens_total', 'llamacpp:tokens_predicted_total', wrap=RATE)})",
                    "generated",
                ),
            ),
            unit="short",
        ),
        Panel(
            "Cold-start stages (mean)",
            "Mean seconds per stage over the time range: process_start (activation to spawn), "
            "health_pass (spawn to healthy), model_loaded (spawn to loaded), total (activation to "
            "ready), first_byte (the engine's first answer to wakegate's check).",
            (
                Target(
                    f"sum by (stage) (increase(wakegate_cold_start_seconds_sum{{{M}}}[$__range])) "
                    f"/ sum by (stage) (increase(wakegate_cold_start_seconds_count{{{M}}}[$__range]))",
                    "{{stage}}",
                    True,
                ),
            ),
            kind="bargauge",
            unit="s",
        ),
        Panel(
            "Savings: accelerator-seconds by tier",
            "Accelerator-seconds over the time range (a replica without an accelerator counts as one): warm is "
            "held; asleep (the engine's own sleep, process alive) and zero (no process) are released. The same "
            "numbers as `wakegate savings --since … --until …`.",
            (
                Target(
                    f"sum by (tier) {over_range(f'wakegate_accelerator_seconds_total{{{M}}}')}", "{{tier}}", True
                ),
            ),
            kind="bargauge",
            unit="s",
        ),
        Panel(
            "Wakes by tier and their waiting",
            "Wakes over the time range by the tier they woke from (asleep: the engine's wake; zero: a start), "
            "and the seconds of waiting they cost in all (from the demand that woke the model to it routed).",
            (
                Target(f"sum by (tier) {over_range(f'wakegate_wake_seconds_count{{{M}}}')}", "wakes {{tier}}", True),
                Target(f"sum by (tier) {over_range(f'wakegate_wake_seconds_sum{{{M}}}')}", "waited {{tier}}", True),
            ),
            kind="bargauge",
        ),
        Panel(
            "Replicas",
            "Backend replicas, all and ready.",
            (
                Target(f"sum(wakegate_model_replicas{{{M}}})", "replicas"),
                Target(f"sum(wakegate_model_ready_replicas{{{M}}})", "ready"),
            ),
        ),
        Panel(
            "Queue and activation leases",
            "Cold requests held and live activation leases, summed over gateways.",
            (
                Target(f"sum(wakegate_gateway_queue_depth{{{M}}})", "queued"),
                Target(f"sum(wakegate_model_activation_leases{{{M}}})", "leases"),
            ),
        ),
    ),
)

GATEWAY = Dashboard(
    uid="wakegate-gateway",
    title="wakegate / Gateway health",
    description="The request path: extproc decision latency, Envoy responses and upstream errors, rejections.",
    panels=(
        Panel(
            "extproc pick latency",
            "Time extproc spends deciding a request (headers and body phases).",
            _quantiles("wakegate_gateway_pick_seconds", ""),
            unit="s",
        ),
        Panel(
            "Decisions per second",
            "Requests extproc decided, per gateway pod.",
            (Target(f"sum by (instance) (rate(wakegate_gateway_pick_seconds_count[{RI}]))", "{{instance}}"),),
            unit="reqps",
        ),
        Panel(
            "Envoy responses to clients",
            "Responses of the gateway listener by status class.",
            (
                Target(
                    "sum by (envoy_response_code_class) (rate(envoy_http_downstream_rq_xx"
                    f'{{envoy_http_conn_manager_prefix="wakegate"}}[{RI}]))',
                    "{{envoy_response_code_class}}xx",
                ),
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Envoy upstream errors",
            "5xx answers, connect failures and timeouts towards upstream clusters (backends, extproc, feeder).",
            (
                # Envoy creates the 5xx series on the first 5xx: `or ... * 0` shows zero until then.
                Target(
                    f'sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_xx{{envoy_response_code_class="5"}}'
                    f"[{RI}])) or sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_completed[{RI}])) * 0",
                    "5xx {{envoy_cluster_name}}",
                ),
                Target(
                    f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_cx_connect_fail[{RI}]))",
                    "connect failures {{envoy_cluster_name}}",
                ),
                Target(
                    f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_timeout[{RI}]))",
                    "timeouts {{envoy_cluster_name}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Rate-limit and queue rejections",
            "429 answers (rate limit or full cold queue) and 503 answers (cold model rejected, activation "
            "timeout or failure), per model.",
            (
                Target(
                    f'sum by (model, reason) (rate(wakegate_gateway_requests_total{{code=~"429|503"}}[{RI}]))',
                    "{{reason}} {{model}}",
                ),
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Routes",
            "Models each gateway knows, and route-table updates received from the feeder.",
            (
                Target("max by (instance) (wakegate_gateway_models)", "models {{instance}}"),
                Target(
                    f"sum by (instance) (rate(wakegate_gateway_route_updates_total[{RI}])) * 60",
                    "updates/min {{instance}}",
                ),
            ),
        ),
    ),
)

DASHBOARDS = (FLEET, MODEL, GATEWAY)
