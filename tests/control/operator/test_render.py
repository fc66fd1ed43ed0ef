"""Rendering a Model + InferenceRuntime into Kubernetes objects, and choosing the runtime."""

from __future__ import annotations

from typing import Any

import pytest

from wakegate.control.backends import BACKENDS
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object, runtime_from_object
from wakegate.control.operator import render as rnd
from wakegate.control.runtimes import shipped_runtimes

#: The memory-backed /dev/shm every backend pod gets (the shipped runtimes' default size).
SHM = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}


def model(name: str = "m", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"backend": "sim", **spec},
        "status": {"phase": "Ready"},
    }


def runtime(name: str = "sim", **spec: Any) -> dict[str, Any]:
    base = next(r for r in shipped_runtimes() if r["metadata"]["name"] == "sim")
    return {**base, "metadata": {"name": name}, "spec": {**base["spec"], **spec}}


def shipped(name: str) -> dict[str, Any]:
    return next(r for r in shipped_runtimes() if r["metadata"]["name"] == name)


def render(
    body: dict[str, Any], rt: dict[str, Any] | None = None, initial: int | None = None, **settings: Any
) -> rnd.Rendered:
    return rnd.render(body, runtime_from_object(rt or runtime()), rnd.Settings(**settings), initial)


def kinds(rendered: rnd.Rendered) -> list[str]:
    return [o["kind"] for o in rendered.objects]


def obj(rendered: rnd.Rendered, kind: str) -> dict[str, Any]:
    return next(o for o in rendered.objects if o["kind"] == kind)


def test_keda_model_renders_service_deployment_and_scaled_object_without_replicas() -> None:
    out = render(model(scaling={"min": 0, "max": 1}), scaler_address="s:1")
    assert kinds(out) == ["Service", "Deployment", "ScaledObject"]
    dep = obj(out, "Deployment")
    assert "replicas" not in dep["spec"]
    assert dep["metadata"]["name"] == "wg-m" and dep["metadata"]["namespace"] == "ns"
    assert dep["metadata"]["labels"] == names.backend_labels("m")
    assert dep["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "wakegate.io/v1alpha1",
            "kind": "Model",
            "name": "m",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    so = obj(out, "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == "wg-m"
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (0, 1)
    assert so["spec"]["triggers"] == [
        {"type": "external-push", "metadata": {"scalerAddress": "s:1", "model": "ns/m", "targetInFlight": "8"}}
    ]
    assert out.autoscaling.status == "True"


def test_scaled_object_idles_once_and_scales_with_the_builtin_windows() -> None:
    """IsActive already waits idleTimeout: KEDA must not wait again (cooldownPeriod 0), and its HPA
    scales out after the builtin scale-out window (2 s) straight to what demand needs, in after 30 s."""
    so = obj(render(model(scaling={"min": 0, "max": 5, "idleTimeout": 120})), "ScaledObject")
    assert so["spec"]["cooldownPeriod"] == 0
    # KEDA scales to zero only at a poll: within a tenth of idleTimeout, 1 s to KEDA's default 30 s.
    assert so["spec"]["pollingInterval"] == 12
    assert [rnd.polling_interval(t) for t in (1, 6, 300, 86400)] == [1, 1, 30, 30]
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 2
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 5, "periodSeconds": 1}]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 30
    assert behavior["scaleDown"]["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": 1}]


def test_the_models_scale_in_window_is_the_hpas_scale_down_window() -> None:
    so = obj(render(model(scaling={"min": 0, "max": 5, "scaleInWindow": 7})), "ScaledObject")
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 7


def test_keda_auth_secret_adds_an_owned_trigger_authentication_the_trigger_names() -> None:
    out = render(model(scaling={"min": 0, "max": 2}), scaler_address="s:1", keda_auth_secret="keda-client")
    assert kinds(out) == ["Service", "Deployment", "PodDisruptionBudget", "TriggerAuthentication", "ScaledObject"]
    auth = obj(out, "TriggerAuthentication")
    assert auth["metadata"]["name"] == "wg-m" and auth["metadata"]["namespace"] == "ns"
    assert auth["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "caCert", "name": "keda-client", "key": "ca.crt"},
        {"parameter": "tlsClientCert", "name": "keda-client", "key": "tls.crt"},
        {"parameter": "tlsClientKey", "name": "keda-client", "key": "tls.key"},
    ]
    trigger = obj(out, "ScaledObject")["spec"]["triggers"][0]
    assert trigger["authenticationRef"] == {"name": "wg-m"}
    # The builtin engine and a KEDA install without the CRDs get neither object.
    builtin = render(model(scaling={"engine": "builtin"}), keda_auth_secret="keda-client")
    assert kinds(builtin) == ["Service", "Deployment"]
    assert kinds(render(model(), keda_available=False, keda_auth_secret="keda-client")) == ["Service"]


