"""What one held request costs plain Envoy, by what holds it and how the client connects.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_held_envoy [--held 2000] [--h2-connections 20] [--json OUT]

No wakegate here: one Envoy (the one measured, `--concurrency 2` as `wakegate up` runs it) with
one listener whose filter chain holds every request in one of these ways, and a second Envoy
(the holder, not measured) that parks whatever reaches it in a 600 s fault-filter delay:

* `fault`: the request parked in the measured Envoy's own fault filter (no upstream at all);
* `routed-h2`: routed to the holder over HTTP/2 (one multiplexed upstream stream per request);
* `routed-h1`: routed to the holder over HTTP/1.1 (one upstream connection per request);
* `ext_proc`: an ext_proc filter (Envoy gRPC, body BUFFERED) whose processor is the holder, so
  the ext_proc stream stays open with its headers message unanswered, as a cold request's does
  in wakegate;
* `ext_proc+retry`: the same with the retry policy wakegate's listener puts on the gRPC
  service (control/feeder/resources.py): Envoy keeps a copy of each message for the retry.
  (Until wakegate parked its cold requests, this was what one cost.)
* `parked`: what a cold request is in wakegate now (extproc/park.py): the ext_proc stream (with
  the retry policy) answered at once by a processor of this benchmark that sends the request on
  with a park header and its body as it came (Envoy copies it out of the connection's read
  buffer), and a route on that header, with a retry policy and an internal redirect policy, to
  the holder over HTTP/2.

And, to tell apart what `parked` adds to `routed-h2` (`--ways` picks them; not run by default):

* `routed-h2+retry`, `routed-h2+redirect`: `routed-h2` with the park route's retry policy, or
  with its internal redirect policy;
* `parked-bare`: `parked` without either policy on the route and without the ext_proc retry;
* `parked-uncopied`: `parked` with the body left where Envoy read it (as wakegate parked first);
* `parked-hop`: `parked`, but the park route leads to a 307 (the holder answers it at once, with
  a hop header) that Envoy follows, and the request waits in the stream that redirect opens, on
  a route that turns on no ext_proc filter: the first pass's stream and filters are gone.

And, for scale, `idle`: HTTP/1.1 connections to the fault listener that send nothing at all (what a
client's connection costs before it asks for anything).

Each way is measured with `--held` requests from HTTP/1.1 clients (one connection each) and
from HTTP/2 clients (`--h2-connections` connections, tests/support/h2requests.py), all in one
run. The cost is the growth of Envoy's allocator total (`/memory` on its admin port: what
tcmalloc handed out, without its page cache) divided by the held requests, read two seconds
after Envoy counts all of them active. docs/performance.md has the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tests.bench.common import git_state, loadavg
from tests.support.h2requests import Connection
from tests.support.processes import stop_process
from tests.support.waiting import accepting, wait_for
from wakegate.control.admin import free_port
from wakegate.control.bootstrap import envoy_binary
from wakegate.extproc.h2grpc.call import GrpcServer
from wakegate.extproc.service import PROCESS_METHOD

WAYS = ("fault", "routed-h2", "routed-h1", "ext_proc", "ext_proc+retry", "parked")
PARTS = ("routed-h2+retry", "routed-h2+redirect", "parked-bare", "parked-uncopied", "parked-hop")
BODY = b'{"model":"held","messages":[{"role":"user","content":"hi"}]}'
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
FAULT = {
    "name": "envoy.filters.http.fault",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
        "max_active_faults": 1000000,
        "delay": {"fixed_delay": "600s", "percentage": {"numerator": 100}},
    },
}
#: The gRPC retry policy of wakegate's listener (without its retry priority).
RETRY = {
    "num_retries": 2,
    "retry_on": "connect-failure,refused-stream,reset",
    "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
}


def _listener(port: int, filters: list[dict[str, Any]], cluster: str | None) -> dict[str, Any]:
    action: dict[str, Any] = (
        {"route": {"cluster": cluster, "timeout": "0s"}} if cluster else {"direct_response": {"status": 200}}
    )
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "held",
        "codec_type": "AUTO",
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "http2_protocol_options": {"max_concurrent_streams": 100000},
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                            "routes": [{"match": {"prefix": "/"}, **action}]}]},
        "http_filters": [*filters, ROUTER],
    }
    return {
        "name": "held",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": hcm}]}],
    }


def _cluster(name: str, port: int, h2: bool) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000}]},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
    }
    if h2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 1000}},
        }}
    return cluster


def _bootstrap(admin: int, listener: dict[str, Any], clusters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {
            "overload": {"global_downstream_max_connections": 50000}}}]},
    }


def measured_config(way: str, port: int, admin: int, holder: int, processor: int = 0) -> dict[str, Any]:
    clusters = [_cluster("hold_h2", holder, True), _cluster("hold_h1", holder, False)]
    parked = way.startswith("parked")
    if parked:
        clusters.append(_cluster("processor", processor, True))
    if way == "fault":
        return _bootstrap(admin, _listener(port, [FAULT], None), clusters)
    if way.startswith("routed"):
        listener = _listener(port, [], "hold_h1" if way == "routed-h1" else "hold_h2")
        route = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
        route["routes"][0]["route"].update(_policies(way.partition("+")[2]))
        return _bootstrap(admin, listener, clusters)
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "processor" if parked else "hold_h2"}}
    if way in ("ext_proc+retry", "parked", "parked-uncopied", "parked-hop"):
        service["retry_policy"] = RETRY
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": service,
            "message_timeout": "600s",
            "max_message_timeout": "600s",
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                "request_body_mode": "BUFFERED"},
        },
    }
    listener = _listener(port, [ext_proc], "hold_h2")
    if parked:
        ext_proc["typed_config"]["route_cache_action"] = "CLEAR"
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        policies = _policies("" if way == "parked-bare" else "retry+redirect")
        park = {"match": {"prefix": "/", "headers": [{"name": "x-park", "present_match": True}]},
                "route": {"cluster": "hold_h2", "timeout": "0s", **policies}}  # fmt: skip
        routes = [park, {"match": {"prefix": "/"}, "direct_response": {"status": 404}}]
        if way == "parked-hop":
            # ext_proc is off unless a route turns it on (as on wakegate's native listeners): the
            # stream the hop's redirect opens meets the hop route, which does not.
            ext_proc["disabled"] = True
            routes[-1]["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {}}}  # fmt: skip
            hop = {"match": {"prefix": "/", "headers": [{"name": "x-hop", "present_match": True}]},
                   "route": {"cluster": "hold_h2", "timeout": "0s", **policies}}  # fmt: skip
            park["route"]["internal_redirect_policy"] = {"max_internal_redirects": 2, "redirect_response_codes": [307],
                                                         "response_headers_to_copy": ["x-hop"]}  # fmt: skip
            park["request_headers_to_add"] = [{"header": {"key": "x-hop-me", "value": "1"}}]
            routes.insert(0, hop)
        hcm["route_config"]["virtual_hosts"][0]["routes"] = routes
    return _bootstrap(admin, listener, clusters)


def holder_config(port: int, admin: int) -> dict[str, Any]:
    """The holder: every request parked in a 600 s fault delay, but one that asks for a hop and
    has not had it (`parked-hop`) answered at once with a 307 to its own path and the hop header."""
    listener = _listener(port, [FAULT], None)
    routes = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    no_fault = {"envoy.filters.http.fault": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}}  # fmt: skip
    routes.insert(0, {
        "match": {"prefix": "/", "headers": [{"name": "x-hop-me", "present_match": True},
                                             {"name": "x-hop", "present_match": True, "invert_match": True}]},
        "direct_response": {"status": 307},
        "response_headers_to_add": [{"header": {"key": "location", "value": "http://bench%REQ(:PATH)%"}},
                                    {"header": {"key": "x-hop", "value": "1"}}],
        "typed_per_filter_config": no_fault,
    })  # fmt: skip
    return _bootstrap(admin, listener, [])


def _policies(which: str) -> dict[str, Any]:
    """The park route's policies named in `which` ("retry", "redirect", joined by "+")."""
    wanted = set(which.split("+")) - {""}
    return {
        **({"retry_policy": RETRY} if "retry" in wanted else {}),
        **({"internal_redirect_policy": {"redirect_response_codes": [307], "response_headers_to_copy": ["x-park"]}}
           if "redirect" in wanted else {}),
    }  # fmt: skip


