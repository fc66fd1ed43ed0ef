"""What every benchmark records next to its numbers: the machine's load and the code measured."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def loadavg() -> tuple[float, float, float]:
    return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]


def git_state() -> dict[str, str]:
    """Which code was measured: HEAD and a digest of uncommitted changes to the gateway's code."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, check=False)
        return done.stdout.decode(errors="replace").strip()

    diff = git("diff", "HEAD", "--", "control", "extproc", "envoy", "proto")
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "control", "extproc", "envoy")
    digest = hashlib.sha256((diff + untracked).encode()).hexdigest()[:12] if diff or untracked else "clean"
    return {"head": git("rev-parse", "--short", "HEAD"), "worktree_changes": digest}


def first_token_seconds(url: str, body: dict[str, object], timeout: float = 300) -> float:
    """Seconds from sending a streamed chat request to ``url`` until its first data chunk (NaN if none)."""
    import json
    import time
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - t0
    return first if first is not None else float("nan")


def system_chat(model: str, system: str, user: str, max_tokens: int) -> dict[str, object]:
    """A greedy, streamed chat request of one system prompt and one user turn."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
