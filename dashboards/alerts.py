"""wakegate's Prometheus alerting rules (one group), as a Prometheus rule file.

The chart ships the same groups in a PrometheusRule; `promtool check rules`
validates the generated file. Label contract: see dashboards.definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


ALERTS = (
    Alert(
        "WakegateActivationTimeouts",
        'sum by (model) (increase(wakegate_gateway_requests_total'
        '{reason=~"activation_timeout|activation_failed"}[10m])) > 0',
        "5m",
        "warning",
        "Cold requests to {{ $labels.model }} are answered 503",
        "Gateways answered {{ $value | humanize }} cold requests to {{ $labels.model }} with 503 in 10 minutes: "
        "the model did not become ready within its activationTimeout, or its load failed.",
    ),
    Alert(
        "WakegateModelStuckLoading",
        "(max by (model) (wakegate_model_replicas) > 0) unless (max by (model) (wakegate_model_ready_replicas) > 0)",
        "15m",
        "warning",
        "Model {{ $labels.model }} has replicas but none is ready",
        "{{ $labels.model }} has been Loading for 15 minutes: replicas exist and none passes health. Check "
        "the Model's status conditions (scheduling, image pull, crash loop, OOM).",
    ),
    Alert(
        "WakegateModelCrashLooping",
        "sum by (model) (increase(wakegate_activation_failures_total[15m])) >= 3",
        "0m",
        "critical",
        "Model {{ $labels.model }} keeps failing to start",
        "{{ $labels.model }} crashed or never passed health {{ $value | humanize }} times in 15 minutes.",
    ),
    Alert(
        "WakegatePodCrashLoopBackOff",
        'max by (namespace, pod, container) (kube_pod_container_status_waiting_reason{reason="CrashLoopBackOff", '
        'pod=~"wg-.+|wakegate-.+"}) > 0',
        "5m",
        "critical",
        "Pod {{ $labels.namespace }}/{{ $labels.pod }} is in CrashLoopBackOff",
        "Container {{ $labels.container }} of {{ $labels.namespace }}/{{ $labels.pod }} (a wakegate component or "
        "model backend) keeps restarting (kube-state-metrics).",
    ),
    Alert(
        "WakegateQueueSaturated",
        'sum by (model) (rate(wakegate_gateway_requests_total{reason="queue_full"}[5m])) > 0 '
        "or on (model) (sum by (model) (wakegate_gateway_queue_depth) / max by (model) (wakegate_gateway_queue_limit)"
        " > 0.8)",
        "2m",
        "warning",
        "Cold queue of {{ $labels.model }} is full",
        "Requests to {{ $labels.model }} are refused with 429 while its cold queue holds requests: raise "
        "endpoint.maxQueue or keep a replica warm (scaling.min).",
    ),
    Alert(
        "WakegateScalerMembersExpiring",
        "max_over_time(wakegate_demand_members[10m]) - wakegate_demand_members > 0",
        "5m",
        "warning",
        "Gateways stopped reporting demand to the scaler",
        "The scaler holds {{ $value | humanize }} fewer gateway demand reports than in the last 10 minutes: "
        "gateways expired (silent for 10 s) or withdrew. Check the gateway pods and their path to the scaler.",
    ),
    Alert(
        "WakegateDemandReportsRejected",
        'sum by (reason) (increase(wakegate_demand_rejections_total{reason!="stale"}[10m])) > 0',
        "0m",
        "warning",
        "The scaler refuses demand reports ({{ $labels.reason }})",
        "{{ $value | humanize }} demand reports were refused in 10 minutes for reason {{ $labels.reason }}: "
        "a wrong internal token, or a gateway over the member or size limits.",
    ),
    Alert(
        "WakegateInternalAuthRefused",
        "sum by (service) (increase(wakegate_internal_auth_refused_total[10m])) > 0",
        "0m",
        "warning",
        "Calls without the internal token refused ({{ $labels.service }})",
        "{{ $value | humanize }} {{ $labels.service }} calls were refused in 10 minutes for a missing or wrong "
        "internal token: a gateway with an old token after a rotation, or something else probing the port. "
        "The feeder's log names the peer.",
    ),
    Alert(
        "WakegateGatewayErrorRatio",
        'sum(rate(envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix="wakegate", '
        'envoy_response_code_class="5"}[5m])) '
        '/ sum(rate(envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix="wakegate"}[5m])) > 0.05',
        "5m",
        "critical",
        "More than 5% of gateway responses are 5xx",
        "{{ $value | humanizePercentage }} of the responses the gateway sent clients in 5 minutes were 5xx.",
    ),
    Alert(
        "WakegateModelErrorRatio",
        'sum by (model) (rate(wakegate_gateway_requests_total{code=~"5.."}[5m])) '
        "/ sum by (model) (rate(wakegate_gateway_requests_total[5m])) > 0.05",
        "5m",
        "warning",
        "More than 5% of requests to {{ $labels.model }} fail in the gateway",
        "{{ $value | humanizePercentage }} of the requests to {{ $labels.model }} were answered 5xx by extproc.",
    ),
)


def rule_groups() -> dict[str, Any]:
    """The rule file: `groups:` as Prometheus and the PrometheusRule CRD both read it."""
    return {
        "groups": [
            {
                "name": "wakegate",
                "rules": [
                    {
                        "alert": alert.name,
                        "expr": alert.expr,
                        "for": alert.for_,
                        "labels": {"severity": alert.severity},
                        "annotations": {"summary": alert.summary, "description": alert.description},
                    }
                    for alert in ALERTS
                ],
            }
        ]
    }
