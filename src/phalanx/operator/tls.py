"""TLS for every job's master, issued by the operator (operator setting ``tls_ca_secret``).

The operator keeps one certificate authority in a Secret of its own namespace (made on first use, or
brought by the administrator, e.g. from cert-manager) and gives each job a Secret ``<job>-tls`` holding a
certificate for the job's master Service, signed by that CA, its key, and the CA's certificate:

* the master Pod mounts the certificate and key and serves gRPC and HTTP over TLS only;
* worker Pods mount the CA certificate alone and verify the master by its Service name;
* Prometheus verifies every master with the same CA certificate, by the name :data:`SCRAPE_NAME` that every
  master certificate carries besides its Service names (it scrapes Pod IPs, which no certificate issued
  before the Pod existed can name).

A job's certificate names its own Service only, so a job author who reads their job's Secret can pose as
their own master and no other. The CA's key never leaves the operator's namespace.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from phalanx.api import elasticjob

__all__ = ["SCRAPE_NAME", "Authority", "master_certificate", "master_dns_names", "new_authority"]

SCRAPE_NAME = "phalanx-master"
"""A DNS name in every master certificate: the server name Prometheus verifies (the chart's PodMonitor)."""
CA_VALIDITY = dt.timedelta(days=3650)
MASTER_VALIDITY = dt.timedelta(days=365)
"""A job's certificate. A job that outlives it gets a new one when its Secret is deleted."""
CA_CERT_KEY = "ca.crt"
CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"


@dataclass(frozen=True)
class Authority:
    """The CA that signs the masters' certificates (PEM)."""

    cert_pem: str
    key_pem: str


def new_authority(*, common_name: str, now: dt.datetime) -> Authority:
    """A fresh CA: an ECDSA P-256 key and a self-signed certificate that may sign server certificates
    only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # clocks of other machines may lag a little
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Authority(cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode())


def master_dns_names(job: str, namespace: str) -> list[str]:
    """The names a job's master answers to: its Service's, in every form a client may use, and
    :data:`SCRAPE_NAME`."""
    service = elasticjob.master(job)
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        SCRAPE_NAME,
    ]


def master_certificate(job: str, namespace: str, *, authority: Authority, now: dt.datetime) -> dict[str, str]:
    """The contents of the job's TLS Secret: ``tls.crt`` and ``tls.key`` for the master, ``ca.crt`` for
    everyone who talks to it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(authority.cert_pem.encode())
    ca_key = serialization.load_pem_private_key(authority.key_pem.encode(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an ECDSA key")  # the only kind new_authority makes
    key = ec.generate_private_key(ec.SECP256R1())
    names = master_dns_names(job, namespace)
    cert = (
        x509.CertificateBuilder()
        # The names are in the SAN; a common name may hold 64 characters, <job>-master.<ns>.svc often more.
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + MASTER_VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return {
        CA_CERT_KEY: authority.cert_pem,
        CERT_KEY: cert.public_bytes(serialization.Encoding.PEM).decode(),
        KEY_KEY: key_pem.decode(),
    }
