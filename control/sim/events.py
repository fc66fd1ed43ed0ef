"""The sim's KV events: what its prefix cache stores and evicts, published over ZMQ like vLLM.

``wakegate sim --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'`` binds a
PUB socket at ``endpoint`` and, when given, a ROUTER at ``replay_endpoint``; the message shapes
are vLLM's (:mod:`wakegate.kvevents`). The cache's ``on_stored`` / ``on_removed`` hooks queue
events; everything queued during one turn of the event loop goes out as one batch (vLLM sends
one batch per engine step), numbered from 0. The last ``buffer_steps`` batches are kept for replay.

A sim-only convenience: an endpoint's port may be written ``+N``, meaning the sim's HTTP port
plus N, so one Model's arguments give every replica `wakegate up` starts on one host its own
ports (``tcp://*:+1``). An endpoint with a host other than ``*`` is connected to rather than bound,
as vLLM does.

Token ids in ``BlockStored`` are empty: the sim's tokens are words, not vocabulary ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque

import zmq
import zmq.asyncio

from wakegate.kvevents import END_SEQ, AllCleared, Event, KVEventsConfig, Removed, Stored, encode_batch, seq_bytes

log = logging.getLogger("wakegate.sim")

_RELATIVE = re.compile(r"^(tcp://[^/]+):\+(\d+)$")


def resolve_endpoint(endpoint: str, http_port: int) -> str:
    """``endpoint`` with a ``+N`` port made absolute (the HTTP port plus N)."""
    m = _RELATIVE.match(endpoint)
    if m is None:
        return endpoint
    return f"{m.group(1)}:{http_port + int(m.group(2))}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """One sim's PUB socket (and replay ROUTER), fed by its KV cache's hooks."""

    def __init__(self, cfg: KVEventsConfig, http_port: int) -> None:
        self.cfg = cfg
        self.endpoint = resolve_endpoint(cfg.endpoint, http_port)
        self.replay_endpoint = resolve_endpoint(cfg.replay_endpoint, http_port) if cfg.replay_endpoint else None
        self._topic = cfg.topic.encode()
        self._ctx = zmq.Context()  # the PUB socket is used synchronously: a send never blocks
        self._actx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._pending: list[Event] = []
        self._scheduled = False
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.batches = 0

    def start(self) -> None:
        """Bind (or connect) the sockets and serve replay requests."""
        if _binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint:
            self._replay = self._actx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        log.info(
            "sim kv events endpoint=%s replay=%s topic=%s", self.endpoint, self.replay_endpoint or "-", self.cfg.topic
        )

    def stored(self, hashes: list[bytes], parent: bytes | None) -> None:
        self._queue(Stored(tuple(hashes), parent))

    def removed(self, hashes: list[bytes]) -> None:
        self._queue(Removed(tuple(hashes)))

    def cleared(self) -> None:
        self._queue(AllCleared())

    def _queue(self, event: Event) -> None:
        self._pending.append(event)
        if len(self._pending) >= self.cfg.max_queue_size:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is queued as one batch."""
        self._scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = encode_batch(time.time(), events)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.batches += 1
        with contextlib.suppress(zmq.Again):  # a PUB socket drops at its high-water mark; so do we
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("sim kv events: malformed replay request frames=%d", len(frames))
                continue
            client, _empty, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((client, b"", seq_bytes(seq), payload))
            await sock.send_multipart((client, b"", END_SEQ, b""))

    async def close(self) -> None:
        self.flush()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
        self._actx.term()
