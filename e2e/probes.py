"""Container probes and lifecycle hooks, run for real against the local process.

Semantics follow the kubelet: httpGet succeeds on 200-399, tcpSocket on a
completed connect, exec on exit status 0; each attempt is bounded by
timeoutSeconds. grpc probes are not supported and always fail, loudly.
httpGet/tcpSocket go from the agent (root namespace) to the pod IP through the
node's veth; exec commands run inside the node's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from e2e import net

log = logging.getLogger("e2e.nodeagent")


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


async def run_exec(
    command: list[str], env: dict[str, str], timeout: float, cwd: str, netns: str | None = None
) -> bool:
    """Run an exec probe/hook: in the pod's network namespace (`netns`), like the kubelet's exec."""
    proc = await asyncio.create_subprocess_exec(
        *command, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        preexec_fn=net.netns_preexec(netns) if netns else None,
    )
    try:
        return await asyncio.wait_for(proc.wait(), timeout) == 0
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return False


@dataclass
class Handler:
    """Runs one probe or hook handler (httpGet / tcpSocket / exec) for a container."""

    http: aiohttp.ClientSession
    container: dict[str, Any]
    pod_ip: str
    env: dict[str, str]
    cwd: str
    netns: str | None = None

    async def __call__(self, spec: dict[str, Any], timeout: float) -> bool:
        try:
            if "httpGet" in spec:
                return await self._http(spec["httpGet"], timeout)
            if "tcpSocket" in spec:
                return await self._tcp(spec["tcpSocket"], timeout)
            if "exec" in spec:
                return await run_exec(list(spec["exec"]["command"]), self.env, timeout, self.cwd, self.netns)
            if "sleep" in spec:
                await asyncio.sleep(float(spec["sleep"]["seconds"]))
                return True
        except (OSError, TimeoutError, aiohttp.ClientError, ValueError, subprocess.SubprocessError) as exc:
            log.debug("probe %s failed: %s", spec, exc)
            return False
        log.warning("unsupported probe/handler %s: treated as failing", sorted(spec))
        return False

    async def _http(self, get: dict[str, Any], timeout: float) -> bool:
        host = get.get("host") or self.pod_ip
        port = resolve_port(get["port"], self.container)
        scheme = str(get.get("scheme", "HTTP")).lower()
        path = get.get("path") or "/"
        headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
        headers.setdefault("User-Agent", "kube-probe/e2e")
        async with self.http.get(
            f"{scheme}://{host}:{port}{path}", headers=headers, ssl=False, allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return 200 <= resp.status < 400

    async def _tcp(self, sock: dict[str, Any], timeout: float) -> bool:
        host = sock.get("host") or self.pod_ip
        port = resolve_port(sock["port"], self.container)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True


async def probe_loop(
    spec: dict[str, Any],
    run: Handler,
    on_change: Callable[[bool], Awaitable[None]],
    initial: bool,
) -> None:
    """Probe forever, calling on_change when the result crosses a threshold.

    Starts from `initial` (readiness starts failed, liveness starts passing),
    as the kubelet's result cache does.
    """
    period = float(spec.get("periodSeconds", 10))
    timeout = float(spec.get("timeoutSeconds", 1))
    success_threshold = int(spec.get("successThreshold", 1))
    failure_threshold = int(spec.get("failureThreshold", 3))
    await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
    state = initial
    successes = failures = 0
    while True:
        ok = await run(spec, timeout)
        if ok:
            successes, failures = successes + 1, 0
            if not state and successes >= success_threshold:
                state = True
                await on_change(True)
        else:
            successes, failures = 0, failures + 1
            if state and failures >= failure_threshold:
                state = False
                await on_change(False)
        await asyncio.sleep(period)
