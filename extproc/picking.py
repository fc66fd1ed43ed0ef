"""Endpoint picking: owns the routing strategies that choose a model's backend endpoint.

Endpoints are ``"ip:port"`` strings. Strategies (:meth:`Picker.pick`):

``round-robin``
    None: Envoy's own load balancer (round robin) chooses. Unknown strategy names and ``default``
    behave the same here, but the feeder sends a Model that names no routing with the default
    profile (``balanced``, ``control.schema.DEFAULT_PROFILE``), so it is scored.
``session-affinity``
    Consistent-hash ring lookup of :func:`session_key`; requests without one go least-loaded.
``prefix``
    Consistent-hash ring lookup of :func:`prefix_key` (so requests sharing a prompt prefix reuse
    one server's prefix cache); requests without one go least-loaded.
``least-loaded``
    The endpoint with the fewest requests, ties rotated: per endpoint this gateway's in-flight
    count (:class:`InFlight`) plus what the engine's own reading (``engine_loads``: running +
    waiting from its metrics, or a federation member's held + in-flight) counts beyond this
    gateway's requests of the last moments (other gateways', direct traffic).

A model whose route names a profile or weights is picked by scoring instead, whatever its
strategy: :mod:`wakegate.extproc.scheduling` filters the endpoints, weighs its scorers and picks,
reading in-flight counts from :attr:`Picker.inflight`, engine state from :attr:`Picker.engines`
prompt-prefix history from :attr:`Picker.index` (:mod:`wakegate.extproc.prefix`), which
every scored pick adds to, and the engines' own KV blocks from :attr:`Picker.kv`
(:mod:`wakegate.extproc.kvindex`, fed by :mod:`wakegate.extproc.kvsubscriber` for the endpoints
:meth:`Picker.kv_targets` names). :meth:`Picker.configure` takes the route table.

In-flight contract: :attr:`Picker.inflight` is shared. :meth:`Picker.pick` only reads it; when
``pick`` returns an endpoint, the caller calls ``picker.inflight.acquire(endpoint)`` once it routes
the request there, and exactly one ``release(endpoint)`` when that response ends, however it ends
(complete, error, client gone, stream cancelled). A long stream therefore counts as in flight for
its whole life, which is what ``least-loaded`` balances on.

Hashing uses BLAKE2b (8-byte digests) and SHA-256, never Python's ``hash()``, so every process
and restart maps a key to the same endpoint. Single-threaded asyncio use; no locks, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wakegate import contract
from wakegate.extproc.engineprompt import EnginePrompt, PromptError
from wakegate.extproc.kvindex import KVIndex, Target, target_for
from wakegate.extproc.prefix import PrefixIndex, chain, prompt_text
from wakegate.extproc.scheduling import Decision, EngineState, Request, Rotation, Signals, schedule, weights_for
from wakegate.extproc.scorers import SCORERS, Scorer
from wakegate.kvevents import MAX_BLOCKS, body_blocks, vllm_block_hashes
from wakegate.v1 import routing_pb2

__all__ = [
    "STRATEGIES",
    "HashRing",
    "InFlight",
    "Picker",
    "prefix_key",
    "session_key",
]

STRATEGIES = frozenset(contract.STRATEGIES)
"""The strategy names :meth:`Picker.pick` understands: every one routing.proto defines."""

SESSION_MESSAGES = 5
"""How many leading ``messages`` identify a session when no explicit id is given."""

_MAX_RINGS = 10_000
log = logging.getLogger("wakegate.extproc")

REPORT_LAG = 2.0
"""Seconds an engine's or member's reading of its in-flight count may take to reach the picker
(read, published, pushed); :class:`InFlight` discounts this gateway's requests of that long."""


