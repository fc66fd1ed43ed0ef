"""Talking to member gateways over HTTP: the status probe and the one wake request.

Both go to the member's public listener with the member's bearer token (a file named by the
Cluster, read on every call so a rotated token applies at once; never logged). The probe is
`GET /wakegate/status`; a wake is `GET /model/<name>/v1/models`, which the member's own
extproc holds while the model starts (its cold path registers the demand that wakes it there)
and then hands to the engine, whose model list answers it: an activation that costs the
engine no generation.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import aiohttp

from wakegate.contract import MODEL_PATH_PREFIX, STATUS_PATH
from wakegate.control.federation.members import MAX_STATUS_BYTES, MemberReport, parse_status


class ProbeFailed(Exception):
    """A member gateway did not answer as one should; the message is one short line."""


def read_token(token_file: Path | None) -> str | None:
    """The member token in `token_file` (read on every call: a rotated one applies at once)."""
    if token_file is None:
        return None
    try:
        return token_file.read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        raise ProbeFailed(f"cannot read the member token file {token_file}: {exc.strerror}") from None


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


async def _get(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout: float, what: str
) -> tuple[int, bytes]:
    """One GET to a member gateway: its status and (at most MAX_STATUS_BYTES + 1 of) its body."""
    try:
        async with session.get(url, headers=_headers(token), timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            return answer.status, await answer.content.read(MAX_STATUS_BYTES + 1)
    except (aiohttp.ClientError, OSError) as exc:
        raise ProbeFailed(f"{what}: unreachable: {type(exc).__name__}") from None
    except TimeoutError:
        raise ProbeFailed(f"{what}: no answer in {timeout:g}s") from None


async def probe(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout: float
) -> tuple[MemberReport, float]:
    """The member's report and how long it took, seconds; ProbeFailed otherwise."""
    started = time.monotonic()
    status, body = await _get(session, url + STATUS_PATH, token, timeout, "probe")
    if status != 200:
        raise ProbeFailed(f"probe: status {status} from {STATUS_PATH}")
    try:
        report = parse_status(body)
    except ValueError as exc:
        raise ProbeFailed(f"probe: {exc}") from None
    return report, time.monotonic() - started


async def wake(session: aiohttp.ClientSession, url: str, token: str | None, model: str, timeout: float) -> None:
    """Ask one member to wake `model`; returns once the member's engine answered. ProbeFailed otherwise."""
    path = f"{MODEL_PATH_PREFIX}{quote(model, safe='')}/v1/models"
    status, _ = await _get(session, url + path, token, timeout, "wake")
    if status != 200:
        raise ProbeFailed(f"wake: answered {status}")
