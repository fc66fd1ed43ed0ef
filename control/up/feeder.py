"""`wakegate up`'s xDS feeder in its own process, restarted by `up` if it dies.

`up` owns what is routable (its model runtimes); the feeder turns it into xDS for Envoy and
extproc. Between them is a Unix socket in the state directory (owner-only): `up` writes one
JSON line with every model's `RoutedModel` whenever routing changes, and the whole current
state first to every feeder that connects. A feeder serves ADS only once it holds that first
state, so a restarted feeder never pushes an empty configuration over a working one: Envoy
and extproc keep their last configuration while no feeder runs, and resubscribe on their own.

A restarted feeder does not know which endpoints Envoy has: a replica that became ready while
no feeder ran is in `up`'s state but not in Envoy, and handing it to extproc would release held
requests to a host Envoy cannot route to. So the first line also carries the *baseline*, the
last state `up` delivered to a feeder before; until an Envoy has connected and acknowledged
endpoints again, extproc gets only the endpoints of the baseline (Envoy has at most those).

With `--api-keys-file` (the file's path, never keys on a command line) it reads the gateway's key
file as extproc does (wakegate/keyfile.py), gives the keys to the native routes, and re-reads the
file when it changes, at most a second later: a new route table, never a new listener.

Run by `up` as `python -m wakegate.control.up.feeder --listen HOST:PORT --source PATH --gateway JSON`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.resources import (
    GatewaySettings,
    Resources,
    RoutedAdapter,
    RoutedModel,
    build,
    gateway_keys,
)
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.keyfile import RELOAD_INTERVAL, AuthConfigError, KeyFile
from wakegate.process import graceful_exit

log = logging.getLogger("wakegate.feeder")


def encode(models: list[RoutedModel], baseline: list[RoutedModel] | None = None) -> bytes:
    message: dict[str, Any] = {"models": [dataclasses.asdict(m) for m in models]}
    if baseline is not None:
        message["baseline"] = [dataclasses.asdict(m) for m in baseline]
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> tuple[list[RoutedModel], list[RoutedModel] | None]:
    """The models of one line, and the baseline if the line has one."""
    message = json.loads(line)
    baseline = message.get("baseline")
    return _models(message["models"]), None if baseline is None else _models(baseline)


def _models(raws: list[dict[str, Any]]) -> list[RoutedModel]:
    models = []
    for raw in raws:
        raw["names"] = tuple(raw["names"])
        raw["lora_adapters"] = tuple(raw["lora_adapters"])
        raw["adapters"] = tuple(
            RoutedAdapter(**{**a, "names": tuple(a["names"]), "endpoints": tuple(a["endpoints"])})
            for a in raw["adapters"]
        )
        raw["endpoints"] = tuple((host, int(port)) for host, port in raw["endpoints"])
        models.append(RoutedModel(**raw))
    return models


def gateway_json(gateway: GatewaySettings) -> str:
    return json.dumps(dataclasses.asdict(gateway))


def gateway_from_json(text: str) -> GatewaySettings:
    raw: dict[str, Any] = json.loads(text)
    raw["extra_listener_filters"] = tuple(raw["extra_listener_filters"])
    raw["access_log_clusters"] = tuple(raw["access_log_clusters"])
    return GatewaySettings(**raw)


class RoutedSource:
    """`up`'s side: a Unix socket that streams the routed models to the feeder process."""

    def __init__(self, path: Path, routed: Callable[[], list[RoutedModel]]) -> None:
        self.path = path
        self._routed = routed
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._pending = False
        #: The last state written to a feeder: what a restarted one may assume Envoy has at most.
        self._delivered: list[RoutedModel] | None = None
        #: ADS calls the feeders refused for a missing or wrong internal token, by service.
        self.refused: dict[str, int] = {}

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._client, path=str(self.path))
        finally:
            os.umask(old)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        current = self._routed()
        writer.write(encode(current, self._delivered))
        self._delivered = current
        self._writers.add(writer)
        base = dict(self.refused)  # counts of feeders before this one
        try:
            # The feeder writes only its refused-call counts (one JSON line when they change);
            # EOF: it is gone.
            while line := await reader.readline():
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    counts = json.loads(line)
                    for service, n in counts.items():
                        self.refused[str(service)] = base.get(str(service), 0) + int(n)
        finally:
            self._writers.discard(writer)
            writer.close()

    def publish_soon(self) -> None:
        """Coalesce a burst of changes into one line, written on the next loop turn."""
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._publish)

    def _publish(self) -> None:
        self._pending = False
        if not self._writers:
            return
        current = self._routed()
        line = encode(current)
        self._delivered = current
        for writer in list(self._writers):
            if writer.is_closing():
                self._writers.discard(writer)
                continue
            writer.write(line)

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class _Publisher(Publisher):
    """The feeder's publisher, gating extproc's endpoints by the baseline until Envoy is back."""

    def __init__(self, gateway: GatewaySettings, state: list[RoutedModel]) -> None:
        super().__init__(SnapshotCache(), gateway, lambda: state)
        self.baseline: dict[str, frozenset[tuple[str, int]]] | None = None

    async def publish(self) -> None:
        if (
            self.baseline is not None
            and self.ads is not None
            and any(self.ads.confirmed(node) is not None for node in self.ads.gateways())
        ):
            self.baseline = None  # an Envoy acknowledged endpoints again: its word from now on
        await super().publish()

    def _confirmed(self, node: str) -> Mapping[str, frozenset[tuple[str, int]]] | None:
        return self.baseline if self.baseline is not None else super()._confirmed(node)

    def _for_unknown(self, routed: list[RoutedModel], base: Resources) -> Resources:
        return base if self.baseline is None else build(routed, self.gateway, self.baseline, keys=self.keys)


