"""API keys on both paths through the real gateway: Envoy's api_key_auth on the native routes,
extproc on the decided path, from one key file (docs/decisions.md, "The native path").

Twin models `nat` (native) and `dec` (decided), and twin guards `nat-guard` and `dec-guard`
whose sims themselves demand the gateway-wide key: a guard answers 200 only if the gateway's key
reached it. Every answer a client sees is asserted the same on both paths, and Envoy's counters
tell which path answered (a natively routed or refused request opens no ext_proc stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.test_native import Gateway as NativeGateway
from tests.support.http import Response, request
from tests.support.up import UpProcess, model_doc
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

WIDE = "sk-native-wide-0123456789"
SCOPED = "sk-native-scoped-abcdefghij"
ROTATED = "sk-native-rotated-zyxwvuts"
KEYS_TEXT = f"# both paths\n{WIDE}\n{SCOPED}  nat, dec\n"
PATHS = {"nat": "native", "dec": "decided", "nat-guard": "native", "dec-guard": "decided"}
FLEET = "".join(
    model_doc(
        name,
        extra=f"""  aliases: [{name}-alias]
  args: [--tokens-per-second, "200"{', --api-key, "' + WIDE + '"' if name.endswith("guard") else ""}]
  routing: {{strategy: round-robin{", path: native" if path == "native" else ""}}}
  scaling: {{min: 1, max: 1}}
