"""Certificates for TLS tests, made with the cryptography package.

    files = make_pki(tmp_path)
    files["ca"], files["stranger"]            # CA certificates (PEM paths)
    key, cert = files["server"]               # for 127.0.0.1, signed by "ca"
    key, cert = files["client"]               # a client certificate signed by "ca"
    key, cert = files["impostor"]             # a client certificate signed by "stranger"
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["make_pki"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject, key, issuer, issuer_key, is_ca=False, ip=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject))
               .issuer_name(_name(issuer)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None),
                              critical=True))
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, key=None, cert=None) -> str:
    if key is not None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    else:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def make_pki(directory: Path) -> dict:
    """Two CAs and three certificates under `directory` (see the module docstring)."""
    cas = {}
    for ca in ("ca", "stranger"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(ca, key, ca, key, is_ca=True)
        cas[ca] = (key, _write(directory / f"{ca}.pem", cert=cert))
    files: dict = {ca: path for ca, (_, path) in cas.items()}
    for name, issuer, ip in (("server", "ca", "127.0.0.1"), ("client", "ca", None),
                             ("impostor", "stranger", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(name, key, issuer, cas[issuer][0], ip=ip)
        files[name] = (_write(directory / f"{name}.key", key=key),
                       _write(directory / f"{name}.pem", cert=cert))
    return files
