"""Child processes of `wakegate up`: started so they cannot outlive us, logged to files, stopped gracefully.

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
from collections.abc import Mapping, Sequence
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
        # Anything the child left in its group goes too.
        self._signal_group(signal.SIGKILL)
        log.info("process stopped name=%s pid=%s code=%s", self.name, proc.pid, code)
        return code

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
