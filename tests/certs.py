"""Test certificates made at test time (`cryptography`, EC P-256): the cluster's CA and one certificate for
every role, valid for 127.0.0.1 and localhost; and a rogue CA with a certificate of its own, for peers
that must be refused."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: str  # the cluster's CA certificate
    cert: str  # every role's certificate and key, signed by `ca`
    key: str
    rogue_ca: str  # another CA, and a certificate (for the same names) signed by it
    rogue_cert: str
    rogue_key: str

    def flags(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path), str(key_path)


def _ca(directory: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    path, _ = _write(directory / f"{name}.pem", key, cert)
    return key, cert, path


def _leaf(
    directory: Path, name: str, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write(directory / f"{name}.pem", key, cert)


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, ca_path = _ca(directory, "cluster-ca")
    cert, key = _leaf(directory, "pdserve", ca_key, ca)
    rogue_key, rogue, rogue_path = _ca(directory, "rogue-ca")
    rogue_cert, rogue_leaf_key = _leaf(directory, "rogue", rogue_key, rogue)
    return Certs(ca_path, cert, key, rogue_path, rogue_cert, rogue_leaf_key)
