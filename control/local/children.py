"""Child processes of a control process: started so they cannot outlive us, logged to files, stopped gracefully.

Every child gets PR_SET_PDEATHSIG=SIGKILL (Linux), so even a SIGKILLed `up`
leaves no orphan, and its own process group, so a stop reaches its children too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("wakegate.up")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """One supervised process."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        #: Descriptors the process inherits (a cache lease), besides stdin/stdout/stderr.
        self.pass_fds: tuple[int, ...] = ()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                pass_fds=self.pass_fds,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("process started name=%s pid=%s log=%s", self.name, self.proc.pid, self.log_path)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return proc.returncode if proc else None
        self._signal_group(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("process did not stop in %.0fs, killing name=%s pid=%s", grace, self.name, proc.pid)
            self._signal_group(signal.SIGKILL)
            code = await proc.wait()
        except asyncio.CancelledError:
            self._signal_group(signal.SIGKILL)  # a stop cut short still stops the group
            raise
        # Anything the child left in its group goes too.
        self._signal_group(signal.SIGKILL)
        log.info("process stopped name=%s pid=%s code=%s", self.name, proc.pid, code)
        return code

    def kill(self) -> None:
        """SIGKILL the process group at once (no grace): for a stop that cannot wait."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def tail(self, lines: int = 20) -> str:
        try:
            data = self.log_path.read_bytes()[-8192:]
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class CrashLoop(Exception):
    """A supervised process kept crashing past its restart budget."""


class Supervised:
    """A child that is restarted whenever it exits on its own, with backoff.

    The first restart is immediate (a gateway component that died is needed back now); each
    further exit within `window` seconds doubles the pause, up to `backoff_max`. More than
    `budget` exits within `window` is a crash loop: `run()` raises CrashLoop with the child's
    last log lines, and only that stops `wakegate up`.
    """

    def __init__(
        self,
        child: Child,
        *,
        before_start: Callable[[], Awaitable[None]] | None = None,
        budget: int = 5,
        window: float = 60.0,
        backoff_max: float = 5.0,
    ) -> None:
        self.child = child
        self.before_start = before_start
        self.budget = budget
        self.window = window
        self.backoff_max = backoff_max
        self.restarts = 0
        self.stopping = False
        self._exits: list[float] = []
        self.started = asyncio.Event()

    async def start(self) -> None:
        if self.before_start is not None:
            await self.before_start()
        await self.child.start()
        self.started.set()

    async def run(self) -> None:
        """Watch the child (started with `start()`) and restart it until `stop()`."""
        loop = asyncio.get_running_loop()
        while True:
            code = await self.child.wait()
            if self.stopping:
                return
            now = loop.time()
            self._exits = [t for t in self._exits if now - t < self.window] + [now]
            if len(self._exits) > self.budget:
                raise CrashLoop(
                    f"{self.child.name} exited {len(self._exits)} times within {self.window:.0f}s "
                    f"(last code {code}); giving up. Last log lines of {self.child.log_path}:\n{self.child.tail()}"
                )
            pause = 0.0 if len(self._exits) == 1 else min(0.1 * 2 ** (len(self._exits) - 2), self.backoff_max)
            log.warning(
                "process exited name=%s pid=%s code=%s; restarting in %.2fs (%d/%d within %.0fs)",
                self.child.name,
                self.child.pid,
                code,
                pause,
                len(self._exits),
                self.budget,
                self.window,
            )
            self.started.clear()
            await asyncio.sleep(pause)
            if self.stopping:
                return
            await self.start()
            self.restarts += 1

    async def stop(self, grace: float) -> int | None:
        self.stopping = True
        return await self.child.stop(grace)
