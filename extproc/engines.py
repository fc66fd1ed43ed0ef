"""Engine load signals for scored picking: each endpoint's own metrics, read in the background.

For every endpoint of a model picked by scoring, :class:`EngineWatch` reads ``GET /metrics``
every ``interval`` seconds (all endpoints concurrently, each with a timeout) and stores what it
finds in the picker's engine book (:attr:`Picker.engines`): requests waiting and running, and
KV-cache usage, with this gateway's own in-flight count at the moment of the read (what the
engine holds beyond it is other gateways' traffic). vLLM's names (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, or the older
``vllm:gpu_cache_usage_perc``) and llama.cpp's
(``llamacpp:requests_deferred``, ``llamacpp:requests_processing``,
``llamacpp:kv_cache_usage_ratio``) are understood; samples of one name are summed over their
labels. vLLM's ``vllm:lora_requests_info`` gives the adapters it runs or queues and its
``max_lora``, for the adapter filters. An endpoint that does not answer, answers with an error,
or exposes none of these loses its entry, so scorers treat it as unknown rather than trusting an
old number. Reading happens off the request path: a pick only looks up the book.

Bounds: a response longer than :data:`MAX_BYTES` is dropped unread past that point; one read per
endpoint at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from wakegate import contract, promtext
from wakegate.extproc.scheduling import EngineState

log = logging.getLogger("wakegate.extproc.engines")

MAX_BYTES = 1 << 20

_WAITING = (contract.VLLM_WAITING, contract.LLAMACPP_WAITING)
_RUNNING = (contract.VLLM_RUNNING, contract.LLAMACPP_RUNNING)
_KV = (contract.VLLM_KV_USAGE, contract.VLLM_KV_USAGE_OLD, contract.LLAMACPP_KV_USAGE)
_NAMES = {**dict.fromkeys(_WAITING, "waiting"), **dict.fromkeys(_RUNNING, "running"), **dict.fromkeys(_KV, "kv")}
_READ = frozenset({*_NAMES, contract.VLLM_LORA_INFO})


def parse(text: str) -> EngineState | None:
    """The engine state in a Prometheus text exposition, or None when it names none of it."""
    found: dict[str, float] = {}
    lora_samples: list[promtext.Sample] = []
    for sample in promtext.samples(text, _READ):
        kind = _NAMES.get(sample.name)
        if kind is None:
            lora_samples.append(sample)
        elif kind == "kv":
            found.setdefault(kind, sample.value)  # the first name listed wins over its deprecated alias
        else:
            found[kind] = found.get(kind, 0.0) + sample.value
    lora = contract.current_lora_info(lora_samples)
    if not found and lora is None:
        return None
    state = EngineState(waiting=found.get("waiting"), running=found.get("running"), kv_usage=found.get("kv"))
    if lora is not None:
        state.adapters, state.max_adapters = lora
    return state


class EngineWatch:
    """Keeps ``book`` (endpoint -> :class:`EngineState`) filled for ``endpoints()``."""

    def __init__(
        self,
        endpoints: Callable[[], set[str]],
        book: dict[str, EngineState],
        inflight: Callable[[str], int] = lambda endpoint: 0,
        interval: float = 0.5,
        timeout: float = 1.0,
        on_round: Callable[[], None] = lambda: None,
    ) -> None:
        self.endpoints = endpoints
        #: Called after each round of readings (flow control dispatches what now fits).
        self.on_round = on_round
        self.book = book
        self.inflight = inflight
        self.interval = interval
        self.timeout = timeout
        self._failing: set[str] = set()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=True) as session:
            while True:
                wanted = self.endpoints()
                if wanted:
                    await asyncio.gather(*(self._read(session, ep) for ep in wanted))
                    self.on_round()
                await asyncio.sleep(self.interval)

    async def _read(self, session: aiohttp.ClientSession, endpoint: str) -> None:
        state = None
        own = self.inflight(endpoint)
        try:
            async with session.get(f"http://{endpoint}/metrics") as resp:
                if resp.status == 200:
                    body = bytearray()
                    async for chunk in resp.content.iter_chunked(65536):
                        body += chunk
                        if len(body) > MAX_BYTES:
                            raise ValueError("metrics page too large")
                    state = parse(body.decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if endpoint not in self._failing:
                log.info("engine metrics unavailable endpoint=%s error=%s", endpoint, type(exc).__name__)
            self._failing.add(endpoint)
        else:
            self._failing.discard(endpoint)
        if state is None or endpoint not in self.endpoints():
            self.book.pop(endpoint, None)
        else:
            # So the scorers and flow control can tell other gateways' requests from this one's: the
            # larger of the counts before and after the read, so that a request routed while the
            # engine answered is not taken for another gateway's.
            state.own = float(max(own, self.inflight(endpoint)))
            self.book[endpoint] = state