def _hash64(text: str) -> int:
    """A stable 64-bit hash of ``text`` (same value in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class HashRing:
    """Consistent hashing with ``vnodes`` virtual nodes per endpoint.

    Each endpoint owns the points ``_hash64(f"{endpoint}#{i}")`` for ``i < vnodes``; a key goes to
    the owner of the first point at or after ``_hash64(key)``, wrapping around. The ring depends
    only on the *set* of endpoints (order and duplicates don't matter). Adding an endpoint to N
    moves about 1/(N+1) of the keys, all onto the new endpoint; removing one moves only its keys.
    Lookup is O(log(endpoints * vnodes)).
    """

    __slots__ = ("_owners", "_points", "endpoints")

    def __init__(self, endpoints: Sequence[str], vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes!r}")
        unique = sorted(set(endpoints))
        self.endpoints: tuple[str, ...] = tuple(unique)
        # Sorting (point, endpoint) settles the rare collision the same way whatever the order
        # endpoints were given in: the smaller endpoint name owns the point.
        ring = sorted((_hash64(f"{ep}#{i}"), ep) for ep in unique for i in range(vnodes))
        self._points: list[int] = [p for p, _ in ring]
        self._owners: list[str] = [ep for _, ep in ring]

    def __len__(self) -> int:
        return len(self.endpoints)

    def lookup(self, key: str) -> str | None:
        """The endpoint owning ``key``; None when the ring is empty."""
        points = self._points
        if not points:
            return None
        i = bisect_left(points, _hash64(key))
        return self._owners[i if i < len(points) else 0]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _body_str(body: Mapping[str, Any] | None, name: str) -> str | None:
    if body is None:
        return None
    value = body.get(name)
    if isinstance(value, str) and value:
        return value
    return None


def _explicit_key(
    headers: Mapping[str, str], header_names: tuple[str, ...], body: Mapping[str, Any] | None, body_field: str
) -> str | None:
    """A key the client named: the first non-empty of these headers, else a non-empty body string."""
    for name in header_names:
        key = _header(headers, name)
        if key is not None:
            return key
    return _body_str(body, body_field)


def session_key(headers: Mapping[str, str], body: Mapping[str, Any] | None) -> str | None:
    """The key that keeps a conversation on one endpoint, or None.

    First that applies: header ``x-session-id``, header ``x-conversation-id`` (header names are
    lower-case), body ``session_id`` (non-empty string), else the SHA-256 hex of the canonical
    JSON of the first :data:`SESSION_MESSAGES` entries of a non-empty body ``messages`` list.
    Empty or whitespace-only header values count as absent.
    """
    key = _explicit_key(headers, ("x-session-id", "x-conversation-id"), body, "session_id")
    if key is not None or body is None:
        return key
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    try:
        canonical = json.dumps(messages[:SESSION_MESSAGES], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON data (cannot happen for a parsed body)
        return None
    return _sha256_hex(canonical)


def _message_text(content: Any) -> str:
    """The text of a chat message's ``content``: a string, or the text parts of a part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
        return "".join(texts)
    return ""


def _chat_prefix(messages: list[Any], limit: int) -> str:
    """``role + "\\x1f" + text`` per message, joined by ``"\\x1e"``, cut to ``limit`` characters.

    Stops reading messages as soon as ``limit`` characters are collected, so a long conversation
    costs no more than a short one.
    """
    pieces: list[str] = []
    size = 0
    for message in messages:
        if size >= limit:
            break
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        piece = (role if isinstance(role, str) else "") + "\x1f" + _message_text(message.get("content"))
        if pieces:
            piece = "\x1e" + piece
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)[:limit]


def prefix_key(headers: Mapping[str, str], body: Mapping[str, Any] | None, prefix_chars: int = 1024) -> str | None:
    """The key that sends requests sharing a prompt prefix to one endpoint, or None.

    First that applies: header ``x-cache-key``, body ``cache_key`` (non-empty string), else the
    SHA-256 hex of the first ``prefix_chars`` characters of the prompt: for chat (a non-empty
    ``messages`` list) each message's ``role + "\\x1f" + text`` joined by ``"\\x1e"``, where text is
    a string ``content`` or the concatenated ``text`` of its ``{"type": "text"}`` parts (other
    parts are ignored); for completions ``prompt`` (a string, or the first element of a list of
    strings). An empty prefix gives None.
    """
    if prefix_chars < 1:
        raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars!r}")
    key = _explicit_key(headers, ("x-cache-key",), body, "cache_key")
    if key is not None or body is None:
        return key
    prefix = ""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        prefix = _chat_prefix(messages, prefix_chars)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if isinstance(prompt, str):
            prefix = prompt[:prefix_chars]
    if not prefix:
        return None
    return _sha256_hex(prefix)


