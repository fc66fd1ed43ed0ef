"""Fixtures for the e2e tests: one real cluster per session, one namespace per test.

    python -m pytest e2e                          # builds if needed, starts and stops a cluster
    python -m pytest e2e --keep                   # leave it running afterwards (prints its dir)
    python -m pytest e2e --cluster-dir DIR        # reuse the cluster running in DIR, or start one there
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import Cluster
from e2e.helpers import Kube, fresh_namespace

# kubectl keeps API discovery and OpenAPI schemas per server address under ~/.kube/cache for hours;
# harness API servers reuse loopback ports across runs, so a cache written for an older cluster (or
# older CRDs) could answer for this one. Every kubectl the tests start gets a cache of its own run.
os.environ.setdefault("KUBECACHEDIR", tempfile.mkdtemp(prefix="wg-e2e-kubectl-"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("e2e", "wakegate e2e harness")
    group.addoption(
        "--keep", action="store_true",
        help="leave the e2e cluster running after the session; stop it with "
        "`python -m e2e.cluster down --dir DIR`",
    )
    group.addoption(
        "--cluster-dir", default=None,
        help="reuse the cluster running in DIR (python -m e2e.cluster up --dir DIR), else start one there",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real node's module runs last: it changes this machine more than any other (containerd,
    a kubelet, cgroups, kernel tunables it sets back), so nothing else runs after it."""
    items.sort(key=lambda item: item.nodeid.startswith("e2e/test_real_node.py"))


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's cluster: `.kubeconfig`, `.dir`, `.api_client()`, `.pod_cidr`, `.network`."""
    keep = bool(request.config.getoption("--keep"))
    option = request.config.getoption("--cluster-dir")
    dir = Path(option).resolve() if option else tmp_path_factory.mktemp("cluster")
    if Cluster.running_in(dir):
        yield Cluster.attach(dir)
        return
    started = Cluster(dir, nodes=2, keep=keep)
    started.start()
    yield started
    if keep:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"e2e cluster left running: KUBECONFIG={started.kubeconfig}; "
                   f"stop it with `python -m e2e.cluster down --dir {started.dir}`")
        if reporter is not None:
            reporter.write_line(message)
        started.detach()
    else:
        started.stop()


@pytest.fixture
def kube(cluster: Cluster) -> Iterator[Kube]:
    """A fresh namespace per test; deleting it (real namespace controller) ends its pods."""
    with fresh_namespace(cluster) as kube:
        yield kube