def test_scaled_object_follows_spec_changes() -> None:
    first = obj(render(model(scaling={"min": 0, "max": 2, "targetInFlight": 4})), "ScaledObject")
    second = obj(render(model(scaling={"min": 1, "max": 6, "targetInFlight": 2})), "ScaledObject")
    assert (first["spec"]["maxReplicaCount"], second["spec"]["maxReplicaCount"]) == (2, 6)
    assert (first["spec"]["minReplicaCount"], second["spec"]["minReplicaCount"]) == (0, 1)
    assert second["spec"]["triggers"][0]["metadata"]["targetInFlight"] == "2"
    up = second["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]
    assert up["policies"][0]["value"] == 6


def test_initial_replicas_only_when_asked() -> None:
    assert obj(render(model(), initial=3), "Deployment")["spec"]["replicas"] == 3


def test_pdb_only_when_more_than_one_replica_may_run() -> None:
    assert "PodDisruptionBudget" not in kinds(render(model(scaling={"max": 1, "engine": "builtin"})))
    pdb = obj(render(model(scaling={"max": 3, "engine": "builtin"})), "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels("m")}}


def test_keda_engine_without_scaledobject_crd_renders_no_deployment() -> None:
    out = render(model(), keda_available=False)
    assert kinds(out) == ["Service"]
    assert (out.autoscaling.status, out.autoscaling.reason) == ("False", "ScaledObjectCRDMissing")
    assert "builtin" in out.autoscaling.message
    builtin = render(model(scaling={"engine": "builtin"}), keda_available=False)
    assert kinds(builtin) == ["Service", "Deployment"]
    assert builtin.autoscaling.status == "True"


def test_pod_template_from_runtime_and_model() -> None:
    body = model(
        servedName="org/m",
        args=["--ttft-ms", "5"],
        env={"A": "1"},
        nodeSelector={"zone": "a"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        resources={"gpu": {"count": 2, "vendor": "amd", "minVramMb": 24000, "arch": ["gfx942"]}, "memory": "8Gi"},
    )
    rt = runtime(
        gpuVendors=["nvidia", "amd"],
        env={"PORT_IS": "{port}"},
        scheduling={"nodeSelector": {"zone": "b", "pool": "gpu"}},
    )
    dep = obj(render(body, rt), "Deployment")
    template = dep["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/wakegate/sim:latest"
    assert "command" not in container
    assert container["args"] == ["--served-model-name", "org/m", "--ttft-ms", "5"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 1}}}
    assert container["env"] == [{"name": "A", "value": "1"}, {"name": "PORT_IS", "value": "8000"}]
    assert container["resources"] == {"requests": {"memory": "8Gi", "amd.com/gpu": "2"}, "limits": {"amd.com/gpu": "2"}}
    assert template["metadata"]["annotations"] == {
        names.ANNOTATION_BACKEND: "sim",
        names.ANNOTATION_VRAM_ESTIMATE: "24000",
        names.ANNOTATION_METRICS_PATH: "/metrics",
        names.ANNOTATION_METRICS_PREFIX: "vllm:",
    }
    assert template["metadata"]["labels"] == names.backend_labels("m")
    assert template["spec"]["nodeSelector"] == {"zone": "a", "pool": "gpu"}
    assert template["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0] == {
        "key": names.NODE_GPU_ARCH,
        "operator": "In",
        "values": ["gfx942"],
    }
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_cpu_model_has_no_resources_and_default_strategy() -> None:
    dep = obj(render(model()), "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in container and "strategy" not in dep["spec"]


def test_gpu_vendor_without_accelerator_resource_is_a_render_error() -> None:
    with pytest.raises(rnd.RenderError) as err:
        render(model(resources={"gpu": {"count": 1}}))
    assert err.value.reason == "NoAcceleratorResource"


@pytest.mark.parametrize(
    ("source", "arg", "volume_key"),
    [
        ("hf://org/llama", "org/llama", None),
        ("pvc://weights/llama/7b", "/models/weights/llama/7b", "persistentVolumeClaim"),
        ("oci://reg.io/w/llama@sha256:" + "a" * 64, "/models", "image"),
    ],
)
def test_sources(source: str, arg: str, volume_key: str | None) -> None:
    rt = runtime(args=["--model", "{model}"])
    spec = obj(render(model(source=source), rt), "Deployment")["spec"]["template"]["spec"]
    assert spec["containers"][0]["args"] == ["--model", arg]
    weights = [v for v in spec["volumes"] if v["name"] == rnd.WEIGHTS_VOLUME]
    if volume_key is None:
        assert weights == []
    else:
        assert volume_key in weights[0]
        assert spec["containers"][0]["volumeMounts"][0]["readOnly"] is True


def test_vllm_runtime_renders_its_command() -> None:
    body = model(backend="vllm", source="hf://org/x", resources={"gpu": {"count": 1}})
    container = obj(render(body, shipped("vllm-cuda")), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm", "serve"]
    assert container["args"][:1] == ["org/x"]
    assert "0.0.0.0" in container["args"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_vllm_pods_publish_kv_events_where_the_routing_says() -> None:
    """kvEvents: vLLM binds `tcp://*:PORT+OFFSET` in the pod (gateways connect to the pod's IP),
    with its prefix cache on; a Model whose args configure the events itself keeps its own."""
    routing = {"profile": "precise", "kvEvents": {"portOffset": 1, "replayPortOffset": 2}}
    body = model(backend="vllm", source="hf://org/x", resources={"gpu": {"count": 1}}, routing=routing)
    args = obj(render(body, shipped("vllm-cuda")), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-3:] == [
        "--enable-prefix-caching",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:8001",'
        '"replay_endpoint":"tcp://*:8002","topic":"kv-events"}',
    ]
    own = ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']
    body = model(backend="vllm", source="hf://org/x", resources={"gpu": {"count": 1}}, routing=routing, args=own)
    args = obj(render(body, shipped("vllm-cuda")), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == own and args.count("--kv-events-config") == 1


def test_digest_is_stable_and_follows_content() -> None:
    assert render(model()).digest() == render(model()).digest()
    assert render(model()).digest() != render(model(args=["x"])).digest()
    # Routing-only fields change nothing that is applied.
    assert render(model()).objects == render(model(limits={"requestsPerSecond": 3})).objects


def test_select_explicit_runtime() -> None:
    custom = runtime("mine", image="example/sim:1")
    chosen = rnd.select_runtime(model_from_object(model(runtimeRef={"name": "mine"})), [custom])
    assert chosen.spec.image == "example/sim:1"
    with pytest.raises(rnd.RenderError) as missing:
        rnd.select_runtime(model_from_object(model(runtimeRef={"name": "nope"})), [custom])
    assert missing.value.reason == "RuntimeNotFound"
    with pytest.raises(rnd.RenderError) as mismatch:
        rnd.select_runtime(model_from_object(model(runtimeRef={"name": "vllm-cuda"})), [shipped("vllm-cuda")])
    assert mismatch.value.reason == "RuntimeMismatch"


def test_select_best_match_prefers_vendor_then_shipped() -> None:
    body = model_from_object(model(backend="vllm", resources={"gpu": {"count": 1, "vendor": "amd"}}))
    rocm = runtime("my-vllm-rocm", backend="vllm", gpuVendors=["amd"])
    cuda = runtime("my-vllm-cuda", backend="vllm", gpuVendors=["nvidia"])
    assert rnd.select_runtime(body, [cuda, rocm, *shipped_runtimes()]).metadata.name == "vllm-rocm"
    assert rnd.select_runtime(body, [cuda]).metadata.name == "vllm-rocm"  # shipped fallback
    # The CUDA image never lands on an AMD request, and no GPU means the CPU image.
    nvidia = model_from_object(
        model(backend="llamacpp", source="file:///m/x.gguf", resources={"gpu": {"count": 1, "vendor": "nvidia"}})
    )
    assert rnd.select_runtime(nvidia, []).metadata.name == "llamacpp-cuda"
    cpu = model_from_object(model(backend="llamacpp", source="file:///m/x.gguf"))
    assert rnd.select_runtime(cpu, []).metadata.name == "llamacpp"
    any_gpu = model_from_object(model(backend="llamacpp", source="file:///m/x.gguf", resources={"gpu": {"count": 1}}))
    assert rnd.select_runtime(any_gpu, []).spec.gpuVendors  # a GPU image, not the CPU one
    # An engine without a published image needs the user's own runtime, and says so.
    with pytest.raises(rnd.RenderError, match=r"spec\.runtimeRef"):
        rnd.select_runtime(model_from_object(model(backend="mlc-llm")), [])
    # A user's runtime is not picked over the shipped one without runtimeRef.
    assert rnd.select_runtime(model_from_object(model()), [runtime("custom")]).metadata.name == "sim"
    # Invalid runtime objects are ignored.
    broken = {"metadata": {"name": "x"}, "spec": {}}
    assert rnd.select_runtime(model_from_object(model()), [broken]).metadata.name == "sim"


def test_every_backend_ships_a_valid_runtime() -> None:
    runtimes = {r["metadata"]["name"]: runtime_from_object(r) for r in shipped_runtimes()}
    # One runtime per published image; engines without one (MLC LLM, ComfyUI, diffusers) ship none.
    assert {rt.spec.backend for rt in runtimes.values()} == {b.name for b in BACKENDS.values() if b.images}
    for rt in runtimes.values():
        backend = BACKENDS[rt.spec.backend]
        image = next(
            i
            for i in backend.images
            if i.reference == rt.spec.image
            and (i.vendor == "cpu") == (not rt.spec.gpuVendors)
            and (not rt.spec.gpuVendors or rt.spec.gpuVendors == [i.vendor])
        )
        assert rt.spec.port == backend.default_port
        assert rt.spec.gpuVendors == ([] if image.vendor == "cpu" else [image.vendor])
        assert len(rt.spec.gpuVendors) <= 1  # a runtime's image is built for one vendor


def test_llamacpp_gets_the_file_from_a_host_path() -> None:
    body = model(backend="llamacpp", servedName="org/tiny", source="file:///srv/models/tiny.gguf")
    pod = obj(render(body, shipped("llamacpp")), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["volumes"] == [{"name": "weights", "hostPath": {"path": "/srv/models", "type": "Directory"}}, SHM]
    mount = container["volumeMounts"][0]
    assert mount["readOnly"] is True
    args = container["args"]
    # The engine loads the mounted file and serves the served name, never the Model's name.
    assert args[args.index("--model") + 1] == f"{mount['mountPath']}/tiny.gguf"
    assert args[args.index("--alias") + 1] == "org/tiny"
    assert container["command"] == ["/app/llama-server"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_file_engines_refuse_what_they_cannot_load_on_a_cluster() -> None:
    for source, words in (("hf://org/repo", "one GGUF file"), ("file://rel/x.gguf", "absolute")):
        with pytest.raises(rnd.RenderError, match=words) as err:
            render(model(backend="llamacpp", source=source), shipped("llamacpp"))
        assert err.value.reason == "SourceUnsupported"


def test_ollama_pod_creates_its_model_and_is_ready_once_it_exists() -> None:
    body = model(backend="ollama", servedName="tiny", source="file:///srv/models/tiny.gguf")
    container = obj(render(body, shipped("ollama")), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    script, _, gguf, name = container["args"]
    assert "ollama serve" in script and 'ollama create "$2"' in script
    assert gguf.endswith("/tiny.gguf") and name == "tiny"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/models/tiny"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OLLAMA_HOST"] == "0.0.0.0:11434" and env["OLLAMA_KEEP_ALIVE"] == "-1"


def pod_spec(body: dict[str, Any], rt: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = obj(render(body, rt), "Deployment")["spec"]["template"]["spec"]
    return spec


def test_secret_env_is_a_secret_key_ref_and_the_value_appears_nowhere() -> None:
    body = model(
        env={"A": "1"},
        secretEnv=[{"name": "HF_TOKEN", "secretKeyRef": {"name": "hf", "key": "token"}}],
    )
    rt = runtime(env={"HF_TOKEN": "from-runtime", "B": "2"})
    container = pod_spec(body, rt)["containers"][0]
    assert container["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "2"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": False}}},
    ]
    assert not any(a == "hf" or "token" in a for a in container["args"])


@pytest.mark.parametrize(
    "spec",
    [
        {"env": {"HF_TOKEN": "x"}, "secretEnv": [{"name": "HF_TOKEN", "secretKeyRef": {"name": "s", "key": "k"}}]},
        {
            "secretEnv": [
                {"name": "T", "secretKeyRef": {"name": "s", "key": "k"}},
                {"name": "T", "secretKeyRef": {"name": "s", "key": "j"}},
            ]
        },
    ],
)
def test_a_variable_set_twice_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="set twice"):
        model_from_object(model(**spec))


def test_image_pull_secrets_from_runtime_and_model_without_repeats() -> None:
    spec = pod_spec(
        model(imagePullSecrets=[{"name": "mine"}, {"name": "shared"}]),
        runtime(imagePullSecrets=[{"name": "shared"}]),
    )
    assert spec["imagePullSecrets"] == [{"name": "shared"}, {"name": "mine"}]
    assert "imagePullSecrets" not in pod_spec(model())


def test_dev_shm_is_memory_backed_and_sized_by_the_runtime() -> None:
    spec = pod_spec(model(), runtime(shmSize="16Gi"))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    none = pod_spec(model(), runtime(shmSize="0"))
    assert "volumes" not in none and "volumeMounts" not in none["containers"][0]


def test_startup_probe_covers_the_load_time_and_liveness_comes_from_the_runtime() -> None:
    rt = runtime(
        readinessProbe={"path": "/ready", "periodSeconds": 4, "failureThreshold": 3},
        livenessProbe={"path": "/alive", "periodSeconds": 10, "failureThreshold": 6},
        lifecycle={"progressDeadlineSeconds": 1801},
    )
    container = pod_spec(model(), rt)["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    assert startup["periodSeconds"] == 4
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1801
    assert container["readinessProbe"]["failureThreshold"] == 3
    assert container["livenessProbe"]["httpGet"]["path"] == "/alive"
    own = pod_spec(model(), runtime(startupProbe={"path": "/loaded", "failureThreshold": 50}))["containers"][0]
    assert own["startupProbe"]["httpGet"]["path"] == "/loaded" and own["startupProbe"]["failureThreshold"] == 50
    bare = runtime()
    bare["spec"] = {k: v for k, v in bare["spec"].items() if k != "livenessProbe"}
    assert "livenessProbe" not in pod_spec(model(), bare)["containers"][0]


def test_shipped_runtimes_probe_liveness_on_the_health_path_not_the_model_path() -> None:
    ollama = shipped("ollama")
    assert ollama["spec"]["readinessProbe"]["path"] != ollama["spec"]["livenessProbe"]["path"]
    assert ollama["spec"]["livenessProbe"]["path"] == BACKENDS["ollama"].health_path


def test_gpu_pods_tolerate_their_vendors_taint_once() -> None:
    nvidia = pod_spec(model(resources={"gpu": {"count": 1, "vendor": "nvidia"}}), runtime(gpuVendors=["nvidia"]))
    assert nvidia["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    own = [{"key": "nvidia.com/gpu", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}]
    merged = pod_spec(
        model(resources={"gpu": {"count": 1, "vendor": "nvidia"}}, tolerations=own),
        runtime(gpuVendors=["nvidia"], scheduling={"tolerations": [{"key": "spot", "operator": "Exists"}]}),
    )
    assert merged["tolerations"] == [
        {"key": "spot", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists"},
    ]
    assert "tolerations" not in pod_spec(model())


def test_termination_grace_period_is_the_runtimes_and_outlasts_the_pre_stop_sleep() -> None:
    spec = pod_spec(model(), runtime(lifecycle={"terminationGracePeriodSeconds": 120, "preStopDrainSeconds": 5}))
    assert spec["terminationGracePeriodSeconds"] == 120
    assert spec["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    short = pod_spec(model(), runtime(lifecycle={"terminationGracePeriodSeconds": 2, "preStopDrainSeconds": 10}))
    assert short["terminationGracePeriodSeconds"] > 10


def test_backend_pods_name_the_runtimes_metrics_path_only_when_the_engine_exports_series() -> None:
    def annotations(body: dict[str, Any], rt: dict[str, Any]) -> dict[str, str]:
        meta: dict[str, str] = obj(render(body, rt), "Deployment")["spec"]["template"]["metadata"]["annotations"]
        return meta

    gguf = {"servedName": "tiny", "source": "file:///srv/models/tiny.gguf"}
    llama = annotations(model(backend="llamacpp", **gguf), shipped("llamacpp"))
    assert llama[names.ANNOTATION_METRICS_PATH] == "/metrics"
    assert llama[names.ANNOTATION_METRICS_PREFIX] == "llamacpp:"
    # A runtime of its own serves its metrics elsewhere: the pod (and so the PodMonitor) follows it.
    custom = runtime(metrics={"prefix": "vllm:", "path": "/engine/metrics"})
    assert annotations(model(), custom)[names.ANNOTATION_METRICS_PATH] == "/engine/metrics"
    # Ollama exports no Prometheus series: nothing to scrape.
    ollama = annotations(model(backend="ollama", **gguf), shipped("ollama"))
    assert names.ANNOTATION_METRICS_PATH not in ollama and names.ANNOTATION_METRICS_PREFIX not in ollama
