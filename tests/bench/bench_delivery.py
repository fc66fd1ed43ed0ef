"""Model delivery benchmark: flash-load vs the disk, OCI pull vs a copy, engine cold start two ways.

Run from the repository root as root (it drops the page cache), not collected by pytest:

    python -m tests.bench.bench_delivery [--rounds 3] [--threads 1,2,4,8] [--chunks 1M,4M,16M]
                                         [--dim 1024 --layers 8] [--work DIR] [--skip-engine] [--json OUT]

One generated GGUF (`e2e.tinymodel`, 409 MB at the defaults) on disk, pushed to a real
Distribution registry on loopback and pulled into a cache, then per round, every figure next to
its reference measured in the same round (the machine is shared and noisy):

* device: a plain sequential read of the cached file in 16 MiB blocks (one stream, buffered,
  the kernel's readahead) after dropping the page cache: the disk's own rate;
* flash-load: `flash_load` of the cache entry into /dev/shm after dropping the page cache, for
  every threads x chunk size, each as a rate, as a share of that round's device rate (the mean
  of a plain read before and after the sweep), and the CPU it kept busy (cores: this process's
  CPU seconds over the wall time); the same at 4 threads, 4 MiB without the block check, to
  show what verifying costs; and the page-cache mode (no copy) at 4 threads, 4 MiB;
* pull: `resolve()` of the tag into an empty cache (manifest, blob, verification, fsync, commit)
  vs copying the registry's stored blob to a new file with `shutil.copyfile` plus fsync, both
  from a cold page cache;
* cold start: llama-server (the real binary, `e2e.engines`) started on the cache entry after
  dropping the page cache, vs flash-loading the entry into /dev/shm and starting it there (the
  flash-load counted): time from the start to /health answering 200 and to the first streamed
  token of a one-token chat completion.

The page cache is dropped with `echo 1 > /proc/sys/vm/drop_caches` (after `sync`), which only
root may do; elsewhere `POSIX_FADV_DONTNEED` on the files involved. Residency after a drop is
checked with `fincore` when it is installed and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from e2e import engines
from e2e.tinymodel import ModelSpec, write_model
from e2e.tools.registry import start_registry
from tests.bench.common import git_state, loadavg
from tests.support.processes import stop_process
from wakegate.control.admin import free_port
from wakegate.control.delivery.cache import Cache, parse_size
from wakegate.control.delivery.flashload import files_of, flash_load
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access, Policy, resolve

SHM = Path("/dev/shm/wakegate-bench-delivery")
READ_BLOCK = 16 * 1024 * 1024


def drop_page_cache(*files: Path) -> str:
    """Empty the page cache (all of it as root, else just `files`); returns the method used."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return "drop_caches"
    except OSError:
        for path in files:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        return "fadvise"


def resident(path: Path) -> str:
    if not shutil.which("fincore"):
        return "fincore not installed"
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return f"{out.stdout.strip() or out.stderr.strip()} bytes resident"


def cpu_seconds() -> float:
    """CPU time of this process, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plain_read(path: Path) -> float:
    drop_page_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as stream:
        while stream.read(READ_BLOCK):
            pass
    return path.stat().st_size / (time.perf_counter() - start)


def copy_with_fsync(src: Path, dest: Path) -> float:
    drop_page_cache(src)
    start = time.perf_counter()
    shutil.copyfile(src, dest)
    with open(dest, "rb+") as out:
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    dest.unlink()
    return seconds


def registry_blob(storage: Path, digest: str) -> Path:
    hexdigest = digest.partition(":")[2]
    return storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexdigest[:2] / hexdigest / "data"


def first_token(port: int, started: float) -> float:
    """Seconds from `started` until the first streamed content of a one-token completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    try:
        while line := resp.readline():
            if line.startswith(b"data: ") and b'"content"' in line:
                return time.perf_counter() - started
    finally:
        conn.close()
    raise RuntimeError("the stream ended without a token")


