"""Child processes that cannot outlive the harness.

Every process gets its own session (so its whole group can be signalled
without touching ours) and, unless the caller wants it to survive us (pytest
--keep), PR_SET_PDEATHSIG so the kernel kills it if we die without cleaning up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that forked it exits."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


def kill_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # A recycled id now owned by someone else: not ours any more.
        return False
    return True


def group_alive(pgid: int) -> bool:
    return kill_group(pgid, 0)


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM a group we did not start (no Popen to reap), then SIGKILL after `grace`."""
    if not kill_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.05)
    kill_group(pgid, signal.SIGKILL)


def stop_all(procs: Sequence[Proc], grace: float) -> None:
    """SIGTERM every group at once, wait up to `grace`, then SIGKILL what is left."""
    live = [p for p in procs if p.popen is not None]
    for p in live:
        kill_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        live = [p for p in live if not p.gone()]
        time.sleep(0.05)
    for p in live:
        kill_group(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while live and time.monotonic() < deadline:
        live = [p for p in live if not p.gone()]
        time.sleep(0.05)


class Proc:
    """One long-running component, its output appended to `log`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        tie_to_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.env = dict(os.environ if env is None else env)
        self.tie_to_parent = tie_to_parent
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent() if self.tie_to_parent else None,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} not started"
        return self.popen.pid

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return None if self.popen is None else self.popen.poll()

    def detach(self) -> None:
        """Let the process outlive us (pytest --keep) without Popen warning that it still runs."""
        if self.popen is not None and self.popen.poll() is None:
            # Popen.__del__ warns about children never waited for; this one is
            # not ours to wait for any more. `down` finds it by its group id.
            self.popen.returncode = 0
        self.popen = None

    def gone(self) -> bool:
        """Leader reaped and no process left in its group."""
        if self.popen is None:
            return True
        # poll() reaps the leader: a zombie leader keeps the group "alive" for killpg.
        self.popen.poll()
        return self.popen.returncode is not None and not group_alive(self.popen.pid)

    def stop(self, grace: float = 5.0) -> None:
        # The group id is the pid (start_new_session); the group may outlive
        # the leader, so it is stopped even if the leader already exited.
        stop_all([self], grace)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
