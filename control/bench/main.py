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

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from wakegate.control.bench.measure import run_bench
from wakegate.control.placement.benchdata import DEFAULT_CONFIGMAP, BenchResult

log = logging.getLogger("wakegate.bench")

def write_result(result: BenchResult, namespace: str, configmap: str, kubeconfig: str | None) -> None:
    """Merge one entry into the results ConfigMap, creating the ConfigMap if needed."""
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

    from wakegate.control.extender.kube import api_client

    core = CoreV1Api(api_client(kubeconfig))
    patch = {"data": {result.key: result.to_json()}}
    for _ in range(3):
        try:
            core.patch_namespaced_config_map(configmap, namespace, patch)
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
        try:
            core.create_namespaced_config_map(namespace, {"metadata": {"name": configmap}, **patch})
            return
        except ApiException as exc:
            if exc.status != 409:  # created meanwhile by another bench: patch it
                raise
    raise RuntimeError(f"could not write ConfigMap {namespace}/{configmap}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="OpenAI-compatible base URL, e.g. http://10.0.0.5:8000/v1")
    a("--model", required=True, help="model name sent in the requests")
    a("--requests", type=int, default=32, help="requests in total (default 32)")
    a("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    a("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    a("--timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    a("--backend", default=None, help="backend plugin of the endpoint (part of the result key)")
    a("--device-class", default=None,
      help="`<vendor>-<arch>` of the GPU measured, e.g. nvidia-sm90; given: write the result to the ConfigMap")
    a("--model-key", default=None, help="the Model's name in the result key (default: --model)")
    a("--configmap", default=DEFAULT_CONFIGMAP, help=f"results ConfigMap (default {DEFAULT_CONFIGMAP})")
    a("--namespace", default=os.environ.get("POD_NAMESPACE", "wakegate"),
      help="namespace of the results ConfigMap (default: $POD_NAMESPACE or wakegate)")
    a("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    a("--json", action="store_true", help="print the summary as one JSON line on stdout")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.device_class and not args.backend:
        log.error("--device-class needs --backend: both are part of the result key")
        return 2
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        log.error("--requests, --concurrency and --max-tokens must be at least 1")
        return 2
    console = Console(stderr=True)
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        summary = asyncio.run(run_bench(
            args.url, args.model, requests=args.requests, concurrency=args.concurrency,
            max_tokens=args.max_tokens, api_key=args.api_key, timeout=args.timeout, progress=progress,
        ))
    console.print(
        f"{summary.requests} requests ({summary.failures} failed), {summary.tokens} tokens in "
        f"{summary.wall_s:.2f}s: {summary.tokens_per_second:.1f} tokens/s, "
        f"TTFT p50 {summary.ttft_ms:.1f} ms p90 {summary.ttft_p90_ms:.1f} ms"
    )
    if args.json:
        print(json.dumps(summary.__dict__), flush=True)
    if summary.failures == summary.requests:
        console.print(f"every request failed: {summary.first_error}")
        return 1
    if summary.failures:
        console.print(f"first failure: {summary.first_error}")
    if args.device_class:
        result = BenchResult(
            backend=args.backend,
            model=args.model_key or args.model,
            device_class=args.device_class,
            tokens_per_second=round(summary.tokens_per_second, 3),
            ttft_ms=round(summary.ttft_ms, 3),
            measured_at=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            concurrency=args.concurrency,
            requests=args.requests,
        )
        write_result(result, args.namespace, args.configmap, args.kubeconfig)
        console.print(f"wrote {args.namespace}/{args.configmap} key {result.key}")
    sys.stdout.flush()
    return 0
