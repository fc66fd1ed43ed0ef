"""The simulator's HTTP request handling: an OpenAI-compatible server shaped like vLLM's.

How it counts and generates tokens is text.py's; its configuration is config.py's.

The request path avoids per-request work it does not need: routes are a dict
lookup, static bodies are pre-encoded, stream chunks are byte templates with
only the token spliced in, and metrics are plain integer updates.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge

from wakegate.control.sim.config import SimConfig
from wakegate.control.sim.errors import JSON_CT, BadRequest, Handler, error_response, refusals_answered
from wakegate.control.sim.kvcache import BLOCK_TOKENS, ROOT, Allocation, KVCache, block_hashes, blocks_for
from wakegate.control.sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from wakegate.control.sim.metrics import SimMetrics
from wakegate.control.sim.sleep import SleepMode
from wakegate.control.sim.text import (
    FIRST_JSON,
    NEXT_JSON,
    NW,
    count_words,
    dumps,
    embedding_vector,
    generated_text,
    generated_words,
)
from wakegate.kvevents import chat_tokens, completion_tokens

log = logging.getLogger("wakegate.sim")

_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(eq=False, slots=True)
class _Run:
    """One admitted generation: its blocks, its prefill wait, the tokens it produced so far."""

    alloc: Allocation
    prefill: float
    generated: int = 0


def _output_hashes(tokens: list[str], hashes: list[bytes], generated: int) -> list[bytes]:
    """Hashes of the full blocks that the prompt's tail and the first ``generated`` output tokens fill."""
    if generated <= 0:
        return []
    start = len(hashes) * BLOCK_TOKENS
    if len(tokens) - start + generated < BLOCK_TOKENS:
        return []
    tail = [*tokens[start:], *generated_words(generated)]
    return block_hashes(tail, hashes[-1] if hashes else ROOT)