""",
    )
    for name, path in PATHS.items()
)


class Gateway(NativeGateway):
    def __init__(self, up: UpProcess, envoy_admin: str, keys: Path) -> None:
        super().__init__(up, envoy_admin)
        self.keys = keys

    def paths(self) -> dict[str, str]:
        return {m["key"]: m["routingPath"] for m in self.up.status()["models"]}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("native-keys")
    keys = tmp / "keys.txt"
    keys.write_text(KEYS_TEXT)
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp, FLEET, "--api-keys-file", str(keys), "--envoy-admin-listen", envoy_admin)
    try:
        up.wait_ready(dict.fromkeys(PATHS, 1), timeout=90)
        gw = Gateway(up, envoy_admin, keys)
        wait_for(lambda: gw.paths() == PATHS, 10, "the native models on their native routes")
        yield gw
    finally:
        code = up.stop()
        assert code == 0, up.log()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NAMINGS: dict[str, Callable[[str], tuple[str, dict[str, Any], dict[str, str]]]] = {
    "body": lambda m: ("/v1/chat/completions", {**CHAT, "model": m}, {}),
    "header": lambda m: ("/v1/chat/completions", CHAT, {"x-model-id": m}),
    "path": lambda m: (f"/model/{m}/v1/chat/completions", CHAT, {}),
}


def chat(gw: Gateway, model: str, authorization: str | None, naming: str = "body") -> Response:
    path, body, headers = NAMINGS[naming](model)
    if authorization is not None:
        headers = {**headers, "authorization": authorization}
    return request("POST", gw.up.url + path, headers=headers, body=body)


def answered(gw: Gateway, model: str, authorization: str | None, naming: str = "body") -> tuple[Response, int]:
    """The reply, and how many ext_proc streams it opened."""
    before = gw.extproc_streams()
    reply = chat(gw, model, authorization, naming)
    return reply, gw.extproc_streams() - before


def refusal(reply: Response) -> tuple[int, str, dict[str, Any]]:
    assert reply.headers["content-type"].startswith("application/json"), (reply.status, reply.text)
    return reply.status, reply.headers["content-type"], reply.json()


UNAUTHORIZED = {
    "error": {"message": "missing or invalid API key", "type": "authentication_error", "code": "invalid_api_key"}
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_no_key_a_wrong_key_or_a_bare_key_get_the_same_401_on_both(keyed: Gateway, naming: str) -> None:
    for authorization in (None, "Bearer sk-native-wrong-key-000", WIDE, "Basic " + WIDE, "Bearer "):
        replies = {model: answered(keyed, model, authorization, naming) for model in ("nat", "dec")}
        for model, (reply, _) in replies.items():
            assert refusal(reply) == (401, "application/json", UNAUTHORIZED), (model, authorization)
        # A wrong key in the Bearer form is Envoy's to refuse on the native route.
        if authorization == "Bearer sk-native-wrong-key-000":
            assert replies["nat"][1] == 0, "the native route asked extproc"


@pytest.mark.parametrize("naming", sorted(NAMINGS))
@pytest.mark.parametrize("model", ["nat", "dec"])
def test_the_wide_and_the_scoped_key_reach_the_model_natively_where_native(
    keyed: Gateway, model: str, naming: str
) -> None:
    for key in (WIDE, SCOPED):
        reply, streams = answered(keyed, model, f"Bearer {key}", naming)
        assert reply.status == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        assert (streams == 0) == (model == "nat"), streams


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_a_lower_case_scheme_and_several_spaces_are_read_alike(keyed: Gateway, model: str) -> None:
    # extproc reads this form; Envoy would not, so the native route leaves it to extproc.
    reply = chat(keyed, model, f"bearer   {SCOPED}")
    assert reply.status == 200, reply.text


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_a_scoped_key_gets_the_same_404_for_a_model_outside_its_scope(keyed: Gateway, naming: str) -> None:
    for guard in ("nat-guard", "dec-guard"):
        for name in (guard, f"{guard}-alias"):
            reply, streams = answered(keyed, name, f"Bearer {SCOPED}", naming)
            error = {"message": f"model {name!r} does not exist", "type": "not_found_error", "code": "model_not_found"}
            assert refusal(reply) == (404, "application/json", {"error": error}), (naming, name)
            # Named by a header or a path, or by the served name in the body: Envoy's own refusal.
            native_name = naming != "body" or name == guard
            if guard == "nat-guard" and native_name:
                assert streams == 0, (naming, name)
    # A name that does not exist at all: the same 404.
    missing = chat(keyed, "nobody-here", f"Bearer {SCOPED}")
    assert missing.status == 404 and missing.json()["error"]["message"] == "model 'nobody-here' does not exist"


@pytest.mark.parametrize("naming", sorted(NAMINGS))
@pytest.mark.parametrize("guard", ["nat-guard", "dec-guard"])
def test_the_backend_never_sees_the_gateways_key(keyed: Gateway, guard: str, naming: str) -> None:
    # The guard's sim accepts exactly the gateway's wide key: it answers 401 itself when the key
    # was kept from it, and 200 when handed it straight.
    reply, streams = answered(keyed, guard, f"Bearer {WIDE}", naming)
    assert reply.status == 401, reply.text
    assert reply.json()["error"]["type"] == "AuthenticationError"  # the sim's own, not the gateway's
    assert (streams == 0) == (guard == "nat-guard")
    direct = request(
        "POST",
        f"http://{keyed.up.endpoints(guard)[0]}/v1/chat/completions",
        headers={"authorization": f"Bearer {WIDE}"},
        body={**CHAT, "model": guard},
    )
    assert direct.status == 200, direct.text


def status_on_both(gw: Gateway, key: str) -> set[int]:
    return {chat(gw, model, f"Bearer {key}").status for model in ("nat", "dec")}


def test_a_rotation_applies_to_both_paths_without_a_listener_change(keyed: Gateway) -> None:
    modified = keyed.stat(r"listener_manager\.listener_modified")
    reloads = keyed.stat(r"http\.wakegate\.rds\.wakegate_routes\.config_reload")
    keyed.keys.write_text(f"{ROTATED}\n{SCOPED}  nat, dec\n")
    try:
        wait_for(lambda: status_on_both(keyed, WIDE) == {401}, 5.0, "the old key refused on both paths")
        wait_for(lambda: status_on_both(keyed, ROTATED) == {200}, 5.0, "the new key accepted on both paths")
        # Natively: the new key went through Envoy alone.
        assert answered(keyed, "nat", f"Bearer {ROTATED}")[1] == 0
        assert keyed.stat(r"http\.wakegate\.rds\.wakegate_routes\.config_reload") > reloads
        assert keyed.stat(r"listener_manager\.listener_modified") == modified, "a rotation drained connections"
    finally:
        keyed.keys.write_text(KEYS_TEXT)
    wait_for(lambda: status_on_both(keyed, WIDE) == {200}, 5.0, "the wide key back on both paths")
    assert status_on_both(keyed, ROTATED) == {401}


def test_a_vanished_key_file_keeps_the_keys_on_both_paths(keyed: Gateway) -> None:
    feeder_log = keyed.up.state_dir / "logs" / "feeder.log"
    keyed.keys.unlink()
    try:
        wait_for(
            lambda: "keeping the previous 2 keys" in feeder_log.read_text(errors="replace"), 5.0, "the feeder's warning"
        )
        assert status_on_both(keyed, WIDE) == {200}
        assert status_on_both(keyed, "sk-native-wrong-key-000") == {401}
        assert keyed.paths() == PATHS
    finally:
        keyed.keys.write_text(KEYS_TEXT)
    warnings = [line for line in feeder_log.read_text(errors="replace").splitlines() if "keeping the previous" in line]
    assert len(warnings) == 1, warnings


def test_no_key_in_envoys_config_dump_or_any_log(keyed: Gateway) -> None:
    dump = request("GET", f"http://{keyed.envoy_admin}/config_dump").text
    assert "envoy.filters.http.api_key_auth" in dump and "allowed_clients" in dump  # the checks are there
    logs = [keyed.up.log()] + [p.read_text(errors="replace") for p in (keyed.up.state_dir / "logs").glob("*.log")]
    for key in (WIDE, SCOPED, ROTATED):
        assert key not in dump
        for text in logs:
            assert key not in text
    # Nor in the feeder's command line: it is given the file's path.
    assert keyed.up.child_arg("feeder", "--api-keys-file") == str(keyed.keys.resolve())