class InFlight:
    """In-flight request counts per endpoint (only endpoints with a count > 0 are stored).

    An engine's own count (or a federation member's) arrives late: it was read a moment ago and
    includes this gateway's requests that were in flight then, some of which may have ended
    before the reading reached us. So a reading is taken as this gateway's requests plus others',
    and the others' part is the reading less the most of this gateway's requests that were in
    flight on the endpoint in the last :data:`REPORT_LAG` seconds or more (:meth:`recent_peak`).
    A finished request therefore never keeps its endpoint "busy" through a late reading, and a
    reading that stays the same for long (others' steady traffic) counts in full again.
    """

    __slots__ = ("_clock", "_counts", "_credit", "_peaks", "_turn")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._counts: dict[str, int] = {}
        # endpoint -> [epoch, peak in that epoch, peak in the epoch before]; epochs are
        # REPORT_LAG long, so the two peaks cover at least the last REPORT_LAG seconds
        self._peaks: dict[str, list[int]] = {}
        self._turn = 0
        # endpoint -> its credit in the smooth weighted rotation among tied endpoints (`weights`)
        self._credit: dict[str, int] = {}

    def acquire(self, endpoint: str) -> None:
        """A request was sent to ``endpoint``."""
        n = self._counts.get(endpoint, 0)
        self._counts[endpoint] = n + 1
        self._note(endpoint, n, n + 1)

    def release(self, endpoint: str) -> None:
        """A request to ``endpoint`` ended. Never goes below 0; zero entries are removed."""
        n = self._counts.get(endpoint, 0)
        if n > 1:
            self._counts[endpoint] = n - 1
        else:
            self._counts.pop(endpoint, None)
        self._note(endpoint, n, max(n - 1, 0))

    def _note(self, endpoint: str, before: int, after: int) -> None:
        """The count on ``endpoint`` went from ``before`` to ``after`` now: keep the epoch peaks."""
        epoch = self.epoch()
        peak = self._peaks.get(endpoint)
        if peak is None:
            if len(self._peaks) >= _MAX_RINGS:
                self._peaks.clear()  # endpoints that left: defensive bound
            self._peaks[endpoint] = [epoch, max(before, after), before]
        elif peak[0] == epoch:
            if after > peak[1]:
                peak[1] = after
        else:
            # The epoch before this one peaked at what was recorded if that was it, else the
            # count stood still at `before` all through it.
            peak[2] = peak[1] if peak[0] == epoch - 1 else before
            peak[0] = epoch
            peak[1] = max(before, after)

    def epoch(self) -> int:
        """The current :data:`REPORT_LAG`-long epoch (read once per pick by :meth:`least_loaded`)."""
        return int(self._clock() / REPORT_LAG)

    def recent_peak(self, endpoint: str, epoch: int | None = None) -> int:
        """The most of this gateway's requests in flight on ``endpoint`` at any time in the last
        :data:`REPORT_LAG` seconds (or a little longer): what a late reading may have counted."""
        own = self._counts.get(endpoint, 0)
        peak = self._peaks.get(endpoint)
        if peak is None:
            return own
        if epoch is None:
            epoch = self.epoch()
        if peak[0] == epoch:
            return max(peak[1], peak[2], own)
        if peak[0] == epoch - 1:
            return max(peak[1], own)
        return own  # unchanged for longer than REPORT_LAG

    def engine_count(self, endpoint: str, reported: int, epoch: int | None = None) -> int:
        """The requests on ``endpoint`` given its engine's reading: this gateway's in flight now
        plus the reading's part that cannot be this gateway's (0 for an empty reading)."""
        if reported <= 0:
            return 0
        own = self._counts.get(endpoint, 0)
        return own + max(0, reported - self.recent_peak(endpoint, epoch))

    def count(self, endpoint: str) -> int:
        """In-flight requests on ``endpoint``."""
        return self._counts.get(endpoint, 0)

    def total(self) -> int:
        """In-flight requests over all endpoints."""
        return sum(self._counts.values())

    def least_loaded(
        self,
        endpoints: Sequence[str],
        engine_loads: Mapping[str, int] | None = None,
        weights: Mapping[str, int] | None = None,
    ) -> str | None:
        """The endpoint with the fewest requests; None if ``endpoints`` is empty.

        An endpoint's count is its in-flight count plus the part of what its engine reports
        holding (``engine_loads``) that cannot be this gateway's (:meth:`engine_count`). Ties
        rotate round-robin among the tied endpoints (in the order given), so equally idle
        endpoints share the traffic instead of the first one taking it all; with ``weights``
        (endpoint -> share, missing: 1) the rotation is weighted, so tied endpoints take picks
        in proportion to their weights.
        """
        if not endpoints:
            return None
        counts = self._counts
        epoch = self.epoch() if engine_loads else 0
        best = -1
        tied: list[str] = []
        for ep in endpoints:
            n = counts.get(ep, 0)
            if engine_loads:
                n = max(n, self.engine_count(ep, engine_loads.get(ep, 0), epoch))
            if best < 0 or n < best:
                best = n
                tied = [ep]
            elif n == best:
                tied.append(ep)
        if len(tied) == 1:
            return tied[0]
        if weights:
            return self._weighted(tied, weights)
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _weighted(self, tied: Sequence[str], weights: Mapping[str, int]) -> str:
        """Smooth weighted round robin (as nginx's): every tied endpoint gains its weight in credit,
        the richest is picked and pays the sum. Over any run of picks among the same endpoints each
        has its share within one pick, and a heavy endpoint's picks are spread, not bunched."""
        credit = self._credit
        if len(credit) >= _MAX_RINGS:
            credit.clear()  # endpoints that left with credit: defensive bound
        total = 0
        best = tied[0]
        for ep in tied:
            share = max(weights.get(ep, 1), 1)
            total += share
            credit[ep] = credit.get(ep, 0) + share
            if credit[ep] > credit[best]:
                best = ep
        credit[best] -= total
        return best