async def serve(
    listen: str, source: Path, gateway: GatewaySettings, token_file: Path, keys_file: Path | None = None
) -> int:
    state: list[RoutedModel] = []
    publisher = _Publisher(gateway, state)
    keys: KeyFile[str] | None = None
    if keys_file is not None:
        try:
            keys = KeyFile(keys_file, str, log)
        except AuthConfigError as exc:
            log.error("feeder: %s", exc)
            return 2
        publisher.keys = gateway_keys(keys.entries)
    reader = writer = None
    for _ in range(200):
        try:
            reader, writer = await asyncio.open_unix_connection(str(source))
            break
        except OSError:
            await asyncio.sleep(0.05)
    if reader is None:
        log.error("feeder: cannot reach wakegate up at %s", source)
        return 2
    first = await reader.readline()
    if not first:
        log.error("feeder: wakegate up closed %s before sending its models", source)
        return 2
    state[:], baseline = decode(first)
    if baseline is not None:
        log.info("feeder: restarted; extproc gets only endpoints Envoy had until Envoy acknowledges again")
        publisher.baseline = {m.cluster: frozenset(m.endpoints) for m in baseline}
        for model in state:
            publisher.baseline.setdefault(model.cluster, frozenset())
    await publisher.publish()  # a snapshot before the first subscriber can ask
    authenticator = Authenticator(TokenSource(token_file))
    try:
        server, publisher.ads, port = await start_server(
            publisher.cache, listen, on_endpoints_acked=publisher.publish_soon, authenticator=authenticator
        )
    except (OSError, RuntimeError) as exc:
        log.error("feeder: cannot listen on %s: %s", listen, exc)
        return 2
    log.info("feeder serving ADS on port %d", port)
    stop = asyncio.Event()
    graceful_exit(stop, "feeder")

    async def follow() -> None:
        assert reader is not None
        while line := await reader.readline():
            state[:], _ = decode(line)
            publisher.publish_soon()
        log.warning("feeder: wakegate up went away")
        stop.set()

    async def report_refusals() -> None:
        assert writer is not None
        sent: dict[str, int] = {}
        while True:
            await asyncio.sleep(0.2)
            if authenticator.refused != sent:
                sent = dict(authenticator.refused)
                writer.write(json.dumps(sent).encode() + b"\n")

    async def follow_keys(keys: KeyFile[str]) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL)
            if keys.reload_if_changed():
                publisher.keys = gateway_keys(keys.entries)
                publisher.publish_soon()

    tasks = [asyncio.create_task(follow()), asyncio.create_task(report_refusals())]
    if keys is not None:
        tasks.append(asyncio.create_task(follow_keys(keys)))
    await stop.wait()
    for task in tasks:
        task.cancel()
    await server.stop(1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wakegate-up-feeder", description=__doc__)
    parser.add_argument("--listen", required=True, help="ADS address HOST:PORT")
    parser.add_argument("--source", required=True, type=Path, help="wakegate up's Unix socket of routed models")
    parser.add_argument("--gateway", required=True, help="the GatewaySettings, as JSON")
    parser.add_argument("--internal-token-file", required=True, type=Path, help="the token ADS clients present")
    parser.add_argument("--api-keys-file", type=Path, help="the gateway's API key file, for the native routes")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    return asyncio.run(
        serve(
            args.listen, args.source, gateway_from_json(args.gateway), args.internal_token_file, args.api_keys_file
        )
    )


if __name__ == "__main__":
    sys.exit(main())