@contextlib.contextmanager
def llama_server(binary: Path, model: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [
        str(binary),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        "2",
        "--ctx-size",
        "512",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port, proc
    finally:
        stop_process(proc, timeout=10)


def cold_start(binary: Path, model: Path, started: float) -> tuple[float, float]:
    """(seconds to /health 200, seconds to the first token), both from `started`."""
    with llama_server(binary, model) as (port, proc):
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server never became healthy")
            time.sleep(0.005)
        healthy = time.perf_counter() - started
        return healthy, first_token(port, started)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "model.gguf"
    write_model(model, ModelSpec(layers=args.layers, dim=args.dim))
    size = model.stat().st_size
    print(f"model {size / 1e6:.1f} MB on {work}; load {loadavg()}", flush=True)
    threads = [int(t) for t in args.threads.split(",")]
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    binary = None if args.skip_engine else engines.ensure("llama-server")
    results: dict[str, Any] = {"size": size, "git": git_state(), "load_before": loadavg(), "rounds": []}
    with start_registry(work / "reg") as reg:
        registry = RegistrySettings(docker_config=reg.docker_config)
        ref = f"oci://{reg.host}/bench/model:v1"
        digest = asyncio.run(push(model, ref, settings=registry))
        cache = Cache(work / "cache")
        resolved = asyncio.run(resolve(ref, cache, access=Access(registry=registry)))
        record = resolved.record
        assert record is not None
        cached_file = resolved.model_path
        blob = registry_blob(reg.storage, record.files[0].digest)
        method = drop_page_cache(cached_file)
        results["drop"] = method
        results["resident_after_drop"] = resident(cached_file)
        print(f"page cache dropped with {method}: {results['resident_after_drop']}", flush=True)
        for round_no in range(args.rounds):
            row: dict[str, Any] = {"load": loadavg()}
            row["device"] = plain_read(cached_file)
            sweep, cpu = {}, {}
            for t in threads:
                for c in chunks:
                    drop_page_cache(cached_file)
                    before = cpu_seconds()
                    staged = flash_load(files_of(record, cache.files_dir(record.key)), SHM, threads=t, chunk_size=c)
                    sweep[f"{t}x{c // (1 << 20)}M"] = staged.rate
                    cpu[f"{t}x{c // (1 << 20)}M"] = (cpu_seconds() - before) / staged.seconds
                    shutil.rmtree(SHM)
            row["flash_load"] = sweep
            row["flash_load_cpu"] = cpu
            drop_page_cache(cached_file)
            unverified = [replace(f, blocks=None) for f in files_of(record, cache.files_dir(record.key))]
            row["flash_load_unverified"] = flash_load(unverified, SHM, threads=4, chunk_size=4 << 20).rate
            shutil.rmtree(SHM)
            row["device_after_sweep"] = plain_read(cached_file)
            drop_page_cache(cached_file)
            row["page_cache_mode"] = flash_load(
                files_of(record, cache.files_dir(record.key)), None, threads=4, chunk_size=4 << 20
            ).rate
            pull_cache = Cache(work / f"pull-{round_no}")
            drop_page_cache(blob)
            start = time.perf_counter()
            pulled = asyncio.run(resolve(ref, pull_cache, access=Access(registry=registry), policy=Policy.ALWAYS))
            row["pull_s"] = time.perf_counter() - start
            pulled.release()
            shutil.rmtree(pull_cache.root)
            row["copy_s"] = copy_with_fsync(blob, work / "copy.bin")
            if binary is not None:
                drop_page_cache(cached_file)
                start = time.perf_counter()
                row["engine_from_cache"] = cold_start(binary, cached_file, start)
                drop_page_cache(cached_file)
                start = time.perf_counter()
                staged = flash_load(files_of(record, cache.files_dir(record.key)), SHM)
                loaded = time.perf_counter() - start
                healthy, token = cold_start(binary, SHM / Path(cached_file).name, start)
                row["engine_from_shm"] = (healthy, token, loaded)
                shutil.rmtree(SHM)
            results["rounds"].append(row)
            print(json.dumps(row), flush=True)
        resolved.release()
        results["digest"] = digest
    results["load_after"] = loadavg()
    return results


def report(results: dict[str, Any]) -> None:
    rounds = results["rounds"]
    size = results["size"]
    mb = 1e6
    device = [r["device"] for r in rounds] + [r["device_after_sweep"] for r in rounds]
    print(
        f"\nmodel {size / mb:.1f} MB, {len(rounds)} rounds, page cache dropped by {results['drop']} "
        f"({results['resident_after_drop']}), load {results['load_before']} -> {results['load_after']}"
    )
    print(
        f"device sequential read (plain 16 MiB reads, cold): median {median(device) / mb:.0f} MB/s "
        f"(min {min(device) / mb:.0f}, max {max(device) / mb:.0f})"
    )
    print("\nflash-load into /dev/shm, verified, cold source (median MB/s; % of the same round's device rate)")
    keys = list(rounds[0]["flash_load"])
    for key in keys:
        rates = [r["flash_load"][key] for r in rounds]
        shares = [r["flash_load"][key] / ((r["device"] + r["device_after_sweep"]) / 2) for r in rounds]
        cpu = [r["flash_load_cpu"][key] for r in rounds]
        print(
            f"  threads x chunk {key:>6}: {median(rates) / mb:7.0f} MB/s  {100 * median(shares):5.1f}%  "
            f"CPU {median(cpu):.2f} cores"
        )
    unverified = [r["flash_load_unverified"] for r in rounds]
    print(
        f"  4x4M without the block check (diagnosis only): {median(unverified) / mb:.0f} MB/s "
        f"{100 * median([r['flash_load_unverified'] / r['device'] for r in rounds]):.1f}%"
    )
    pcm = [r["page_cache_mode"] for r in rounds]
    print(
        f"  page-cache mode 4x4M: {median(pcm) / mb:.0f} MB/s "
        f"{100 * median([r['page_cache_mode'] / r['device'] for r in rounds]):.1f}%"
    )
    pulls, copies = [r["pull_s"] for r in rounds], [r["copy_s"] for r in rounds]
    print(
        f"\nOCI pull from the local registry: median {median(pulls):.2f} s ({size / median(pulls) / mb:.0f} MB/s); "
        f"copy of the same bytes from disk: {median(copies):.2f} s ({size / median(copies) / mb:.0f} MB/s); "
        f"pull/copy {median([p / c for p, c in zip(pulls, copies, strict=True)]):.2f}x"
    )
    if "engine_from_cache" in rounds[0]:
        cache_h = [r["engine_from_cache"][0] for r in rounds]
        cache_t = [r["engine_from_cache"][1] for r in rounds]
        shm_l = [r["engine_from_shm"][2] for r in rounds]
        shm_h = [r["engine_from_shm"][0] for r in rounds]
        shm_t = [r["engine_from_shm"][1] for r in rounds]
        print("\nllama-server cold start, cold page cache (median s from start)")
        print(f"  from the cache dir:             healthy {median(cache_h):.2f}  first token {median(cache_t):.2f}")
        print(
            f"  flash-load to /dev/shm + start: healthy {median(shm_h):.2f}  first token {median(shm_t):.2f} "
            f"(flash-load {median(shm_l):.2f} of it)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--chunks", default="1M,4M,16M")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/var/tmp/wakegate-bench-delivery"),
        help="on the disk under test (not a tmpfs)",
    )
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        results = run(args)
    finally:
        shutil.rmtree(SHM, ignore_errors=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
