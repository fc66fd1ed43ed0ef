"""One container of a fake-node pod: a local process with a kubelet's lifecycle.

"Pull" (look the image up in e2e/images.py), start, probe, restart with
backoff per restartPolicy, and stop gracefully (preStop, SIGTERM, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from e2e import images, net
from e2e.nodes import now
from e2e.probes import Handler, probe_loop
from e2e.procs import die_with_parent, kill_group

log = logging.getLogger("e2e.nodeagent")

#: the kubelet's own pull backoff would make ImagePullBackOff tests slow; the
#: ErrImagePull -> ImagePullBackOff sequence is what matters
PULL_RETRY_SECONDS = 1.0
#: containers that ran at least this long restart without backoff
BACKOFF_RESET_SECONDS = 600.0


@dataclass
class Settings:
    backoff_initial: float = 10.0
    backoff_max: float = 300.0


class ConfigError(Exception):
    """A referenced ConfigMap/Secret key is missing (CreateContainerConfigError)."""


def exit_reason(code: int) -> tuple[int, str]:
    """(exitCode, reason) as the kubelet reports a finished container."""
    if code < 0:  # killed by a signal
        return 128 - code, "Error"
    if code == 137:  # what the kernel OOM killer leaves behind
        return 137, "OOMKilled"
    return code, "Completed" if code == 0 else "Error"


def container_preexec(netns: str | None, binds: list[tuple[str, str, bool]] | None = None) -> Callable[[], None]:
    """Tie the child to the agent (PR_SET_PDEATHSIG), then move it into the node's namespace,
    and with `binds` ((host path, mount path, read only)) into a mount namespace of its own with
    those bound.

    setns in the forked child keeps the PID (containerID e2e://PID, signals to its
    group) the real process; the agent itself stays in the root namespace.
    """
    tie = die_with_parent()
    if netns is None and not binds:
        return tie
    enter = net.netns_preexec(netns) if netns is not None else None

    def preexec() -> None:
        tie()
        if enter is not None:
            enter()
        if binds:
            net.bind_mounts(binds)

    return preexec


def _mount_points(paths: list[str]) -> list[Path]:
    """Make the folders `paths` need to be mounted on; returns those made (parents first)."""
    made: list[Path] = []
    for path in paths:
        missing = [p for p in [Path(path), *Path(path).parents] if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
    return made


class PodHost(Protocol):
    """What a container needs of its pod (e2e/pods.py's PodWorker is the one there is)."""

    pod: dict[str, Any]
    name: str
    ip: str
    dir: Path
    netns: str | None
    http: aiohttp.ClientSession
    agent_settings: Settings

    def changed(self) -> None: ...
    async def container_env(self, spec: dict[str, Any]) -> dict[str, str]: ...
    async def volume_mounts(self, spec: dict[str, Any]) -> list[tuple[str, str]]: ...


class Container:
    """One container: "pull", start, probe, restart with backoff, stop gracefully."""

    def __init__(self, pod: PodHost, spec: dict[str, Any], init: bool = False) -> None:
        self.pod = pod
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.restart_count = 0
        self.ready = False
        self.started = False
        self.ran = False
        self.container_id = ""
        self.exit_code: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._stop_grace = 0.0
        self._kill = asyncio.Event()
        self._active = False
        self._done = asyncio.Event()
        self._probes: list[asyncio.Task[None]] = []

    # -- status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.spec.get("image", "") if self.ran else "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status

    def _set(self, state: dict[str, Any], ready: bool | None = None) -> None:
        self.state = state
        if ready is not None:
            self.ready = ready
        self.pod.changed()

    # -- lifecycle -----------------------------------------------------------

    async def _pause(self, seconds: float) -> bool:
        """Sleep unless stopped first; False if stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return not self._stopping.is_set()

    async def run(self, restart_policy: str) -> None:
        """Run until the container is done for good under `restart_policy`, or stopped."""
        self._active = True
        try:
            await self._loop(restart_policy)
        finally:
            self._done.set()

    async def _loop(self, restart_policy: str) -> None:
        settings = self.pod.agent_settings
        backoff = 0.0
        pull_failures = 0
        while not self._stopping.is_set():
            image = self.spec.get("image", "")
            recipe = images.lookup(image)
            if recipe is None:
                pull_failures += 1
                message = f'image "{image}" is not in the e2e image map (e2e/images.py IMAGES)'
                self._set({"waiting": {"reason": "ErrImagePull", "message": message}})
                if not await self._pause(PULL_RETRY_SECONDS):
                    break
                back = f'Back-off pulling image "{image}": {message}'
                self._set({"waiting": {"reason": "ImagePullBackOff", "message": back}})
                if not await self._pause(min(PULL_RETRY_SECONDS * 2**pull_failures, settings.backoff_max)):
                    break
                continue
            try:
                env = await self.pod.container_env(self.spec)
                ctx = self._context(env, await self.pod.volume_mounts(self.spec))
                argv = recipe(ctx)
            except (ConfigError, ValueError) as exc:
                config_error = isinstance(exc, ConfigError)
                reason = "CreateContainerConfigError" if config_error else "CreateContainerError"
                self._set({"waiting": {"reason": reason, "message": str(exc)}})
                if not await self._pause(PULL_RETRY_SECONDS):
                    break
                continue
            if self.ran:
                self.restart_count += 1
            started_at = time.monotonic()
            binds = self._binds() if recipe in images.REAL_MOUNTS else []
            code = await self._run_once(argv, env, ctx, binds)
            if self._stopping.is_set():
                break
            self.exit_code = code
            if restart_policy == "Never" or (restart_policy == "OnFailure" and code == 0):
                return
            if time.monotonic() - started_at > BACKOFF_RESET_SECONDS:
                backoff = 0.0
            if backoff > 0:
                # Like the kubelet: the dead container stays lastState while we wait.
                self.last_state = self.state
                message = (
                    f"back-off {backoff:.0f}s restarting failed container={self.name} pod={self.pod.name}"
                )
                self._set({"waiting": {"reason": "CrashLoopBackOff", "message": message}})
                if not await self._pause(backoff):
                    break
            self.last_state = self.state
            backoff = settings.backoff_initial if backoff == 0 else min(backoff * 2, settings.backoff_max)

    def _context(self, env: dict[str, str], volumes: list[tuple[str, str]] | None = None) -> images.ContainerContext:
        """`volumes`: (mountPath, folder) of the Secret and ConfigMap volumes the pod wrote out."""
        return images.ContainerContext(
            pod=self.pod.pod, container=self.spec, pod_ip=self.pod.ip, env=env,
            command=[images.expand(c, env) for c in self.spec.get("command") or []],
            args=[images.expand(a, env) for a in self.spec.get("args") or []],
            mounts=[*self._host_mounts(), *(volumes or [])],
        )

    def _binds(self) -> list[tuple[str, str, bool]]:
        """(host path, mount path, read only) of the container's hostPath volumes."""
        volumes = {v["name"]: v for v in self.pod.pod["spec"].get("volumes") or []}
        return [
            (volumes[m["name"]]["hostPath"]["path"], m["mountPath"], bool(m.get("readOnly")))
            for m in self.spec.get("volumeMounts") or []
            if "hostPath" in volumes.get(m["name"], {})
        ]

    def _host_mounts(self) -> list[tuple[str, str]]:
        """(mountPath, host path) of the container's hostPath volumes; other volume kinds are not run here."""
        volumes = {v["name"]: v for v in self.pod.pod["spec"].get("volumes") or []}
        mounts = []
        for mount in self.spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            if "hostPath" in volume:
                mounts.append((mount["mountPath"], volume["hostPath"]["path"]))
        return mounts

    async def _run_once(
        self,
        argv: list[str],
        env: dict[str, str],
        ctx: images.ContainerContext,
        binds: list[tuple[str, str, bool]] | None = None,
    ) -> int:
        """Start the process, probe it, and return its exit status (negative: signal).

        With `binds`, the process runs in a mount namespace of its own with the hostPath volumes
        bound at their mount paths (empty folders made for them on the host are removed after)."""
        made = _mount_points([path for _, path, _ in binds or []])
        try:
            return await self._run_process(argv, env, binds)
        finally:
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()

    async def _run_process(
        self, argv: list[str], env: dict[str, str], binds: list[tuple[str, str, bool]] | None
    ) -> int:
        logfile = self.pod.dir / f"{self.name}.log"
        if not self._stopping.is_set():
            # A stop() that raced with start-up keeps its kill request.
            self._kill.clear()
        with logfile.open("ab") as out:
            out.write(f"--- {now()} start: {argv}\n".encode())
            out.flush()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=str(self.pod.dir), stdin=asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    preexec_fn=container_preexec(self.pod.netns, binds),
                )
            except (OSError, subprocess.SubprocessError) as exc:
                self.ran = True
                self._set({"terminated": {"exitCode": 128, "reason": "StartError", "message": str(exc),
                                          "startedAt": now(), "finishedAt": now()}})
                return 128
        self.ran = True
        started_at = now()
        self.container_id = f"e2e://{self.proc.pid}"
        handler = Handler(self.pod.http, self.spec, self.pod.ip, env, str(self.pod.dir), self.pod.netns)
        no_startup = "startupProbe" not in self.spec
        self.started = no_startup
        self._set({"running": {"startedAt": started_at}},
                  ready=no_startup and "readinessProbe" not in self.spec and not self.init)
        self._probes = [asyncio.create_task(self._probe(handler))]
        post_start = (self.spec.get("lifecycle") or {}).get("postStart")
        if post_start and not await handler(post_start, self._grace()):
            log.info("%s/%s: postStart failed, killing", self.pod.name, self.name)
            self._kill.set()
        waiter = asyncio.create_task(self.proc.wait())
        killer = asyncio.create_task(self._kill.wait())
        await asyncio.wait({waiter, killer}, return_when=asyncio.FIRST_COMPLETED)
        killer.cancel()
        if not waiter.done():
            grace = self._stop_grace if self._stopping.is_set() else self._grace()
            await self._terminate(handler, grace)
        code = await waiter
        # Whatever the main process left behind in its group goes with it.
        kill_group(self.proc.pid, signal.SIGKILL)
        await self._cancel_probes()
        exit_code, reason = exit_reason(code)
        self.started = False
        self._set({"terminated": {"exitCode": exit_code, "reason": reason, "startedAt": started_at,
                                  "finishedAt": now(), "containerID": self.container_id}}, ready=False)
        return code

    async def _probe(self, handler: Handler) -> None:
        """Startup probe first; then readiness and liveness side by side."""
        startup = self.spec.get("startupProbe")
        if startup:
            if not await self._startup(startup, handler):
                log.info("%s/%s: startup probe failed, killing", self.pod.name, self.name)
                self._kill.set()
                return
            self.started = True
            self.pod.changed()
        if self.init:
            return
        tasks = []
        readiness = self.spec.get("readinessProbe")
        if readiness:
            tasks.append(probe_loop(readiness, handler, self._on_ready, initial=False))
        elif not self.ready:
            self._set(self.state, ready=True)
        liveness = self.spec.get("livenessProbe")
        if liveness:
            tasks.append(probe_loop(liveness, handler, self._on_live, initial=True))
        await asyncio.gather(*tasks)

    async def _startup(self, spec: dict[str, Any], handler: Handler) -> bool:
        await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
        failures = 0
        while True:
            if await handler(spec, float(spec.get("timeoutSeconds", 1))):
                return True
            failures += 1
            if failures >= int(spec.get("failureThreshold", 3)):
                return False
            await asyncio.sleep(float(spec.get("periodSeconds", 10)))

    async def _on_ready(self, ok: bool) -> None:
        log.info("%s/%s: readiness %s", self.pod.name, self.name, "passed" if ok else "failed")
        self._set(self.state, ready=ok)

    async def _on_live(self, ok: bool) -> None:
        if not ok and not self._stopping.is_set():
            log.info("%s/%s: liveness failed, killing", self.pod.name, self.name)
            self._kill.set()

    async def _cancel_probes(self) -> None:
        for task in self._probes:
            task.cancel()
        for task in self._probes:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._probes = []

    def _grace(self) -> float:
        return float(self.pod.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def _terminate(self, handler: Handler, grace: float) -> None:
        """preStop, then SIGTERM, then SIGKILL when the grace period is used up."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        deadline = time.monotonic() + grace
        pre_stop = (self.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop and grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handler(pre_stop, grace), grace)
        kill_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), max(deadline - time.monotonic(), 0.0))
        if proc.returncode is None:
            kill_group(proc.pid, signal.SIGKILL)

    def force_kill(self) -> None:
        self._stopping.set()
        self._kill.set()
        if self.proc is not None and self.proc.returncode is None:
            kill_group(self.proc.pid, signal.SIGKILL)

    async def stop(self, grace: float) -> None:
        """End the container for good (pod deleted or agent shutting down).

        Readiness probes keep running through the grace period, as the kubelet's
        do, so a terminating pod can still report itself serving.
        """
        self._stop_grace = grace
        self._stopping.set()
        self._kill.set()
        if self._active:
            await self._done.wait()