@dataclass(frozen=True, slots=True)
class _RouteInfo:
    """What one route gives the picker."""

    endpoints: tuple[str, ...]
    weights: dict[str, float] | None
    adapters: frozenset[str]
    #: (endpoint, where its engine publishes KV events), for models weighing ``precise``
    targets: tuple[tuple[str, Target], ...]
    #: picked by scoring (its endpoints' engine state is worth reading)
    scored: bool
    #: the model's tokenizer folder: its engines' KV events hash token ids (`ModelRoute.tokenizer`)
    tokenizer: str = ""


def _route_info(route: routing_pb2.ModelRoute, scorers: Mapping[str, Scorer]) -> _RouteInfo:
    endpoints = tuple(f"{e.address}:{e.port}" for e in route.endpoints)
    chosen = weights_for(route.profile, route.weights, scorers)
    adapters: frozenset[str] = frozenset()
    targets: tuple[tuple[str, Target], ...] = ()
    if chosen:
        # On-demand adapters are placed by their holders (extproc/adapters.py), not by what the
        # engines report running.
        own = () if route.adapters_on_demand else route.adapters
        if route.lora_adapters or own:
            adapters = frozenset(route.lora_adapters) | {a.served_name for a in own}
        if chosen.get("precise") and route.kv_events_offset:
            targets = tuple(
                (
                    f"{e.address}:{e.port}",
                    target_for(e.address, e.port, route.kv_events_offset, route.kv_events_replay_offset),
                )
                for e in route.endpoints
            )
    tokenizer = route.tokenizer if targets else ""
    # Engines are read for scored picking and for flow control's saturation signals.
    return _RouteInfo(
        endpoints, chosen or None, adapters, targets, bool(chosen) or route.flow.enabled, tokenizer
    )


