"""`wakegate up`'s xDS feeder in its own process, restarted by `up` if it dies.

`up` owns what is routable (its model runtimes); the feeder turns it into xDS for Envoy and
extproc. Between them is a Unix socket in the state directory (owner-only) carrying length-prefixed
frames of typed JSON (control/feeder/codec.py): `up` writes the whole current state first to
every feeder that connects, then one frame per burst of changes with only the models that
changed (and the keys of models gone). A feeder serves ADS only once it holds that first
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.codec import FrameError, frame, from_wire, read_frame, to_wire
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.resources import Resources, build
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings, gateway_keys
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.keyfile import RELOAD_INTERVAL, AuthConfigError, KeyFile
from wakegate.process import graceful_exit

log = logging.getLogger("wakegate.feeder")


def state_message(models: Iterable[RoutedModel], baseline: Iterable[RoutedModel] | None = None) -> dict[str, Any]:
    """The first message to a feeder: every model, and the baseline when there is one."""
    message: dict[str, Any] = {"state": [to_wire(m) for m in models]}
    if baseline is not None:
        message["baseline"] = [to_wire(m) for m in baseline]
    return message


def delta_message(upserted: Iterable[RoutedModel], removed: Iterable[str] = ()) -> dict[str, Any]:
    """A later message: the models that changed or appeared, and the keys of those gone."""
    return {"upsert": [to_wire(m) for m in upserted], "remove": list(removed)}


@dataclasses.dataclass(frozen=True)
class Update:
    """One message from `up`, decoded: a whole state (with its baseline, if any) or a delta."""

    upserted: tuple[RoutedModel, ...]
    removed: tuple[str, ...] = ()
    #: True for the first message: `upserted` is everything there is.
    whole: bool = False
    baseline: tuple[RoutedModel, ...] | None = None


def decode(message: Mapping[str, Any]) -> Update:
    """One message from `up`; a ValueError names what is wrong with it."""
    if "state" in message:
        baseline = message.get("baseline")
        return Update(
            upserted=_models(message["state"]),
            whole=True,
            baseline=None if baseline is None else _models(baseline),
        )
    if "upsert" in message:
        removed = message.get("remove", [])
        if not isinstance(removed, list) or not all(isinstance(k, str) for k in removed):
            raise ValueError("remove: expected a list of model keys")
        return Update(upserted=_models(message["upsert"]), removed=tuple(removed))
    raise ValueError(f"a message with neither state nor upsert: {sorted(message)}")


def _models(raws: Any) -> tuple[RoutedModel, ...]:
    if not isinstance(raws, list):
        raise ValueError("expected a list of models")
    return tuple(from_wire(RoutedModel, raw) for raw in raws)


def gateway_json(gateway: GatewaySettings) -> str:
    return json.dumps(to_wire(gateway))


def gateway_from_json(text: str) -> GatewaySettings:
    return from_wire(GatewaySettings, json.loads(text))


class RoutedSource:
    """`up`'s side: a Unix socket that streams the routed models to the feeder process.

    A feeder that connects gets every model; after that only the models that changed. A
    runtime says which model changed (`publish_soon(key)`); a burst of changes becomes one
    message on the next loop turn, and only those models are asked for their routing.
    """

    def __init__(
        self,
        path: Path,
        routed: Callable[[], list[RoutedModel]],
        routed_one: Callable[[str], RoutedModel | None] | None = None,
    ) -> None:
        self.path = path
        self._routed = routed
        self._routed_one = routed_one
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._pending = False
        #: Keys changed since the last message; None: every model may have changed.
        self._dirty: set[str] | None = set()
        #: The last state written to the feeders: what a restarted one may assume Envoy has at
        #: most, and what each delta is taken against.
        self._delivered: dict[str, RoutedModel] | None = None
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
        self._publish()  # feeders already connected catch up first: deltas go on from one state
        baseline = None if self._delivered is None else list(self._delivered.values())
        current = self._routed()
        writer.write(frame(state_message(current, baseline)))
        self._delivered = {m.key: m for m in current}
        self._dirty = set()
        self._writers.add(writer)
        base = dict(self.refused)  # counts of feeders before this one
        try:
            # The feeder writes only its refused-call counts (a frame when they change); EOF: it is gone.
            while (message := await read_frame(reader)) is not None:
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    for service, n in message["refused"].items():
                        self.refused[str(service)] = base.get(str(service), 0) + int(n)
        except (FrameError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.warning("feeder connection: %s", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    def publish_soon(self, key: str | None = None) -> None:
        """Model `key` (None: any) changed: tell the feeders on the next loop turn, with whatever
        else changed by then."""
        if key is None:
            self._dirty = None
        elif self._dirty is not None:
            self._dirty.add(key)
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._publish)

    def _changes(self) -> tuple[list[RoutedModel], list[str]]:
        """What changed since the last message, against what the feeders were given."""
        assert self._delivered is not None
        delivered = self._delivered
        if self._dirty is None or self._routed_one is None:
            current = {m.key: m for m in self._routed()}
            gone = [key for key in delivered if key not in current]
        else:
            current = {}
            gone = []
            for key in sorted(self._dirty):
                model = self._routed_one(key)
                if model is not None:
                    current[key] = model
                elif key in delivered:
                    gone.append(key)
        changed = [m for key, m in current.items() if delivered.get(key) != m]
        return changed, gone

    def _publish(self) -> None:
        self._pending = False
        if not self._writers or self._delivered is None:
            return
        changed, gone = self._changes()
        self._dirty = set()
        if not changed and not gone:
            return
        for model in changed:
            self._delivered[model.key] = model
        for key in gone:
            del self._delivered[key]
        data = frame(delta_message(changed, gone))
        for writer in list(self._writers):
            if writer.is_closing():
                self._writers.discard(writer)
                continue
            writer.write(data)

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class _Publisher(Publisher):
    """The feeder's publisher, gating extproc's endpoints by the baseline until Envoy is back."""

    def __init__(self, gateway: GatewaySettings, state: dict[str, RoutedModel]) -> None:
        super().__init__(SnapshotCache(), gateway, lambda: list(state.values()))
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
    state: dict[str, RoutedModel] = {}
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
    try:
        first = await read_frame(reader)
        update = None if first is None else decode(first)
    except (ValueError, asyncio.IncompleteReadError) as exc:
        log.error("feeder: wakegate up's first message at %s is unreadable: %s", source, exc)
        return 2
    if update is None or not update.whole:
        log.error("feeder: wakegate up closed %s before sending its models", source)
        return 2
    state.update((m.key, m) for m in update.upserted)
    baseline = update.baseline
    if baseline is not None:
        log.info("feeder: restarted; extproc gets only endpoints Envoy had until Envoy acknowledges again")
        publisher.baseline = {m.cluster: frozenset(m.endpoints) for m in baseline}
        for model in state.values():
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
        try:
            while (message := await read_frame(reader)) is not None:
                update = decode(message)
                for key in update.removed:
                    state.pop(key, None)
                state.update((m.key, m) for m in update.upserted)
                publisher.publish_soon()
            log.warning("feeder: wakegate up went away")
        except (ValueError, asyncio.IncompleteReadError) as exc:
            # `up` restarts a feeder that exits: the next one starts from a whole state again.
            log.error("feeder: unreadable message from wakegate up: %s", exc)
        stop.set()

    async def report_refusals() -> None:
        assert writer is not None
        sent: dict[str, int] = {}
        while True:
            await asyncio.sleep(0.2)
            if authenticator.refused != sent:
                sent = dict(authenticator.refused)
                writer.write(frame({"refused": sent}))

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