class _Parker:
    """The `parked` way's processor: every request is sent on at once with the park header, its
    body sent back as it came where `copy`."""

    copy = True

    def __init__(self, call: Any) -> None:
        self.call = call

    def on_message(self, data: bytes) -> None:
        message = ep.ProcessingRequest.FromString(data)
        park = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-park", raw_value=b"1"))
        common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[park]), clear_route_cache=True)
        if message.HasField("request_headers"):
            # The body (BUFFERED) comes next; the request is sent on with it.
            self.call.send(ep.ProcessingResponse(request_headers=ep.HeadersResponse()).SerializeToString())
            return
        if self.copy:
            common.body_mutation.body = message.request_body.body
        self.call.send(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common)).SerializeToString())
        self.call.finish()

    def on_half_close(self) -> None:
        self.call.finish()

    def on_cancel(self) -> None:
        pass


def _serve_parker(port: int, copy: bool) -> None:
    _Parker.copy = copy

    async def serve() -> None:
        server = GrpcServer({PROCESS_METHOD: _Parker})
        await server.listen(f"127.0.0.1:{port}")
        await asyncio.Event().wait()

    asyncio.run(serve())


def _admin(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def _stat(port: int, name: str) -> int:
    for line in _admin(port, f"/stats?filter=^{name}$").splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


class Envoy:
    def __init__(self, tmp: Path, name: str, config: dict[str, Any], admin: int) -> None:
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.admin = admin
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--base-id", str(admin), "--concurrency", "2", "-l", "error"],
            stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                _admin(admin, "/ready")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"Envoy {name} did not start (see {tmp / name}.log)") from None
                time.sleep(0.1)

    def allocated(self) -> int:
        return int(json.loads(_admin(self.admin, "/memory"))["allocated"])

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)