class Picker:
    """Chooses an endpoint per request; keeps one :class:`HashRing` per model."""

    __slots__ = (
        "_adapters",
        "_endpoint_routes",
        "_kv_targets",
        "_per_route",
        "_prompts",
        "_rings",
        "_rotation",
        "_scored_endpoints",
        "_signals",
        "_weights",
        "engines",
        "index",
        "inflight",
        "kv",
        "last",
        "prefix_chars",
        "scorers",
        "vnodes",
    )

    def __init__(self, scorers: Mapping[str, Scorer] = SCORERS) -> None:
        #: scorer name -> scorer: what a route's weights may name (default: the registry)
        self.scorers = scorers
        self.inflight = InFlight()
        self.vnodes = 160
        self.prefix_chars = 1024
        # model_key -> (sorted endpoint tuple, ring built from it)
        self._rings: dict[str, tuple[tuple[str, ...], HashRing]] = {}
        #: endpoint -> what its engine last reported (filled by whoever reads engine metrics)
        self.engines: dict[str, EngineState] = {}
        #: which endpoint recently got which prompt prefix (scored picks add to it)
        self.index = PrefixIndex()
        #: which KV blocks each engine says it holds (its KV events, for the precise scorer)
        self.kv = KVIndex()
        self._kv_targets: dict[str, Target] = {}  # endpoint -> where its engine publishes KV events
        #: the last scored decision (for debugging and tests)
        self.last: Decision | None = None
        self._weights: dict[str, dict[str, float]] = {}  # model_key -> scorer weights
        self._adapters: dict[str, frozenset[str]] = {}  # model_key -> its LoRA adapter names
        self._rotation = Rotation()
        self._scored_endpoints: set[str] = set()
        #: model_key -> what its route gives the picker; endpoint -> routes listing it
        self._per_route: dict[str, _RouteInfo] = {}
        self._endpoint_routes: dict[str, int] = {}
        self._signals = Signals(self.inflight.count, self.engines)
        #: tokenizer folder -> its prompt renderer (None: it could not be loaded; logged once)
        self._prompts: dict[str, EnginePrompt | None] = {}

    def configure(self, routes: Iterable[routing_pb2.ModelRoute]) -> None:
        """Take the whole route table: each model's profile or weights, its adapters, the live endpoints.

        Endpoints no route lists any more are forgotten by the prefix index and engine state.
        """
        routes = list(routes)
        keys = {route.key for route in routes}
        self.update(routes, [key for key in self._per_route if key not in keys])

    def update(self, changed: Iterable[routing_pb2.ModelRoute], removed: Iterable[str] = ()) -> None:
        """Take what changed in the route table: the routes new or changed, the keys of those gone.

        Work is proportional to the change: each route's share (weights, adapters, endpoints, KV
        targets) is kept apart and counted per endpoint, so an endpoint is forgotten (prefix
        index, engine state, KV subscription) exactly when the last route listing it drops it.
        """
        dropped: set[str] = set()
        targets_changed = scored_changed = False
        for key in removed:
            old = self._per_route.pop(key, None)
            if old is not None:
                dropped |= self._unlist(old)
                targets_changed |= bool(old.targets)
                scored_changed |= old.scored
                self._weights.pop(key, None)
                self._adapters.pop(key, None)
        for route in changed:
            info = _route_info(route, self.scorers)
            old = self._per_route.get(route.key)
            if old == info:
                continue
            if old is not None:
                dropped |= self._unlist(old)
                targets_changed |= bool(old.targets)
                scored_changed |= old.scored
            self._per_route[route.key] = info
            for ep in info.endpoints:
                self._endpoint_routes[ep] = self._endpoint_routes.get(ep, 0) + 1
            targets_changed |= bool(info.targets)
            scored_changed |= info.scored
            if info.weights:
                self._weights[route.key] = info.weights
            else:
                self._weights.pop(route.key, None)
            if info.adapters:
                self._adapters[route.key] = info.adapters
            else:
                self._adapters.pop(route.key, None)
        if scored_changed:
            self._scored_endpoints = {ep for info in self._per_route.values() if info.scored for ep in info.endpoints}
        if targets_changed:
            self._kv_targets = {ep: t for info in self._per_route.values() for ep, t in info.targets}
            self.kv.retain(self._kv_targets)
        if any(ep not in self._endpoint_routes for ep in dropped):
            self.index.retain(self._endpoint_routes)
        # Engine state only for routed endpoints (a reading may land after its endpoint left);
        # the book holds only the endpoints whose engines are read, so this walk stays small.
        for ep in [ep for ep in self.engines if ep not in self._endpoint_routes]:
            del self.engines[ep]

    def _unlist(self, info: _RouteInfo) -> set[str]:
        """Take a route's endpoints off the count; returns them (some may be listed elsewhere still)."""
        for ep in info.endpoints:
            left = self._endpoint_routes[ep] - 1
            if left:
                self._endpoint_routes[ep] = left
            else:
                del self._endpoint_routes[ep]
        return set(info.endpoints)

    def scored_endpoints(self) -> set[str]:
        """Endpoints of the models picked by scoring (whose engine state is worth reading)."""
        return self._scored_endpoints

    def kv_targets(self) -> dict[str, Target]:
        """Endpoint -> where its engine publishes KV events, for the models weighing ``precise``."""
        return self._kv_targets

    def weights(self, model_key: str) -> dict[str, float] | None:
        """The scorer weights a model is picked with, or None when its strategy decides."""
        return self._weights.get(model_key)

    def pick(
        self,
        model_key: str,
        strategy: str,
        endpoints: Sequence[str],
        headers: Mapping[str, str],
        body: Mapping[str, Any] | None,
        engine_loads: Mapping[str, int] | None = None,
        adapter: str | None = None,
        shares: Mapping[str, int] | None = None,
    ) -> str | None:
        """The endpoint for this request, or None to let Envoy's load balancer choose.

        Returns None for ``default``, unknown strategies and empty ``endpoints``. Reads but never
        changes :attr:`inflight` (see the module docstring for the acquire/release contract).
        ``engine_loads`` (endpoint -> requests its engine reports) weighs in on least-loaded picks;
        ``shares`` (endpoint -> weight) divide the picks among endpoints tied on load.
        A model configured for scored picking is scored whatever ``strategy`` says.
        """
        if not endpoints:
            return None
        weights = self._weights.get(model_key)
        if weights is not None:
            return self._scored(model_key, weights, endpoints, headers, body, adapter)
        if strategy not in STRATEGIES or strategy in ("default", "round-robin"):
            return None
        if strategy == "least-loaded":
            return self.inflight.least_loaded(endpoints, engine_loads, shares)
        if strategy == "session-affinity":
            key = session_key(headers, body)
        else:  # prefix
            key = prefix_key(headers, body, self.prefix_chars)
        if key is None:
            return self.inflight.least_loaded(endpoints, engine_loads, shares)
        return self._ring(model_key, endpoints).lookup(key)

    def _scored(
        self,
        model_key: str,
        weights: dict[str, float],
        endpoints: Sequence[str],
        headers: Mapping[str, str],
        body: Mapping[str, Any] | None,
        adapter: str | None = None,
    ) -> str | None:
        request = Request(adapter=adapter, headers=headers, body=body)
        if weights.get("prefix"):
            request.chain = chain(prompt_text(body))
            if request.chain:
                request.prefix_matches = self.index.matches(request.chain)
        if weights.get("session"):
            key = session_key(headers, body)
            if key is not None:
                request.session_owner = self._ring(model_key, endpoints).lookup(key)
        adapters = self._adapters.get(model_key)
        if request.adapter is None and adapters and body is not None:
            name = body.get("model")
            if isinstance(name, str) and name in adapters:
                request.adapter = name
        if weights.get("precise"):
            info = self._per_route.get(model_key)
            if info is not None and info.tokenizer:
                request.blocks = self._engine_blocks(info.tokenizer, endpoints, body, request.adapter)
            else:
                request.blocks = body_blocks(body)
            if request.blocks:
                request.block_matches = self.kv.matches(request.blocks)
        decision = schedule(endpoints, weights, request, self._signals, self._rotation, self.scorers)
        self.last = decision
        if decision.endpoint is not None and request.chain:
            self.index.record(decision.endpoint, request.chain)
        return decision.endpoint

    def _engine_blocks(
        self, folder: str, endpoints: Sequence[str], body: Mapping[str, Any] | None, adapter: str | None
    ) -> list[int]:
        """The prompt's blocks as a vLLM engine names them: its token ids (the model's chat
        template and tokenizer) hashed in blocks of the size its events report. [] where the
        gateway cannot know them exactly: no events yet, an adapter request (its blocks are keyed
        by the adapter's path on the engine's disk), a cache salt, a prompt the template refuses."""
        if adapter is not None or body is None or body.get("cache_salt") is not None:
            return []
        size = self.kv.block_size(endpoints)
        if size is None:
            return []
        prompt = self._prompt(folder)
        ids = prompt.token_ids(body) if prompt is not None else None
        if not ids or len(ids) < size:
            return []
        return vllm_block_hashes(ids[: size * MAX_BLOCKS], size)

    def _prompt(self, folder: str) -> EnginePrompt | None:
        if folder in self._prompts:
            return self._prompts[folder]
        prompt: EnginePrompt | None = None
        try:
            prompt = EnginePrompt(folder)
        except PromptError as exc:
            log.warning("precise scoring without a tokenizer folder=%s reason=%s", folder, exc)
        if len(self._prompts) >= _MAX_RINGS:
            del self._prompts[next(iter(self._prompts))]
        self._prompts[folder] = prompt
        return prompt

    def _ring(self, model_key: str, endpoints: Sequence[str]) -> HashRing:
        wanted = tuple(sorted(endpoints))
        cached = self._rings.get(model_key)
        if cached is not None and cached[0] == wanted:
            return cached[1]
        ring = HashRing(wanted, self.vnodes)
        if cached is None and len(self._rings) >= _MAX_RINGS:
            # Defensive bound; callers only pass known models. Drop the oldest-built ring.
            del self._rings[next(iter(self._rings))]
        self._rings[model_key] = (wanted, ring)
        return ring

    def forget(self, model_key: str) -> None:
        """Drop the cached ring of a model that no longer exists."""
        self._rings.pop(model_key, None)
