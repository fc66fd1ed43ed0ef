"""The console script: every command it offers is documented, shows its defaults, and nothing else is offered."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO_ROOT
from wakegate.cli import COMMANDS, command_parser, main


def test_the_readme_table_lists_exactly_the_commands() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("| command | what it does |") :].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `wakegate ([a-z-]+)", table, flags=re.MULTILINE)
    assert listed == list(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_parses_its_own_help(name: str) -> None:
    parser, module = command_parser(name)
    assert callable(module.main)
    assert "--log-level" in parser.format_help()


def test_up_help_shows_the_default_ports_and_state_dir() -> None:
    parser, _ = command_parser("up")
    help_text = parser.format_help()
    for default in ("127.0.0.1:8080", "127.0.0.1:8081", ".wakegate"):
        assert default in help_text


def test_unknown_commands_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["teleport"])
    assert exit_.value.code == 2
    assert "unknown command 'teleport'" in capsys.readouterr().err


@pytest.mark.parametrize("level", ["debug", "WARN", "Info"])
def test_log_level_is_one_spelling_in_any_case(level: str) -> None:
    parser, _ = command_parser("sim")
    assert parser.parse_args(["--log-level", level]).log_level in ("DEBUG", "WARNING", "INFO")
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])


def test_the_operators_help_names_every_kind_it_watches() -> None:
    import kopf
    import yaml

    from wakegate.control import crd
    from wakegate.control.k8s import names
    from wakegate.control.operator.watches import register

    registry = kopf.OperatorRegistry()
    register(registry, None)  # type: ignore[arg-type]
    plurals = {h.selector.any_name for h in registry._watching.get_all_handlers() if h.selector.group == names.GROUP}
    kinds = {
        doc["spec"]["names"]["plural"]: doc["spec"]["names"]["kind"]
        for doc in map(yaml.safe_load, crd.render().values())
    }
    watched = {kinds[plural] for plural in plurals}
    assert len(watched) == 5
    readme = (REPO_ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `wakegate operator` |"))
    for text in (COMMANDS["operator"][1], row):
        assert set(re.findall(r"\b[A-Z][A-Za-z]+\b", text)) >= watched, text


REGISTRY_COMMANDS = ("cache", "catalog", "flash-load", "up", "agent", "operator")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_renamed_flags_have_one_spelling_in_help(name: str) -> None:
    help_text = command_parser(name)[0].format_help()
    assert not re.search(r"--ca-file\b|(?<![-\w])--max-size\b", help_text)
    assert ("--registry-ca-file" in help_text) == (name in REGISTRY_COMMANDS)


@pytest.mark.parametrize(
    ("name", "old", "new", "dest", "tail"),
    [
        ("cache", ["--ca-file", "/ca.pem", "--max-size", "5G"],
         ["--registry-ca-file", "/ca.pem", "--cache-max-size", "5G"], ("ca_file", "max_size"), ["ls"]),
        ("flash-load", ["--ca-file", "/ca.pem", "--max-size", "5G"],
         ["--registry-ca-file", "/ca.pem", "--cache-max-size", "5G"], ("ca_file", "max_size"), ["/m.gguf"]),
        ("up", ["--ca-file", "/ca.pem"], ["--registry-ca-file", "/ca.pem"], ("ca_file",), []),
    ],
)
def test_an_old_spelling_still_sets_the_same_option(
    name: str, old: list[str], new: list[str], dest: tuple[str, ...], tail: list[str]
) -> None:
    parser, _ = command_parser(name)
    given, renamed, default = (parser.parse_args([*argv, *tail]) for argv in (old, new, []))
    assert [getattr(given, d) for d in dest] == [getattr(renamed, d) for d in dest]
    assert [getattr(default, d) for d in dest] == [None] * len(dest)
    assert str(given.ca_file) == "/ca.pem"