class Sim:
    """State and handlers of one simulated vLLM server."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.kv = KVCache(max(1, cfg.kv_cache_tokens // BLOCK_TOKENS))
        self.metrics = SimMetrics(cfg.primary, self.kv)
        self.ready = False
        self.draining = False
        self.names = frozenset(cfg.served_names) | frozenset(cfg.lora_modules)
        #: adapters loaded at run time: name -> path, in load order
        self.loras: dict[str, str] = {}
        self.lora_loads = 0
        if cfg.enable_lora:
            self.metrics.max_lora = cfg.max_loras
        self._limit = cfg.max_concurrency if cfg.max_concurrency > 0 else 1 << 60
        # requests waiting to run, first come first served: (future, prompt block hashes or None
        # for no KV blocks, prompt tokens, blocks needed)
        self._waiters: deque[tuple[asyncio.Future[Allocation | None], list[bytes] | None, int, int]] = deque()
        self._prefill_tps = cfg.prefill_tokens_per_second
        self._prefill_free_at = 0.0  # loop time the one prefill lane is next free
        self._ttft = max(0.0, cfg.ttft_ms) / 1000.0
        self._tpot = 1.0 / cfg.tokens_per_second if cfg.tokens_per_second > 0 else 0.0
        self._id_prefix = os.urandom(6).hex()
        self._seq = 0
        self._api_key = cfg.api_key.encode() if cfg.api_key else None
        self._tasks: set[asyncio.Task[Any]] = set()  # handlers of /v1 requests in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._models_body = self._build_models_body()
        # path -> (allowed method, handler, is an OpenAI API route)
        self._routes: dict[str, tuple[frozenset[str], Handler, bool]] = {
            "/health": (frozenset({"GET"}), self._health, False),
            "/ping": (frozenset({"GET", "POST"}), self._health, False),
            "/metrics": (frozenset({"GET"}), self._metrics, False),
            "/version": (frozenset({"GET"}), self._version, False),
            "/v1/models": (frozenset({"GET"}), self._models, True),
            "/v1/chat/completions": (frozenset({"POST"}), self._chat, True),
            "/v1/completions": (frozenset({"POST"}), self._completions, True),
            "/v1/embeddings": (frozenset({"POST"}), self._embeddings, True),
        }
        #: vLLM's sleep mode (`--enable-sleep-mode` with VLLM_SERVER_DEV_MODE=1), control/sim/sleep.py
        self.sleep: SleepMode | None = None
        if cfg.sleep.enabled and cfg.sleep.dev_mode:  # vLLM serves the API only in dev mode
            self.sleep = SleepMode(cfg.sleep, self._forget_cache)
            self.metrics.registry.register(self.sleep)
            for path, (methods, handler) in self.sleep.routes().items():
                self._routes[path] = (methods, refusals_answered(handler), False)
        if cfg.enable_lora:
            self._routes["/v1/load_lora_adapter"] = (frozenset({"POST"}), self._load_lora, True)
            self._routes["/v1/unload_lora_adapter"] = (frozenset({"POST"}), self._unload_lora, True)

    # ---- plumbing -------------------------------------------------------------------

    def _forget_cache(self) -> None:
        """Sleep discards the KV cache: the prefix cache starts empty after a wake."""
        self.kv.forget()

    def _build_models_body(self) -> bytes:
        created = int(time.time())
        data: list[dict[str, Any]] = []
        for name in self.cfg.served_names:
            data.append(
                {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                 "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.max_model_len}
            )  # fmt: skip
        for name, root in {**self.cfg.lora_modules, **self.loras}.items():
            data.append(
                {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                 "root": root, "parent": self.cfg.primary, "max_model_len": None}
            )  # fmt: skip
        return dumps({"object": "list", "data": data}).encode()

    def _next_id(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{self._id_prefix}{self._seq:08x}"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        route = self._routes.get(request.path)
        if route is None:
            return error_response(404, f"Route {request.path} not found", "NotFoundError")
        methods, handler, api = route
        if request.method not in methods:
            return error_response(
                405, "Method Not Allowed", "MethodNotAllowed", headers={"Allow": ", ".join(sorted(methods))}
            )
        if api:
            if self.cfg.log_requests:
                log.info("sim timing request t=%.6f method=%s path=%s", time.time(), request.method, request.path)
            if self._api_key is not None and not self._authorized(request):
                return error_response(401, "Unauthorized", "AuthenticationError")
            if not self.ready:
                return error_response(503, "The model is still loading", "ServiceUnavailableError")
            if self.sleep is not None and (refused := self.sleep.refusal()) is not None:
                return error_response(refused[0], refused[1], "ServiceUnavailableError")
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            self._idle.clear()
            try:
                return await handler(request)
            except BadRequest as exc:
                return error_response(exc.status, str(exc), exc.kind, param=exc.param)
            finally:
                self._tasks.discard(task)
                if not self._tasks:
                    self._idle.set()
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), exc.kind, param=exc.param)

    async def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for in-flight /v1 requests; cancel the rest. Returns how many were."""
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return 0
        except TimeoutError:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            return len(tasks)

    def _authorized(self, request: web.BaseRequest) -> bool:
        assert self._api_key is not None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key)

    async def _json_body(self, request: web.BaseRequest) -> dict[str, Any]:
        try:
            raw = await request.read()
        except HTTPRequestEntityTooLarge as exc:
            raise BadRequest("Request body too large", 413) from exc
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"Malformed JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None or model == "":
            return self.cfg.primary
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string")
        if model not in self.names and model not in self.loras:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return model

    def _max_tokens(self, body: dict[str, Any], prompt_tokens: int, chat: bool) -> int:
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        if value is None:
            return max(1, min(self.cfg.max_tokens_default, self.cfg.max_model_len - prompt_tokens))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"max_tokens must be an integer of at least 1, got {value!r}", param="max_tokens")
        if prompt_tokens + value > self.cfg.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + value} tokens ({prompt_tokens} in the messages, {value} in "
                "the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return value

    def _plan(self, max_tokens: int) -> tuple[int, str]:
        eos = self.cfg.eos_after_tokens
        if 0 < eos < max_tokens:
            return eos, "stop"
        return max_tokens, "length"

    def _try_run(self, hashes: list[bytes] | None, prompt_tokens: int, total: int) -> Allocation | bool | None:
        """Start a request now if a slot and its blocks are free: its allocation (None: no blocks), or False."""
        if self.metrics.running >= self._limit:
            return False
        alloc = None
        if hashes is not None:
            alloc = self.kv.allocate(hashes, prompt_tokens, total)
            if alloc is None:
                return False
        self.metrics.running += 1
        return alloc

    async def _admit(self, hashes: list[bytes] | None, prompt_tokens: int, total: int) -> Allocation | None:
        """Wait for a running slot (``--max-concurrency``) and the request's KV blocks, in arrival order."""
        if not self._waiters:
            got = self._try_run(hashes, prompt_tokens, total)
            if got is not False:
                return got  # type: ignore[return-value]
        fut: asyncio.Future[Allocation | None] = asyncio.get_running_loop().create_future()
        entry = (fut, hashes, prompt_tokens, total)
        self._waiters.append(entry)
        self.metrics.waiting = len(self._waiters)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted, then cancelled before it resumed
                self._finish(fut.result())
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self.metrics.waiting = len(self._waiters)
                self._wake()
            raise

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            fut, hashes, prompt_tokens, total = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            got = self._try_run(hashes, prompt_tokens, total)
            if got is False:
                break  # the head waits; nobody overtakes it (vLLM's FCFS)
            waiters.popleft()
            fut.set_result(got)  # type: ignore[arg-type]
        self.metrics.waiting = len(waiters)

    def _finish(self, alloc: Allocation | None, output_hashes: list[bytes] | None = None) -> None:
        """A running request ended: free its slot, cache its blocks, start who waits."""
        if alloc is not None:
            self.kv.release(alloc, output_hashes or ())
        self.metrics.running -= 1
        self._wake()

    def _prefill_delay(self, uncached: int) -> float:
        """Seconds until a prefill of ``uncached`` tokens queued now is done (one prefill at a time)."""
        if self._prefill_tps <= 0 or uncached <= 0:
            return 0.0
        now = asyncio.get_running_loop().time()
        done = max(now, self._prefill_free_at) + uncached / self._prefill_tps
        self._prefill_free_at = done
        return done - now

    def _tpot_now(self) -> float:
        """Seconds per output token at the current batch size."""
        return self._tpot * (1.0 + self.cfg.batch_slowdown * max(0, self.metrics.running - 1))

    # ---- small endpoints ----------------------------------------------------------

    async def _health(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.ready and not self.draining:
            return web.Response(status=200)
        return web.Response(status=503)

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return resp

    async def _version(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=b'{"version":"0.0.0+wakegate.sim"}', content_type=JSON_CT)

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=self._models_body, content_type=JSON_CT)

    # ---- LoRA adapters at run time (vLLM: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING) ----

    async def _lora_name(self, request: web.BaseRequest) -> tuple[str, dict[str, Any]]:
        body = await self._json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest("'lora_name' must be a non-empty string")
        return name, body

    async def _load_lora(self, request: web.BaseRequest) -> web.StreamResponse:
        name, body = await self._lora_name(request)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("'lora_path' must be a non-empty string")
        if name in self.loras or name in self.names:
            raise BadRequest(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                kind="InvalidUserInput",
            )
        if len(self.loras) >= self.cfg.max_loras:
            raise BadRequest(f"Cannot load lora adapter '{name}': {len(self.loras)} of --max-loras "
                             f"{self.cfg.max_loras} are loaded; unload one first.")
        if self.cfg.lora_load_ms > 0:
            await asyncio.sleep(self.cfg.lora_load_ms / 1000.0)
        self.loras[name] = path
        self.lora_loads += 1
        self._models_body = self._build_models_body()
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.BaseRequest) -> web.StreamResponse:
        name, _ = await self._lora_name(request)
        if self.loras.pop(name, None) is None:
            raise BadRequest(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        self._models_body = self._build_models_body()
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- generation ----------------------------------------------------------------

    async def _chat(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        model = self._model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if not all(isinstance(msg, dict) for msg in messages):
            raise BadRequest("each message must be an object")
        tokens = chat_tokens(messages)
        return await self._generate(request, body, model, tokens, chat=True)

    async def _completions(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        model = self._model(body)
        tokens = completion_tokens(body.get("prompt"))
        if tokens is None:
            raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of those")
        return await self._generate(request, body, model, tokens, chat=False)

    async def _generate(
        self, request: web.BaseRequest, body: dict[str, Any], model: str, tokens: list[str], chat: bool
    ) -> web.StreamResponse:
        prompt_tokens = len(tokens)
        max_tokens = self._max_tokens(body, prompt_tokens, chat)
        n_tokens, finish = self._plan(max_tokens)
        total = blocks_for(prompt_tokens + n_tokens)
        if not self.kv.fits(total):
            raise BadRequest(
                f"The request needs {total} KV-cache blocks of {BLOCK_TOKENS} tokens; the server has "
                f"{self.kv.capacity} (--kv-cache-tokens)."
            )
        hashes = block_hashes(tokens)
        stream = body.get("stream") is True
        include_usage = False
        if stream:
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        loop = asyncio.get_running_loop()
        start = loop.time()
        m = self.metrics
        lora = model if model in self.loras or model in self.cfg.lora_modules else None
        if lora is not None:
            m.lora_waiting[lora] = m.lora_waiting.get(lora, 0) + 1
        try:
            alloc = await self._admit(hashes, prompt_tokens, total)
        except asyncio.CancelledError:
            m.success["abort"] += 1
            raise
        finally:
            if lora is not None:
                m.lora_left(m.lora_waiting, lora)
        assert alloc is not None
        if lora is not None:
            m.lora_running[lora] = m.lora_running.get(lora, 0) + 1
        delay = self._ttft + self._prefill_delay(prompt_tokens - alloc.hit_tokens)
        run = _Run(alloc, delay)
        try:
            if stream:
                return await self._stream(
                    request, model, prompt_tokens, n_tokens, finish, chat, include_usage, start, run
                )
            return await self._complete(model, prompt_tokens, n_tokens, finish, chat, start, run)
        finally:
            if lora is not None:
                m.lora_left(m.lora_running, lora)
            self._finish(alloc, _output_hashes(tokens, hashes, run.generated))

    async def _complete(
        self, model: str, prompt_tokens: int, n: int, finish: str, chat: bool, start: float, run: _Run
    ) -> web.StreamResponse:
        m = self.metrics
        loop = asyncio.get_running_loop()
        try:
            if run.prefill:
                await asyncio.sleep(run.prefill)
            m.prompt_tokens += prompt_tokens
            m.ttft.observe(loop.time() - start)
            if self._tpot and n > 1:
                await asyncio.sleep(self._tpot_now() * (n - 1))
        except asyncio.CancelledError:
            m.success["abort"] += 1
            raise
        run.generated = n
        m.generation_tokens += n
        text = generated_text(n)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
        created = int(time.time())
        out: dict[str, Any]
        if chat:
            out = {
                "id": self._next_id("chatcmpl"), "object": "chat.completion", "created": created,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": None, "finish_reason": finish, "stop_reason": None,
                }],
                "usage": usage, "prompt_logprobs": None,
            }  # fmt: skip
        else:
            out = {
                "id": self._next_id("cmpl"), "object": "text_completion", "created": created,
                "model": model,
                "choices": [{
                    "index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                    "stop_reason": None, "prompt_logprobs": None,
                }],
                "usage": usage,
            }  # fmt: skip
        m.success[finish] += 1
        m.e2e.observe(loop.time() - start)
        return web.Response(body=dumps(out).encode(), content_type=JSON_CT)

    async def _stream(
        self,
        request: web.BaseRequest,
        model: str,
        prompt_tokens: int,
        n: int,
        finish: str,
        chat: bool,
        include_usage: bool,
        start: float,
        run: _Run,
    ) -> web.StreamResponse:
        m = self.metrics
        loop = asyncio.get_running_loop()
        created = int(time.time())
        rid = self._next_id("chatcmpl" if chat else "cmpl")
        obj = "chat.completion.chunk" if chat else "text_completion"
        common = (
            f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},'
            f'"model":{json.dumps(model)},"choices":'
        ).encode()
        if chat:
            head = common + b'[{"index":0,"delta":{"content":'
            tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            last_tail = f'}},"logprobs":null,"finish_reason":"{finish}","stop_reason":null}}]}}\n\n'.encode()
            first = common + b'[{"index":0,"delta":{"role":"assistant","content":""},' \
                b'"logprobs":null,"finish_reason":null}]}\n\n'  # fmt: skip
        else:
            head = common + b'[{"index":0,"text":'
            tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            last_tail = f',"logprobs":null,"finish_reason":"{finish}","stop_reason":null}}]}}\n\n'.encode()
            first = b""

        resp = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            await resp.prepare(request)
            if run.prefill:
                await asyncio.sleep(run.prefill)
            m.prompt_tokens += prompt_tokens
            tpot = self._tpot
            due = loop.time()
            for i in range(n):
                piece = NEXT_JSON[i % NW] if i else FIRST_JSON[0]
                chunk = head + piece + (last_tail if i == n - 1 else tail)
                if i == 0:
                    chunk = first + chunk
                elif tpot:
                    due += self._tpot_now()
                    delay = due - loop.time()
                    await asyncio.sleep(delay if delay > 0 else 0)
                else:
                    await asyncio.sleep(0)  # let other requests (and cancellation) in
                await resp.write(chunk)
                run.generated += 1
                m.generation_tokens += 1
                if i == 0:
                    m.ttft.observe(loop.time() - start)
            if include_usage:
                usage = dumps(
                    {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + n,
                        "completion_tokens": n,
                    }
                ).encode()
                await resp.write(common + b'[],"usage":' + usage + b"}\n\n")
            await resp.write(_DONE)
            await resp.write_eof()
        except asyncio.CancelledError:
            m.success["abort"] += 1
            raise
        except ConnectionResetError:  # the client went away: stop generating, free the slot
            m.success["abort"] += 1
            return resp
        m.success[finish] += 1
        m.e2e.observe(loop.time() - start)
        return resp

    # ---- embeddings ----------------------------------------------------------------

    async def _embeddings(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        model = self._model(body)
        raw = body.get("input")
        items: list[str | list[int]]
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
            items = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, str | list) for x in raw):
            items = raw
        else:
            raise BadRequest("'input' must be a string, a list of strings, or token ids")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise BadRequest("'encoding_format' must be 'float' or 'base64'")
        loop = asyncio.get_running_loop()
        start = loop.time()
        m = self.metrics
        data: list[dict[str, Any]] = []
        tokens = 0
        for idx, item in enumerate(items):
            if isinstance(item, str):
                tokens += count_words(item)
                vec = embedding_vector(item.encode(), self.cfg.embedding_dim)
            else:
                tokens += len(item)
                vec = embedding_vector(dumps(item).encode(), self.cfg.embedding_dim)
            emb: list[float] | str = vec
            if fmt == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"index": idx, "object": "embedding", "embedding": emb})
        await self._admit(None, tokens, 0)
        try:
            if self._ttft:
                await asyncio.sleep(self._ttft)
        finally:
            self._finish(None)
        m.prompt_tokens += tokens
        m.success["stop"] += 1
        m.e2e.observe(loop.time() - start)
        out = {
            "id": self._next_id("embd"), "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }  # fmt: skip
        return web.Response(body=dumps(out).encode(), content_type=JSON_CT)
