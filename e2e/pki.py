"""Certificates and kubeconfigs for a throwaway cluster on 127.0.0.1.

EC P-256 everywhere: key generation is instant, and kube-apiserver accepts an
ECDSA service-account signing key (tokens are signed ES256).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: long enough for a cluster kept with --keep over a few days of debugging
VALIDITY = dt.timedelta(days=30)

#: DNS names and IPs the apiserver's serving cert must cover; 10.96.0.1 is the
#: `kubernetes` Service IP allocated from --service-cluster-ip-range.
SERVING_DNS = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
SERVING_IPS = ("127.0.0.1", "10.96.0.1")


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


class PKI:
    """A CA plus the leaf certs one cluster needs, written under `dir`."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("wakegate-e2e-ca"))
            .issuer_name(_name("wakegate-e2e-ca"))
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca = Pair(dir / "ca.crt", dir / "ca.key")
        self.ca.cert.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))
        self.ca.key.write_bytes(_key_pem(self._ca_key))
        self.ca.key.chmod(0o600)

    @classmethod
    def load(cls, dir: Path) -> PKI:
        """The CA a cluster already made in `dir` (to issue more leaves for it, e.g. a kubelet's)."""
        pki = cls.__new__(cls)
        pki.dir = dir
        pki.ca = Pair(dir / "ca.crt", dir / "ca.key")
        pki._ca_cert = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
        key = serialization.load_pem_private_key(pki.ca.key.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        pki._ca_key = key
        return pki

    def issue(
        self,
        stem: str,
        cn: str,
        org: str | None = None,
        server: bool = False,
        extra_sans: Sequence[str] = (),
        client: bool = False,
    ) -> Pair:
        """A certificate signed by the CA: client auth, or server auth (the apiserver's names plus
        `extra_sans`, DNS names or IPs) and also client auth when `client` (KEDA's services use one
        pair both ways)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, org))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
                    if server
                    else [ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVING_DNS]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVING_IPS]
            for name in extra_sans:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(name)))
                except ValueError:
                    sans.append(x509.DNSName(name))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        pair = Pair(self.dir / f"{stem}.crt", self.dir / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_key_pem(key))
        pair.key.chmod(0o600)
        return pair

    def service_account_keys(self) -> Pair:
        """Signing key (sa.key) and its public half (sa.pub) for service-account tokens."""
        key = ec.generate_private_key(ec.SECP256R1())
        pair = Pair(self.dir / "sa.pub", self.dir / "sa.key")
        pair.key.write_bytes(_key_pem(key))
        pair.key.chmod(0o600)
        pair.cert.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return pair

    def kubeconfig(self, path: Path, server: str, client: Pair, user: str) -> Path:
        """A self-contained kubeconfig (certs embedded) so it can be copied anywhere."""

        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": server, "certificate-authority-data": b64(self.ca.cert)},
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {"client-certificate-data": b64(client.cert), "client-key-data": b64(client.key)},
                }
            ],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
            "current-context": "e2e",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path
