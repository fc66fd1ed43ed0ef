"""`wakegate bench`: tokens/s and time to first token of an OpenAI-compatible endpoint.

Sends `--requests` streaming chat completions from a fixed prompt set, `--concurrency` at a
time, with a progress bar on stderr, and prints a summary. Throughput is completion tokens
of the successful requests over the run's wall time (what the node delivers at that
concurrency); TTFT is the median time to the first content chunk. With `--device-class`
the result is written into the bench results ConfigMap under the key the scheduler extender
looks up (:mod:`wakegate.control.placement.benchdata`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from wakegate.control.bench.measure import run_bench
from wakegate.control.k8s.client import Kube, KubeError, add_kubeconfig, api_client, path
from wakegate.control.k8s.names import BENCH_FIELD_MANAGER
from wakegate.control.placement.benchdata import DEFAULT_CONFIGMAP, BenchResult
from wakegate.process import ProcessSettings, add_log_level, settings_from, start

log = logging.getLogger("wakegate.bench")


def write_result(result: BenchResult, namespace: str, configmap: str, kubeconfig: str | None) -> None:
    """Merge one entry into the results ConfigMap, creating the ConfigMap if needed."""
    kube = Kube(api_client(kubeconfig))
    patch = {"data": {result.key: result.to_json()}}
    target = path("v1", "ConfigMap", namespace, configmap)
    for _ in range(3):
        try:
            kube.merge_patch(target, patch, BENCH_FIELD_MANAGER)
            return
        except KubeError as exc:
            if exc.status != 404:
                raise
        try:
            new = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": configmap}, **patch}
            kube.request("POST", path("v1", "ConfigMap", namespace), new, {"fieldManager": BENCH_FIELD_MANAGER})
            return
        except KubeError as exc:
            if exc.status != 409:  # created meanwhile by another bench: patch it
                raise
    raise RuntimeError(f"could not write ConfigMap {namespace}/{configmap}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="OpenAI-compatible base URL, e.g. http://10.0.0.5:8000/v1")
    a("--model", required=True, help="model name sent in the requests")
    a("--requests", type=int, default=32, help="requests in total")
    a("--concurrency", type=int, default=4, help="requests in flight at once")
    a("--max-tokens", type=int, default=128, help="max_tokens of each request")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY by default)")
    a("--timeout", type=float, default=300.0, help="seconds one request may take")
    a("--backend", default=None, help="backend plugin of the endpoint (part of the result key)")
    a("--device-class", default=None,
      help="`<vendor>-<arch>` of the GPU measured, e.g. nvidia-sm90; given: write the result to the ConfigMap")
    a("--model-key", default=None, help="the Model's name in the result key (--model by default)")
    a("--configmap", default=DEFAULT_CONFIGMAP, help="results ConfigMap")
    a("--namespace", default=os.environ.get("POD_NAMESPACE", "wakegate"),
      help="namespace of the results ConfigMap ($POD_NAMESPACE or wakegate by default)")
    add_kubeconfig(parser)
    a("--json", action="store_true", help="print the summary as one JSON line on stdout")
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything one `wakegate bench` run is configured with; built once from its command line."""

    url: str
    """OpenAI-compatible base URL."""
    model: str
    """Model name sent in the requests."""
    requests: int
    """Requests in total."""
    concurrency: int
    """Requests in flight at once."""
    max_tokens: int
    """max_tokens of each request."""
    api_key: str | None
    """Bearer token; None: none."""
    timeout: float
    """Seconds one request may take."""
    backend: str | None
    """Backend plugin of the endpoint (part of the result key)."""
    device_class: str | None
    """`<vendor>-<arch>` measured; None: the result is printed, not written."""
    model_key: str
    """The Model's name in the result key."""
    configmap: str
    """The results ConfigMap."""
    namespace: str
    """Namespace of the results ConfigMap."""
    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    json: bool
    """Also print the summary as one JSON line on stdout."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError with a message for the user."""
        if args.device_class and not args.backend:
            raise ValueError("--device-class needs --backend: both are part of the result key")
        if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
            raise ValueError("--requests, --concurrency and --max-tokens must be at least 1")
        return settings_from(cls, args, model_key=args.model_key or args.model)


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "bench")


def run(s: Settings) -> int:
    console = Console(stderr=True)
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        summary = asyncio.run(run_bench(
            s.url, s.model, requests=s.requests, concurrency=s.concurrency,
            max_tokens=s.max_tokens, api_key=s.api_key, timeout=s.timeout, progress=progress,
        ))
    console.print(
        f"{summary.requests} requests ({summary.failures} failed), {summary.tokens} tokens in "
        f"{summary.wall_s:.2f}s: {summary.tokens_per_second:.1f} tokens/s, "
        f"TTFT p50 {summary.ttft_ms:.1f} ms p90 {summary.ttft_p90_ms:.1f} ms"
    )
    if s.json:
        print(json.dumps(summary.__dict__), flush=True)
    if summary.failures == summary.requests:
        console.print(f"every request failed: {summary.first_error}")
        return 1
    if summary.failures:
        console.print(f"first failure: {summary.first_error}")
    if s.device_class and s.backend:
        result = BenchResult(
            backend=s.backend,
            model=s.model_key,
            device_class=s.device_class,
            tokens_per_second=round(summary.tokens_per_second, 3),
            ttft_ms=round(summary.ttft_ms, 3),
            measured_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            concurrency=s.concurrency,
            requests=s.requests,
        )
        write_result(result, s.namespace, s.configmap, s.kubeconfig)
        console.print(f"wrote {s.namespace}/{s.configmap} key {result.key}")
    sys.stdout.flush()
    return 0