async def _hold(port: int, admin: int, client: str, held: int, connections: int) -> tuple[int, list[Any]]:
    """Open `held` requests; return how many Envoy counts active, and what to close later."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(BODY) + BODY
    )
    opened: list[Any] = []
    stat = "http.held.downstream_rq_active"
    if client == "idle":
        stat = "http.held.downstream_cx_active"
        opened.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(held))
    elif client == "h1":
        for _ in range(held):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(request)
            opened.append(sock)
    else:
        conns = [await Connection.open("127.0.0.1", port) for _ in range(connections)]
        opened.extend(conns)
        for i in range(held):
            conns[i % connections].request("POST", "/v1/chat/completions", "bench",
                                           {"content-type": "application/json"}, BODY)
        for conn in conns:
            await conn.drain()
    deadline = time.monotonic() + 120
    active = 0
    while time.monotonic() < deadline:
        active = await asyncio.to_thread(_stat, admin, stat)
        if active >= held:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)
    return active, opened


async def _close(opened: list[Any]) -> None:
    for item in opened:
        if isinstance(item, Connection):
            await item.close()
        else:
            item.close()


def measure(tmp: Path, way: str, client: str, held: int, connections: int, holder_port: int) -> dict[str, Any]:
    port, admin, processor = free_port(), free_port(), free_port()
    parker = None
    if way.startswith("parked"):
        command = [sys.executable, "-m", "tests.bench.bench_held_envoy", "--serve-parker", str(processor),
                   *(["--uncopied"] if way == "parked-uncopied" else [])]  # fmt: skip
        parker = subprocess.Popen(command)
        wait_for(lambda: accepting(processor) or parker.poll() is not None, 30, "the parked way's processor")
        if parker.poll() is not None:
            raise RuntimeError("the parked way's processor exited")
    envoy = Envoy(tmp, f"measured-{way}-{client}", measured_config(way, port, admin, holder_port, processor), admin)
    try:
        time.sleep(0.5)
        before = envoy.allocated()

        async def run() -> dict[str, Any]:
            active, opened = await _hold(port, admin, client, held, connections)
            allocated = await asyncio.to_thread(envoy.allocated)
            await _close(opened)
            return {"active": active, "allocated": allocated}

        got = asyncio.run(run())
    finally:
        envoy.stop()
        if parker is not None:
            stop_process(parker)
    return {
        "way": way,
        "client": {"h1": "HTTP/1.1", "idle": "HTTP/1.1 idle"}.get(client, f"HTTP/2 x{connections}"),
        "held": held,
        "active": got["active"],
        "kb_per_request": round((got["allocated"] - before) / held / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", type=int, default=2000, help="requests held at once per measurement")
    ap.add_argument("--h2-connections", type=int, default=20, help="HTTP/2 connections the requests share")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"ways to measure, comma-separated, of {', '.join(WAYS + PARTS)} (default: {','.join(WAYS)})")
    ap.add_argument("--clients", default="h1,h2", help="h1, h2 or both (default)")
    ap.add_argument("--serve-parker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--uncopied", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_parker:
        _serve_parker(args.serve_parker, copy=not args.uncopied)
        return 0
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.held + 200:
        raise SystemExit(f"RLIMIT_NOFILE {hard} is below --held {args.held} (+200)")
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS + PARTS):
        raise SystemExit(f"unknown ways: {', '.join(sorted(unknown))}")
    print(f"load average before: {loadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="wakegate-bench-held-envoy-") as name:
        tmp = Path(name)
        holder_port, holder_admin = free_port(), free_port()
        holder = Envoy(tmp, "holder", holder_config(holder_port, holder_admin), holder_admin)
        try:
            row = measure(tmp, "fault", "idle", args.held, args.h2_connections, holder_port)
            rows.append(row)
            print(f"  {row['client']:12s} {'(no request)':16s} {row['kb_per_request']:6.1f} KB per connection "
                  f"({row['active']} open)", flush=True)  # fmt: skip
            for client in args.clients.split(","):
                for way in ways:
                    row = measure(tmp, way, client, args.held, args.h2_connections, holder_port)
                    rows.append(row)
                    print(f"  {row['client']:12s} {way:16s} {row['kb_per_request']:6.1f} KB per held request "
                          f"({row['active']} active)", flush=True)  # fmt: skip
        finally:
            holder.stop()
    print(f"load average after: {loadavg()}\ncode: {git_state()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": loadavg(), "code": git_state()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
