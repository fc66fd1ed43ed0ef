"""KV events in: one ZMQ subscription per endpoint whose engine publishes them.

:class:`KVSubscriber` keeps, for every endpoint :meth:`Picker.kv_targets` names (the endpoints of
models that weigh the ``precise`` scorer and declare ``routing.kvEvents``), a SUB socket connected
to the engine's publisher, and feeds each batch into the picker's :class:`~wakegate.extproc.kvindex.KVIndex`.
It reconciles every ``interval`` seconds: new endpoints are subscribed, vanished ones closed and
forgotten.

Sequence numbers (vLLM's, one per batch): on subscribing, the subscriber asks the endpoint's
replay socket (when it has one) for every batch it still buffers, so a gateway that starts late
learns what the engine cached before; a batch past a gap (or the first one, without replay)
makes it ask for the batches it missed; whatever still cannot be had resets the endpoint's
blocks. A malformed message is a gap too; a sequence number that goes back is a restarted
engine. All of this runs off the request path; a pick only reads the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from wakegate.extproc.kvindex import KVIndex, Target
from wakegate.kvevents import decode_batch, seq_of

log = logging.getLogger("wakegate.extproc.kvevents")


def _seq_or_none(frames: list[bytes]) -> int | None:
    try:
        return seq_of(frames[1]) if len(frames) == 3 else None
    except ValueError:
        return None


class KVSubscriber:
    """Keeps ``index`` fed from the publishers ``targets()`` names (endpoint -> :class:`Target`)."""

    def __init__(
        self,
        targets: Callable[[], dict[str, Target]],
        index: KVIndex,
        interval: float = 0.5,
        replay_timeout: float = 1.0,
    ) -> None:
        self.targets = targets
        self.index = index
        self.interval = interval
        self.replay_timeout = replay_timeout
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Target, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(self.interval)
        finally:
            for _target, task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*(t for _, t in self._tasks.values()), return_exceptions=True)
            self._tasks.clear()
            self._ctx.term()

    def reconcile(self) -> None:
        """Subscribe to new targets, drop vanished or changed ones."""
        wanted = self.targets()
        for endpoint, (target, task) in list(self._tasks.items()):
            if wanted.get(endpoint) != target or task.done():
                task.cancel()
                del self._tasks[endpoint]
                self.index.forget(endpoint)
        loop = asyncio.get_running_loop()
        for endpoint, target in wanted.items():
            if endpoint not in self._tasks:
                self._tasks[endpoint] = (target, loop.create_task(self._follow(endpoint, target)))
        self.index.retain(wanted)

    async def _follow(self, endpoint: str, target: Target) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.connect(target.events)
            log.info("kv events subscribed endpoint=%s events=%s", endpoint, target.events)
            # what the engine cached before this subscription: its replay buffer, from the start
            replayed = await self._catch_up(endpoint, target, 0, None) if target.replay else None
            while True:
                frames = await sub.recv_multipart()
                if replayed is not None:
                    # batches published during the replay arrive live as well: skip those taken
                    seq = _seq_or_none(frames)
                    if seq is not None and seq <= replayed:
                        continue
                    replayed = None
                await self._take(endpoint, target, frames)
        except zmq.ZMQError as exc:
            log.warning("kv events unavailable endpoint=%s error=%s", endpoint, exc)
        finally:
            sub.close(0)

    async def _take(self, endpoint: str, target: Target, frames: list[bytes]) -> None:
        index = self.index
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames")
            seq = seq_of(frames[1])
            _ts, events = decode_batch(frames[2])
        except ValueError as exc:
            log.warning("kv events malformed endpoint=%s error=%s", endpoint, str(exc)[:200])
            last = index.last(endpoint)
            index.reset(endpoint)
            if last is not None:
                index.apply(endpoint, last + 1, ())  # the bad batch counts, so the next one is not a gap
            return
        verdict = index.check(endpoint, seq)
        if verdict == "restart":
            log.info("kv events restarted endpoint=%s seq=%d", endpoint, seq)
            index.reset(endpoint, restart=True)
            if seq > 0:
                await self._catch_up(endpoint, target, 0, seq)
        elif verdict in ("first", "gap"):
            last = index.last(endpoint)
            await self._catch_up(endpoint, target, 0 if last is None else last + 1, seq)
        index.apply(endpoint, seq, events)

    async def _catch_up(self, endpoint: str, target: Target, start: int, upto: int | None) -> int | None:
        """Apply batches ``start`` .. ``upto - 1`` (None: all there are) from the replay socket.

        What cannot be had resets the endpoint's blocks. Returns the last batch applied, if any.
        """
        if upto is not None and start >= upto:
            return None
        batches = await self._replay(target, start) if target.replay else []
        expected = start
        applied = None
        lost = False
        for seq, payload in batches:
            if seq < expected:
                continue
            if upto is not None and seq >= upto:
                break
            try:
                _ts, events = decode_batch(payload)
            except ValueError:
                continue  # the hole this leaves is found below
            if seq > expected and (start > 0 or applied is not None):  # a hole: keep only what follows
                self.index.reset(endpoint)
                lost = True
            self.index.apply(endpoint, seq, events)
            applied = expected = seq + 1
        if upto is not None and expected != upto:
            if self.index.last(endpoint) is not None or start > 0:
                self.index.reset(endpoint)
            lost = True
        if lost and start > 0:
            log.info("kv events gap endpoint=%s missed=%d..%d", endpoint, start, (upto or expected) - 1)
        return None if applied is None else applied - 1

    async def _replay(self, target: Target, start: int) -> list[tuple[int, bytes]]:
        """The batches the replay socket still holds from ``start`` on ([] when it does not answer)."""
        assert target.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(target.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    break
                frames = await sock.recv_multipart()
                if len(frames) != 3 or not frames[2]:
                    break
                with contextlib.suppress(ValueError):
                    out.append((seq_of(frames[1]), frames[2]))
        except zmq.ZMQError:
            pass
        finally:
            sock.close(0)
        return out
