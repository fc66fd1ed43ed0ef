"""What API keys cost on the request path, before and after a change, side by side in one run.

Run from the repository root (not collected by `pytest tests`; needs `wrk` on PATH):

    git archive BASE_COMMIT | tar -x -C /tmp/base          # the code to compare with
    python -m tests.bench.bench_keys --base /tmp/base [--duration 6] [--connections 32]
                                     [--keys 100] [--repeat 2] [--json OUT]

For each tree (`--base`, and this checkout), two `wakegate up` stacks with one sim-backed model
(`bench-model`, min = max = 1), each with its own Envoy and extprocs: one without auth, one with
a key file of `--keys` keys. This checkout's file holds as many plain keys as scoped ones
(`KEY bench-model,other`); the base's holds the same number of keys, all plain (a base without
scoped keys would ignore scoped lines). Every path POSTs bench_gateway's small chat completion
with the model in the JSON body (extproc buffers it: the usual OpenAI-client case):

* `<tree> none`: no auth;
* `<tree> key`: a gateway-wide key (the last line of the file: every digest is compared anyway);
* `branch scoped`: a key scoped to `bench-model` (this checkout only).

Each round measures every path at `--connections` (throughput) and at one connection (latency),
paths in turn; the table shows medians over rounds with extproc's CPU per request (the active
extproc's CPU time over the requests served), which depends less on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.bench.bench_gateway import MODELS_YAML
from tests.bench.common import REPO_ROOT, git_state, loadavg
from tests.bench.procs import CpuMeter, Proc, children_of, cmdline, http, wait_until
from tests.bench.wrk import BODY, MODEL, WrkResult, lua_script, parse_wrk, run_wrk
from wakegate.control.admin import free_port


class Stack:
    """One `wakegate up` running the code of `tree`, with or without a key file."""

    def __init__(self, name: str, tree: Path, tmp: Path, keys: Path | None) -> None:
        self.name = name
        self.tmp = tmp
        tmp.mkdir(parents=True)
        (tmp / "models.yaml").write_text(MODELS_YAML)
        self.port, self.admin = free_port(), free_port()
        argv = [sys.executable, "-m", "wakegate", "up", "-f", str(tmp / "models.yaml"),
                "--listen", f"127.0.0.1:{self.port}", "--admin-listen", f"127.0.0.1:{self.admin}",
                "--state-dir", str(tmp / "state"), "--log-level", "WARNING"]  # fmt: skip
        if keys is not None:
            argv += ["--api-keys-file", str(keys)]
        env_path = str(tree / "proto")
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = env_path  # Proc copies os.environ: the child imports this tree
        try:
            self.proc = Proc(f"up-{name}", argv, tmp / "up.log", cwd=tmp)
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def wait(self) -> None:
        def ready() -> bool:
            status = json.loads(http(f"http://127.0.0.1:{self.admin}/status")[1])
            return {m["key"]: m["ready"] for m in status["models"]}.get(MODEL) == 1 and "serving on" in self.proc.log(
                100_000
            )

        wait_until(ready, f"{self.name}: model ready", 120, [self.proc])
        children = {pid: cmdline(pid) for pid in children_of(self.proc.pid)}
        self.extproc = next(pid for pid, cmd in children.items() if "wakegate.extproc" in cmd and "extproc-0" in cmd)
        #: Every process of the stack, so that "other load" is what the machine ran besides it.
        self.pids = {"up": self.proc.pid, **{f"child-{pid}": pid for pid in children}, "extproc": self.extproc}
        del self.pids[f"child-{self.extproc}"]

    def stop(self) -> None:
        self.proc.stop(30.0, group_term=False)


def key_files(tmp: Path, count: int) -> tuple[Path, Path]:
    """(base file, branch file), `count` keys each; the keys used are the last plain and scoped ones."""
    plain = [f"sk-bench-plain-{i:04d}" for i in range(count // 2)]
    scoped = [f"sk-bench-scoped-{i:04d}" for i in range(count - count // 2)]
    base, branch = tmp / "keys-base.txt", tmp / "keys-branch.txt"
    base.write_text("".join(f"{k}\n" for k in [*scoped, *plain]))
    branch.write_text("".join(f"{k} {MODEL},other\n" for k in scoped) + "".join(f"{k}\n" for k in plain))
    return base, branch


def micro(base: Path, files: tuple[Path, Path], calls: int = 20_000) -> dict[str, float]:
    """µs per key check in-process: the base's ApiKeys.check and this checkout's check and scope.

    Each tree's extproc/auth.py is loaded from its file (it imports only the standard library).
    Best of 5 rounds of `calls` checks of the last key of each file (every digest is compared).
    """
    import importlib.util
    import timeit

    def load(tree: Path, name: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, tree / "extproc" / "auth.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module

    old, new = load(base, "base_auth"), load(REPO_ROOT, "branch_auth")
    base_file, branch_file = files
    lines = branch_file.read_text().splitlines()
    last_plain = "Bearer " + lines[-1].split()[0]
    last_scoped = "Bearer " + next(line for line in reversed(lines) if " " in line).split()[0]
    cases = {
        "base check(key)": (old.ApiKeys(base_file).check, last_plain),
        "branch check(key)": (new.ApiKeys(branch_file).check, last_plain),
        "branch scope(key)": (new.ApiKeys(branch_file).scope, last_plain),
        "branch scope(scoped key)": (new.ApiKeys(branch_file).scope, last_scoped),
        "branch scope(wrong key)": (new.ApiKeys(branch_file).scope, "Bearer sk-not-a-key"),
    }
    out = {}
    for name, (fn, header) in cases.items():
        assert fn(header) or "wrong" in name, name
        best = min(timeit.repeat(lambda fn=fn, header=header: fn(header), number=calls, repeat=5))
        out[name] = round(best / calls * 1e6, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_keys", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a tree of the code to compare with (git archive)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per wrk run (default 6)")
    ap.add_argument("--connections", type=int, default=32, help="connections of the throughput runs (default 32)")
    ap.add_argument("--keys", type=int, default=100, help="keys in each key file (default 100)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over all paths (default 2)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load per path first")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found on PATH", file=sys.stderr)
        return 2
    if not (args.base / "proto" / "wakegate").is_dir():
        print(f"{args.base} has no proto/wakegate: give a tree of this repository", file=sys.stderr)
        return 2

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    tmp = Path(tempfile.mkdtemp(prefix="wakegate-bench-keys-"))
    base_keys, branch_keys = key_files(tmp, args.keys)
    stacks = {
        "base none": Stack("base-none", args.base, tmp / "base-none", None),
        "base key": Stack("base-key", args.base, tmp / "base-key", base_keys),
        "branch none": Stack("branch-none", REPO_ROOT, tmp / "branch-none", None),
        "branch key": Stack("branch-key", REPO_ROOT, tmp / "branch-key", branch_keys),
    }
    plain_key = f"sk-bench-plain-{args.keys // 2 - 1:04d}"
    scoped_key = f"sk-bench-scoped-{args.keys - args.keys // 2 - 1:04d}"
    scripts = {
        "none": lua_script(tmp, "none.lua", {}),
        "key": lua_script(tmp, "key.lua", {"Authorization": f"Bearer {plain_key}"}),
        "scoped": lua_script(tmp, "scoped.lua", {"Authorization": f"Bearer {scoped_key}"}),
    }
    paths = [
        ("base none", stacks["base none"], scripts["none"]),
        ("base key", stacks["base key"], scripts["key"]),
        ("branch none", stacks["branch none"], scripts["none"]),
        ("branch key", stacks["branch key"], scripts["key"]),
        ("branch scoped", stacks["branch key"], scripts["scoped"]),
    ]
    checks = micro(args.base, (base_keys, branch_keys))
    print("key check in-process, µs per call (best of 5):")
    for name, us in checks.items():
        print(f"  {name:<26} {us:>6.2f}")
    results: list[WrkResult] = []
    load_before = loadavg()
    try:
        print(f"load average before: {load_before}; starting 4 wakegate up in {tmp} ...", flush=True)
        for stack in stacks.values():
            stack.wait()
        headers = {"Content-Type": "application/json"}
        for name, stack, _script in paths:
            auth = {"none": {}, "key": {"Authorization": f"Bearer {plain_key}"}}.get(name.split()[1])
            auth = auth if auth is not None else {"Authorization": f"Bearer {scoped_key}"}
            status, body = http(stack.url, BODY, {**headers, **auth})
            if status != 200:
                raise RuntimeError(f"{name}: {status} {body[:300]!r}")
        for round_ in range(args.repeat):
            for conns in (args.connections, 1):
                for name, stack, script in paths:
                    if round_ == 0 and conns == args.connections and args.warmup > 0:
                        run_wrk(wrk, stack.url, script, conns, args.warmup, latency=False)
                    meter = CpuMeter(stack.pids)
                    meter.start()
                    out, wrk_ticks = run_wrk(wrk, stack.url, script, conns, args.duration)
                    result = parse_wrk(name, conns, args.duration, out)
                    result.cpu = meter.stop(wrk_ticks)
                    result.load_after = loadavg()
                    results.append(result)
                    print(f"  {name:<14} c={conns:<3} {result.rps:>8.0f} req/s  p50 {result.p50_ms:.3f} ms  "
                          f"extproc {_extproc_us(result):.0f} µs/req  other load {result.cpu['other_load']:.0f}%"
                          f"{'' if result.errors == 0 else f'  ERRORS {result.errors}'}", flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        for stack in stacks.values():
            stack.stop()
    rows = []
    for conns in (args.connections, 1):
        for name, _stack, _script in paths:
            runs = [r for r in results if r.path == name and r.connections == conns]
            rows.append({
                "path": name,
                "connections": conns,
                "rps": round(statistics.median(r.rps for r in runs)),
                "p50_ms": round(statistics.median(r.p50_ms for r in runs), 3),
                "extproc_us_per_req": round(statistics.median(_extproc_us(r) for r in runs), 1),
                "other_load_pct": round(statistics.median(r.cpu["other_load"] for r in runs)),
                "errors": sum(r.errors for r in runs),
            })  # fmt: skip
    print(f"\n{'path':<14} {'conns':>5} {'req/s':>8} {'p50 ms':>8} {'extproc µs/req':>15} {'other load %':>13}")
    for row in rows:
        print(f"{row['path']:<14} {row['connections']:>5} {row['rps']:>8} {row['p50_ms']:>8.3f} "
              f"{row['extproc_us_per_req']:>15.1f} {row['other_load_pct']:>13}"
              f"{'' if not row['errors'] else '  <-- ERRORS'}")  # fmt: skip
    print(f"load average before {load_before}, after {loadavg()}")
    if args.json is not None:
        report = {"code": git_state(), "keys": args.keys, "micro_us": checks, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(not row["errors"] for row in rows) else 1


def _extproc_us(result: WrkResult) -> float:
    """CPU µs of the active extproc per request served."""
    pct = result.cpu.get("extproc", 0.0)
    return pct / 100.0 * result.duration_s / max(1, result.requests) * 1e6


if __name__ == "__main__":
    sys.exit(main())
