"""`wakegate sim`: an OpenAI-compatible backend simulator that behaves like vLLM.

It serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/models``, ``/health``, ``/ping``, ``/version`` and ``/metrics`` (vLLM's
metric names), simulating model load time, time to first token, decode speed,
a concurrency limit with a waiting queue, crashes and a never-ready backend.
See :mod:`wakegate.control.sim.app` for how tokens are counted and text is generated.

Lifecycle, one log line each on stderr: ``sim listening`` → (``sim loading``) →
``sim ready model=NAME url=http://H:P`` → on SIGTERM/SIGINT ``sim draining`` →
``sim stopped`` (exit 0). In-flight requests get up to ``--drain-seconds`` to
finish; a second signal exits at once with status 130. ``--fail-after-seconds``
ends the process abruptly with ``--exit-code`` (``os._exit``, no draining).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from wakegate.control.sim.app import Sim
from wakegate.control.sim.config import SimConfig
from wakegate.control.sim.events import Publisher
from wakegate.control.sim.sleep import SleepConfig
from wakegate.kvevents import KVEventsConfig, parse_config
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, settings_from, start

log = logging.getLogger("wakegate.sim")

#: request bodies up to this size are accepted (long-context benchmarks send big prompts)
CLIENT_MAX_SIZE = 64 * 1024 * 1024


def _names(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or []:
        for name in value.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    a("--model", default="wakegate/sim", help="the simulated model path, shown as `root` in /v1/models")
    a(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="name(s) the model answers to; repeatable or comma-separated; the first is the primary "
        "name used in metric labels (default: --model)",
    )
    a(
        "--lora-modules",
        action="append",
        metavar="NAME[=PATH]",
        help="LoRA adapters served as extra names (parent: the primary name); repeatable or comma-separated",
    )
    a("--enable-lora", action="store_true", help="vLLM's --enable-lora: /v1/load_lora_adapter and "
      "/v1/unload_lora_adapter load adapters at run time, and vllm:lora_requests_info reports them")
    a("--max-loras", type=int, default=1, help="adapters held at once (vLLM's --max-loras; default 1)")
    a("--lora-load-ms", type=float, default=0.0, help="milliseconds one adapter load takes (default 0)")
    a("--startup-seconds", type=float, default=0.0, help="simulated load time: /health is 503 until done")
    a("--ttft-ms", type=float, default=0.0, help="time to first token in milliseconds (default 0)")
    a("--tokens-per-second", type=float, default=0.0, help="per-request decode rate; 0 = as fast as possible")
    a("--max-concurrency", type=int, default=0, help="requests running at once; more wait (0 = unlimited)")
    a(
        "--prefill-tokens-per-second",
        type=float,
        default=0.0,
        help="prompt tokens not found in the prefix cache are prefilled at this rate, one prompt at a time, "
        "before the first token (added to --ttft-ms); 0 = prefill is free",
    )
    a(
        "--batch-slowdown",
        type=float,
        default=0.0,
        help="each running request beyond the first slows every decode step by this fraction (0.05: a batch "
        "of 11 decodes at half speed); 0 = decode speed ignores the batch",
    )
    a("--max-tokens-default", type=int, default=16, help="tokens generated when max_tokens is absent")
    a("--max-model-len", type=int, default=8192, help="context length: prompt + max_tokens above it is a 400")
    a(
        "--kv-cache-tokens",
        type=int,
        default=32768,
        help="simulated KV-cache capacity in tokens, kept as blocks of 16 with prefix reuse and LRU eviction",
    )
    a(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="vLLM's KV events: publish blocks stored and removed over ZMQ, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; a port written +N is the HTTP port plus N',
    )
    # vLLM's flags that change how the real engine computes, not what it answers: taken, so that
    # one Model's args serve the sim and vLLM alike, and ignored.
    a("--dtype", default="auto", help="vLLM's weight and activation type; ignored (the sim holds no weights)")
    a("--enforce-eager", action="store_true", help="vLLM: no torch.compile or graphs; ignored")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
      help="vLLM's prefix caching; ignored (the sim's prefix cache is always on)")
    a("--enable-sleep-mode", action="store_true",
      help="vLLM's sleep mode: with VLLM_SERVER_DEV_MODE=1 in the environment, POST /sleep?level=1|2, "
      "POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping and POST /collective_rpc (reload_weights)")
    a("--sleep-seconds", type=float, default=0.05, help="how long POST /sleep takes (default 0.05)")
    a("--wake-seconds", type=float, default=0.2,
      help="how long waking the weights from host memory (level 1) takes (default 0.2)")
    a("--reload-weights-seconds", type=float, default=1.0,
      help="how long reloading the weights after a level-2 sleep takes (default 1.0)")
    a("--weights-mb", type=int, default=1024, help="simulated weights, MiB (accelerator; host while asleep at level 1)")
    a("--kv-cache-mb", type=int, default=1024, help="simulated KV cache on the accelerator, MiB (freed asleep)")
    a("--context-mb", type=int, default=256, help="simulated accelerator memory a sleeping engine keeps, MiB")
    a("--eos-after-tokens", type=int, default=0, help="finish with 'stop' after N tokens (0 = never)")
    a("--embedding-dim", type=int, default=16, help="length of the embedding vectors (default 16)")
    a("--fail-after-seconds", type=float, default=None, help="exit abruptly after this many seconds")
    a("--exit-code", type=int, default=1, help="exit status for --fail-after-seconds (137 looks like OOM)")
    a("--never-ready", action="store_true", help="never finish loading: /health stays 503")
    a(
        "--fault-file",
        default=None,
        metavar="PATH",
        help="fault injection read at start: if PATH holds 'crash' the sim exits with code 3 while loading; "
        "'crash-once' does the same and empties PATH (the next start is fine); 'hang' never finishes "
        "loading; missing or empty: no fault (lets tests fix a fault between starts)",
    )
    a(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY)",
    )
    a("--drain-seconds", type=float, default=30.0, help="on SIGTERM, time in-flight requests get to finish")
    a(
        "--log-requests",
        action="store_true",
        help="log the moment the sim becomes ready and each /v1 request's arrival, as epoch seconds with "
        "microseconds ('sim timing ready t=…', 'sim timing request t=…'); for benchmarks",
    )
    add_log_level(parser)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    served = _names(args.served_model_name) or [args.model]
    return SimConfig(
        model=args.model,
        served_names=served,
        lora_modules={
            name: path or name
            for name, _, path in (entry.partition("=") for entry in _names(args.lora_modules))
            if name not in served
        },
        startup_seconds=args.startup_seconds,
        ttft_ms=args.ttft_ms,
        tokens_per_second=args.tokens_per_second,
        max_concurrency=args.max_concurrency,
        prefill_tokens_per_second=max(0.0, args.prefill_tokens_per_second),
        batch_slowdown=max(0.0, args.batch_slowdown),
        max_tokens_default=max(1, args.max_tokens_default),
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        eos_after_tokens=args.eos_after_tokens,
        embedding_dim=max(1, args.embedding_dim),
        api_key=args.api_key or None,
        never_ready=args.never_ready,
        log_requests=args.log_requests,
        kv_events=_kv_events(args.kv_events_config),
        enable_lora=args.enable_lora,
        max_loras=max(1, args.max_loras),
        lora_load_ms=max(0.0, args.lora_load_ms),
        sleep=SleepConfig(
            enabled=args.enable_sleep_mode,
            dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "") in ("1", "true", "True"),
            sleep_seconds=max(0.0, args.sleep_seconds),
            wake_seconds=max(0.0, args.wake_seconds),
            reload_weights_seconds=max(0.0, args.reload_weights_seconds),
            weights_mb=max(0, args.weights_mb),
            kv_cache_mb=max(0, args.kv_cache_mb),
            context_mb=max(0, args.context_mb),
        ),
    )


def _kv_events(text: str | None) -> KVEventsConfig:
    if text is None:
        return KVEventsConfig()
    try:
        return parse_config(text)
    except ValueError as exc:
        raise SystemExit(f"sim: {exc}") from None


def _crash(code: int, after: float) -> None:
    log.error("sim failing exit_code=%d after=%.3gs (--fail-after-seconds)", code, after)
    logging.shutdown()
    os._exit(code)


async def serve(
    cfg: SimConfig,
    host: str,
    port: int,
    *,
    fail_after: float | None = None,
    exit_code: int = 1,
    drain_seconds: float = 30.0,
) -> int:
    """Run one simulator until SIGTERM/SIGINT; returns the exit status."""
    loop = asyncio.get_running_loop()
    sim = Sim(cfg)

    def make_request(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=CLIENT_MAX_SIZE)

    server = web.Server(sim.handle, request_factory=make_request, handler_cancellation=True, access_log=None)
    # in-flight requests are drained below; aiohttp's own wait is only for stragglers
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=min(1.0, drain_seconds))
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    bound: Any = runner.addresses[0]
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{bound[1]}"
    log.info("sim listening url=%s names=%s", url, ",".join(sorted(sim.names)))
    publisher = None
    if cfg.kv_events.active:
        publisher = Publisher(cfg.kv_events, bound[1])
        try:
            publisher.start()
        except zmq.ZMQError as exc:
            await runner.cleanup()
            raise SystemExit(f"sim: cannot open the KV events endpoint {publisher.endpoint}: {exc}") from None
        sim.kv.on_stored = publisher.stored
        sim.kv.on_removed = publisher.removed

    stop = asyncio.Event()
    graceful_exit(stop, "sim")

    def mark_ready() -> None:
        sim.ready = True
        if cfg.log_requests:
            log.info("sim timing ready t=%.6f", time.time())
        log.info("sim ready model=%s url=%s", cfg.primary, url)

    if cfg.never_ready:
        log.info("sim loading model=%s forever (--never-ready)", cfg.primary)
    elif cfg.startup_seconds > 0:
        log.info("sim loading model=%s seconds=%.3g", cfg.primary, cfg.startup_seconds)
        loop.call_later(cfg.startup_seconds, mark_ready)
    else:
        mark_ready()
    if fail_after is not None:
        loop.call_later(max(0.0, fail_after), _crash, exit_code, fail_after)

    await stop.wait()
    sim.draining = True
    m = sim.metrics
    log.info("sim draining running=%d waiting=%d timeout=%.3gs", m.running, m.waiting, drain_seconds)
    for s in list(runner.sites):
        await s.stop()  # stop accepting; open connections finish what they started
    cancelled = await sim.drain(drain_seconds)
    if cancelled:
        log.warning("sim drain timed out: cancelled %d in-flight requests", cancelled)
    await runner.cleanup()
    if publisher is not None:
        await publisher.close()
    log.info("sim stopped")
    return 0


def _read_fault(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            fault = f.read().strip()
    except FileNotFoundError:
        return ""
    if fault not in ("", "crash", "crash-once", "hang"):
        raise SystemExit(f"sim: unknown fault {fault!r} in {path}")
    if fault:
        log.warning("sim fault injected: %s (from %s)", fault, path)
    if fault == "crash-once":
        with open(path, "w", encoding="utf-8"):
            pass
        return "crash"
    return fault


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything one `wakegate sim` is configured with; built once from its command line."""

    sim: SimConfig
    """What the simulated server serves and how it behaves."""
    host: str
    """Address to listen on."""
    port: int
    """Port to listen on; 0: a free one."""
    fail_after: float | None
    """End abruptly after this many seconds with `exit_code` (no draining); None: never."""
    exit_code: int
    """Status of that abrupt end."""
    drain_seconds: float
    """Time in-flight requests get to finish after SIGTERM."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        fail_after, exit_code, never_ready = args.fail_after_seconds, args.exit_code, args.never_ready
        fault = _read_fault(args.fault_file)
        if fault == "crash":
            fail_after = args.startup_seconds / 2 if args.startup_seconds else 0.2
            exit_code = 3
        elif fault == "hang":
            never_ready = True
        args.never_ready = never_ready
        return settings_from(cls, args, sim=config_from_args(args), fail_after=fail_after, exit_code=exit_code)


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "sim")


def run(settings: Settings) -> int:
    coro = serve(
        settings.sim,
        settings.host,
        settings.port,
        fail_after=settings.fail_after,
        exit_code=settings.exit_code,
        drain_seconds=settings.drain_seconds,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is absent on Windows
        return asyncio.run(coro)
    return uvloop.run(coro)
