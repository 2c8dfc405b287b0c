"""What authenticates a deployment: a throw-away CA and server certificate for TLS
(:func:`make_certificates`), a site's EC key pair for Flower's SuperNode authentication
(:func:`make_site_key`, :func:`site_key_path`), and :func:`require_file`, which turns a missing
certificate or key into a :class:`DeploymentError` naming the fix."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from fedst.deploy.processes import DeploymentError


def make_certificates(out: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> Path:
    """A throw-away CA (``ca.crt``) and a server certificate for ``hosts`` (``server.pem``,
    ``server.key``). For a real trial, a certificate from the hospital's own CA is preferable."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedST CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(out / "server.key", 0o600)
    return out


def site_key_path(keys: Path, site: str) -> Path:
    """A site's private key; its public key is the same path with ``.pub``."""
    return keys / f"{site}_key"


def make_site_key(keys: Path, site: str) -> Path:
    """An EC (NIST P-384) key pair in OpenSSH format, as Flower's SuperNode authentication wants.
    The hospital keeps ``<site>_key``; the server's admin gets ``<site>_key.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    path = site_key_path(keys, site)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, 0o600)
    path.with_suffix(".pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + f" fedst-site-{site}\n".encode()
    )
    return path


def require_file(path: Path, what: str, fix: str) -> Path:
    if not path.is_file():
        raise DeploymentError(f"{what} {path} is missing: {fix}")
    return path.resolve()
