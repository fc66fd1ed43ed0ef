"""The suite's own check (tests/support/leaks.py): a test that leaves a process running errors at
teardown and the process is killed; a wider fixture's processes may span its tests but must be
gone once that fixture is torn down."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import REPO_ROOT
from tests.support.up import pids_alive

CONFTEST = """
from tests.support import leaks

def pytest_configure(config):
    config.pluginmanager.register(leaks, leaks.__name__)
"""
INNER = """
import os, subprocess, sys
import pytest

PIDS = os.environ["LEAK_PIDS"]

def sleeper(name):
    proc = subprocess.Popen(["sleep", "300"])
    with open(PIDS, "a") as out:
        out.write(f"{name} {proc.pid}\\n")
    return proc

def stopped_at_teardown(name):
    proc = sleeper(name)
    yield proc
    proc.kill()
    proc.wait()

@pytest.fixture(scope="session")
def everywhere():
    yield from stopped_at_teardown("session")

@pytest.fixture(scope="module")
def shared():
    yield from stopped_at_teardown("shared")

@pytest.fixture(scope="module")
def forgotten():
    yield sleeper("forgotten")  # never stopped

def test_uses_shared_once(shared, everywhere):
    assert shared.poll() is None

def test_uses_shared_twice(shared):
    assert shared.poll() is None

def test_uses_the_session_fixture_again(everywhere):
    assert everywhere.poll() is None

def test_stops_its_own():
    proc = sleeper("own")
    proc.terminate()
    proc.wait()

def test_leaks_one():
    sleeper("leaked")

def test_fails_and_leaks():
    sleeper("failed")
    assert False, "the test's own failure"

def test_forgotten_by_its_fixture(forgotten):
    assert forgotten.poll() is None
"""


def test_a_process_that_outlives_its_test_is_killed_and_fails_the_test(tmp_path: Path) -> None:
    # below the root directory, as tests/conftest.py is: a session fixture's setup is announced
    # to the root's hooks, which a conftest down here does not get
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "inner" / "test_inner.py").write_text(textwrap.dedent(INNER))
    pids = tmp_path / "pids"
    env = dict(os.environ, LEAK_PIDS=str(pids), PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "proto")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rE", "--rootdir", str(tmp_path), "inner"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    started = {name: int(pid) for name, pid in (line.split() for line in pids.read_text().splitlines())}
    alive = pids_alive(list(started.values()))
    for pid in alive:  # what the check missed: not left behind by this test either
        os.kill(pid, signal.SIGKILL)
    assert alive == [], out.stdout
    errors = set(re.findall(r"ERROR inner/test_inner.py::(\w+)", out.stdout))
    assert errors == {"test_leaks_one", "test_fails_and_leaks", "test_forgotten_by_its_fixture"}, out.stdout
    assert f"pid {started['leaked']}: sleep 300" in out.stdout
    assert "1 failed, 6 passed, 3 errors" in out.stdout, out.stdout
