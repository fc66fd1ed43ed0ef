"""The prober's TLS material: what loads, and the one-line errors (never the material) for what does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.pki import PKI
from wakegate.control.federation.probe import ProbeFailed, TlsFiles, client_context


def test_a_ca_and_a_client_pair_load(tmp_path: Path) -> None:
    pki = PKI(tmp_path)
    pair = pki.issue("global", "global gateway")
    context = client_context(TlsFiles(pki.ca.cert, pair.cert, pair.key).read())
    assert context.check_hostname and len(context.get_ca_certs()) == 1


def test_bad_material_is_one_line_naming_the_file_not_its_contents(tmp_path: Path) -> None:
    pki = PKI(tmp_path)
    pair, other = pki.issue("a", "a"), pki.issue("b", "b")
    with pytest.raises(ProbeFailed, match=r"cannot read the CA file .*missing\.pem: No such file"):
        TlsFiles(tmp_path / "missing.pem").read()
    with pytest.raises(ProbeFailed, match="the CA is not a PEM certificate bundle") as refused:
        client_context(TlsFiles(pair.key).read())
    assert "PRIVATE" not in str(refused.value)
    with pytest.raises(ProbeFailed, match="client certificate and key do not load") as refused:
        client_context(TlsFiles(pki.ca.cert, pair.cert, other.key).read())
    assert "PRIVATE" not in str(refused.value) and "\n" not in str(refused.value)
