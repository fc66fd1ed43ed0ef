"""The federation's kinds: what a file or a CRD accepts, and the columns kubectl shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from wakegate.control import crd
from wakegate.control.federation_schema import PlacementMode, parse_federation
from wakegate.control.manifests import ManifestError

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "federation" / "global.yaml").read_text()


def test_the_example_federation_parses() -> None:
    federation = parse_federation(EXAMPLE, "federation.yaml")
    assert [c.name for c in federation.clusters] == ["east", "west"]
    (model,) = federation.models
    assert model.spec.template.servedName == "org/chat-small-1b"
    assert model.spec.placement.mode is PlacementMode.SPREAD and model.spec.placement.failover == ["east", "west"]
    assert federation.proxy.spec.listeners[0].port == 8070
    assert federation.proxy.spec.healthCheck.intervalSeconds == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('url: "http://127.0.0.1:8080"', 'url: "ftp://127.0.0.1"'), "spec.gateway.url"),
        (("failover: [east, west]", "failover: [east, north]"), "no Cluster 'north'"),
        (("    min: 0\n    max: 1", "    min: 2\n    max: 1"), "min (2) exceeds max (1)"),
        (("clusterSelector: {tier: gpu}", "clusterSelector: {}"), "name clusters or a clusterSelector"),
        (("mode: spread", "mode: random"), "spec.placement.mode"),
        (("timeoutSeconds: 0.5", "timeoutSeconds: 5"), "timeoutSeconds exceeds intervalSeconds"),
        (("metadata: {name: west,", "metadata: {name: east,"), "a Cluster named 'east' is already defined"),
        (("kind: GlobalProxy", "kind: GlobalProxi"), "kind must be one of Cluster, FederatedModel, GlobalProxy"),
        (
            (
                "weight: 100\n---\napiVersion: wakegate.io/v1alpha1\nkind: FederatedModel",
                "weight: 0\n---\napiVersion: wakegate.io/v1alpha1\nkind: FederatedModel",
            ),
            "spec.weight",
        ),
    ],
)
def test_bad_federation_documents_are_refused_naming_the_document(change: tuple[str, str], message: str) -> None:
    assert change[0] in EXAMPLE
    with pytest.raises(ManifestError, match=r"f\.yaml") as refused:
        parse_federation(EXAMPLE.replace(*change, 1), "f.yaml")
    assert message in str(refused.value)


def test_a_member_token_is_named_once() -> None:
    text = EXAMPLE.replace(
        '{url: "http://127.0.0.1:8080"}',
        '{url: "http://127.0.0.1:8080", tokenFile: /t, token: {namespace: a, name: b, key: c}}',
    )
    with pytest.raises(ManifestError, match="name the token once"):
        parse_federation(text, "f.yaml")


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ('url: "https://127.0.0.1:8443"', "an https:// gateway needs the CA"),
        ('url: "http://127.0.0.1:8080", caFile: ca.pem', "caFile: only for an https:// gateway url"),
        ('url: "http://127.0.0.1:8080", serverName: east.example', "serverName: only for an https://"),
        ('url: "https://127.0.0.1:8443", caFile: a, ca: {namespace: a, name: b, key: c}', "name the CA once"),
        ('url: "https://127.0.0.1:8443", caFile: a, clientCertFile: c', "clientCertFile and clientKeyFile go together"),
        (
            'url: "https://127.0.0.1:8443", caFile: a, clientKeyFile: k, clientCert: {namespace: a, name: b, key: c}',
            "name the client certificate once",
        ),
        ('url: "https://127.0.0.1:8443", caFile: a, serverName: "-bad.example"', "spec.gateway.serverName"),
    ],
)
def test_member_tls_is_named_once_and_only_for_https(gateway: str, message: str) -> None:
    text = EXAMPLE.replace('{url: "http://127.0.0.1:8080"}', "{" + gateway + "}")
    with pytest.raises(ManifestError, match=r"f\.yaml") as refused:
        parse_federation(text, "f.yaml")
    assert message in str(refused.value)


def test_an_https_member_with_its_ca_and_client_certificate_parses() -> None:
    text = EXAMPLE.replace(
        '{url: "http://127.0.0.1:8080"}',
        '{url: "https://127.0.0.1:8443", caFile: ca.pem, clientCertFile: c.pem, clientKeyFile: k.pem, '
        "serverName: east.example}",
    )
    gateway = parse_federation(text, "f.yaml").clusters[0].spec.gateway
    assert (gateway.caFile, gateway.clientCertFile, gateway.clientKeyFile) == ("ca.pem", "c.pem", "k.pem")
    assert gateway.serverName == "east.example"


def test_kubectl_columns_show_reachability_and_per_cluster_readiness() -> None:
    def columns(generated: dict) -> dict[str, str]:
        version = generated["spec"]["versions"][0]
        return {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}

    clusters = crd.cluster_crd()
    assert clusters["spec"]["scope"] == "Cluster" and clusters["spec"]["names"]["plural"] == "clusters"
    assert columns(clusters)["Reachable"] == ".status.reachable"
    assert columns(clusters)["Latency(ms)"] == ".status.latencyMs"
    federated = crd.federatedmodel_crd()
    assert federated["spec"]["names"]["plural"] == "federatedmodels"
    assert columns(federated)["Clusters"] == ".status.summary"
    assert columns(federated)["Ready"] == ".status.readyClusters"
    assert crd.globalproxy_crd()["spec"]["names"]["plural"] == "globalproxies"
    template = federated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert template["template"]["required"] == ["backend"]


def test_the_federation_crds_are_structural() -> None:
    """What the API server refuses in a structural schema (it names `propertyNames` and friends)."""

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            assert not {"$ref", "anyOf", "propertyNames", "title", "$defs"} & set(node), path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    for generated in (crd.cluster_crd(), crd.federatedmodel_crd(), crd.globalproxy_crd()):
        walk(generated["spec"]["versions"][0]["schema"], generated["metadata"]["name"])
