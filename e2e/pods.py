"""One pod on a fake node: its IP, its containers in order, its status like a kubelet's.

Per pod: an IP from its node's range (already on the node namespace's eth0
when the worker starts; `netns` None for hostNetwork pods, which run in the
root namespace with 127.0.0.1), init containers in order, then the app
containers (e2e/containers.py), all inside the node's network namespace. Status is written as a full merge patch of the
fields a kubelet owns whenever something changes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from e2e import images
from e2e.containers import ConfigError, Container, Settings
from e2e.kubeapi import ApiError, KubeAPI
from e2e.nodes import now

log = logging.getLogger("e2e.nodeagent")

#: environment the agent's own process has that must not leak into "containers"
_HOST_ONLY_ENV = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")

#: conditions this agent owns on a pod; any others (PodScheduled, DisruptionTarget, gates) are kept
_OWNED = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


class PodWorker:
    """Everything the agent does for one pod UID."""

    def __init__(
        self,
        pod: dict[str, Any],
        ip: str,
        api: KubeAPI,
        http: aiohttp.ClientSession,
        work_dir: Path,
        agent_settings: Settings,
        netns: str | None = None,
    ) -> None:
        self.pod = pod
        #: the node's network namespace the containers (and exec probes) run in; None: the root one
        self.netns = netns
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.ip = ip
        self.api = api
        self.http = http
        self.agent_settings = agent_settings
        self.dir: Path = work_dir / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        self.init_containers = [Container(self, c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [Container(self, c) for c in spec.get("containers") or []]
        self.start_time = now()
        self.initialized = not self.init_containers
        self.phase = "Pending"
        self.terminating = False
        self.gone = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self._dirty = asyncio.Event()
        self._last_sent: dict[str, Any] | None = None
        self._kubeconfig: Path | None = None
        self._write = asyncio.Lock()
        self._tasks = [asyncio.create_task(self._run()), asyncio.create_task(self._status_loop())]

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    def changed(self) -> None:
        self._dirty.set()

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod from the watch."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp") and not self.terminating:
            grace = float(pod["metadata"].get("deletionGracePeriodSeconds", 30))
            self.terminating = True
            self._tasks.append(asyncio.create_task(self._graceful_delete(grace)))
        self.changed()  # gates or conditions of others may have changed

    # -- running -------------------------------------------------------------

    async def _run(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.init_containers:
            # An init container is retried (with backoff) unless the policy is Never.
            await c.run("Never" if policy == "Never" else "OnFailure")
            if self.terminating:
                return
            if c.exit_code != 0:
                self.phase = "Failed"
                self.changed()
                return
        self.initialized = True
        self.changed()
        await asyncio.gather(*(c.run(policy) for c in self.containers))
        if not self.terminating:
            # Only Never/OnFailure pods get here: every container is done for good.
            self.phase = "Succeeded" if all(c.exit_code == 0 for c in self.containers) else "Failed"
            self.changed()

    async def _graceful_delete(self, grace: float) -> None:
        await self.stop(grace)
        if self.phase not in ("Succeeded", "Failed"):
            # Since 1.27 the kubelet gives deleted pods a terminal phase before removing them.
            codes = [c.exit_code for c in self.containers if c.ran]
            self.phase = "Succeeded" if codes and all(code == 0 for code in codes) else "Failed"
        self.changed()
        await self._flush_status()
        with contextlib.suppress(ApiError):
            # The final delete, as the kubelet does once the containers are gone.
            await self.api.delete(self.path, {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})

    async def stop(self, grace: float) -> None:
        self.terminating = True
        await asyncio.gather(*(c.stop(grace) for c in self.init_containers + self.containers))

    async def kill(self) -> None:
        """The pod object is gone: end everything now."""
        self.gone = True
        for c in self.init_containers + self.containers:
            c.force_kill()
        await self.stop(0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- environment ---------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY_ENV}
        env["HOSTNAME"] = self.name
        env["POD_IP"] = self.ip
        return env

    async def container_env(self, spec: dict[str, Any]) -> dict[str, str]:
        env = self.base_env()
        kubeconfig = await self._sa_kubeconfig()
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind in ("configMapRef", "secretRef"):
                if kind in src:
                    data = await self._object_data(kind, src[kind]["name"], bool(src[kind].get("optional")))
                    env.update({prefix + k: v for k, v in data.items()})
        for var in spec.get("env") or []:
            if "valueFrom" in var:
                value = await self._value_from(var["valueFrom"], spec)
                if value is None:
                    continue
                env[var["name"]] = value
            else:
                env[var["name"]] = images.expand(var.get("value", ""), env)
        return env

    async def volume_mounts(self, spec: dict[str, Any]) -> list[tuple[str, str]]:
        """Secret and ConfigMap volumes the container mounts, written out as files (a key each, as
        the kubelet projects them) under the pod's folder: (mountPath, folder). Read once per
        container start; a changed object shows at the next start."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        mounts: list[tuple[str, str]] = []
        for mount in spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            for kind, field in (("secretRef", "secret"), ("configMapRef", "configMap")):
                if field not in volume:
                    continue
                source = volume[field]
                name = source.get("secretName") if field == "secret" else source.get("name")
                data = await self._object_data(kind, name, bool(source.get("optional")))
                folder = self.dir / "volumes" / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o700)
                for key, value in data.items():
                    path = folder / key
                    path.write_text(value)
                    path.chmod(0o600)
                mounts.append((mount["mountPath"], str(folder)))
        return mounts

    async def _object_data(self, kind: str, name: str, optional: bool) -> dict[str, str]:
        plural = "configmaps" if kind.startswith("configMap") else "secrets"
        try:
            obj = await self.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404 and optional:
                return {}
            raise ConfigError(f'{plural[:-1]} "{name}" not found') from exc
        data: dict[str, str] = dict(obj.get("data") or {})
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        return data

    async def _value_from(self, source: dict[str, Any], spec: dict[str, Any]) -> str | None:
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            resource = source["resourceFieldRef"]["resource"]
            section, _, name = resource.partition(".")
            value = ((spec.get("resources") or {}).get(section) or {}).get(name)
            return str(value) if value is not None else "0"
        for kind in ("configMapKeyRef", "secretKeyRef"):
            if kind in source:
                ref = source[kind]
                data = await self._object_data(kind, ref["name"], bool(ref.get("optional")))
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise ConfigError(f'key "{ref["key"]}" not found in {ref["name"]}')
                return data[ref["key"]]
        return None

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        simple: dict[str, str] = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
        }
        if path in simple:
            return simple[path]
        for key in ("labels", "annotations"):
            prefix = f"metadata.{key}['"
            if path.startswith(prefix) and path.endswith("']"):
                return str((meta.get(key) or {}).get(path[len(prefix):-2], ""))
        raise ConfigError(f"unsupported fieldRef {path}")

    async def _sa_kubeconfig(self) -> Path | None:
        """A kubeconfig holding a bound token of the pod's service account.

        Pods cannot reach the apiserver through the `kubernetes` Service here, so
        instead of a mounted token they get KUBECONFIG; RBAC still applies.
        """
        if self._kubeconfig is not None:
            return self._kubeconfig
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        sa = spec.get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [],
                "expirationSeconds": 86400,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
            },
        }
        try:
            answer = await self.api.create(
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", request
            )
        except ApiError as exc:
            log.warning("%s: no service-account token: %s", self.name, exc)
            return None
        config = self.api.config
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": config.server,
                "certificate-authority-data": base64.b64encode(config.ca_pem or b"").decode(),
            }}],
            "users": [{"name": sa, "user": {"token": answer["status"]["token"]}}],
            "contexts": [
                {"name": "e2e", "context": {"cluster": "e2e", "user": sa, "namespace": self.namespace}}
            ],
            "current-context": "e2e",
        }
        path = self.dir / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        path.chmod(0o600)
        self._kubeconfig = path
        return path

    # -- status --------------------------------------------------------------

    def _condition(self, type_: str, ok: bool) -> dict[str, Any]:
        status = "True" if ok else "False"
        previous = self._transitions.get(type_)
        if previous is None or previous[0] != status:
            self._transitions[type_] = (status, now())
        return {"type": type_, "status": status, "lastTransitionTime": self._transitions[type_][1]}

    def status(self) -> dict[str, Any]:
        containers_ready = all(c.ready for c in self.containers) and self.initialized
        current = (self.pod.get("status") or {}).get("conditions") or []
        existing = [c for c in current if c["type"] not in _OWNED]
        gates_ok = all(
            any(c["type"] == g["conditionType"] and c["status"] == "True" for c in existing)
            for g in self.pod["spec"].get("readinessGates") or []
        )
        running = self.phase in ("Pending", "Running")
        phase = self.phase
        if phase == "Pending" and self.initialized and all(c.ran for c in self.containers):
            phase = "Running"
        conditions = [
            self._condition("PodReadyToStartContainers", running),
            self._condition("Initialized", self.initialized),
            self._condition("ContainersReady", containers_ready and running),
            self._condition("Ready", containers_ready and gates_ok and running),
            *existing,
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        return status

    async def _flush_status(self) -> None:
        async with self._write:
            await self._write_status()

    async def _write_status(self) -> None:
        body = self.status()
        if body == self._last_sent:
            return
        try:
            self.pod = await self.api.merge_patch(f"{self.path}/status", {"status": body})
            self._last_sent = body
        except ApiError as exc:
            if exc.status == 404:
                self.gone = True
                return
            log.warning("%s: status update failed: %s", self.name, exc)
            self._dirty.set()
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("%s: status update failed: %s", self.name, exc)
            self._dirty.set()

    async def _status_loop(self) -> None:
        while not self.gone:
            await self._dirty.wait()
            self._dirty.clear()
            await self._flush_status()
            if self._dirty.is_set():
                # Retrying a failed write: don't spin.
                await asyncio.sleep(0.2)
