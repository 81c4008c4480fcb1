"""Per-run certificates and service-account keys, generated with the openssl command line tool."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClientCert:
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ec_key(path: Path) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path), cwd=path.parent)


def make_ca(directory: Path) -> tuple[Path, Path]:
    crt, key = directory / "ca.crt", directory / "ca.key"
    _ec_key(key)
    _openssl(
        "req", "-x509", "-new", "-key", str(key), "-out", str(crt), "-days", "2",
        "-subj", "/CN=phalanx-test-ca", cwd=directory,
    )  # fmt: skip
    return crt, key


def sign(directory: Path, *, name: str, subject: str, ext: str) -> ClientCert:
    """Creates ``<name>.key``/``<name>.crt`` signed by the CA in ``directory``."""
    key, csr, crt = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    extfile = directory / f"{name}.ext"
    extfile.write_text(ext + "\n")
    _ec_key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject, cwd=directory)
    _openssl(
        "x509", "-req", "-in", str(csr),
        "-CA", str(directory / "ca.crt"), "-CAkey", str(directory / "ca.key"),
        "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(extfile), cwd=directory,
    )  # fmt: skip
    return ClientCert(cert=crt, key=key)


def serving_cert(directory: Path, *, extra_ips: tuple[str, ...] = ()) -> ClientCert:
    ips = "".join(f"IP:{ip}," for ip in extra_ips)
    return sign(
        directory,
        name="apiserver",
        subject="/CN=kube-apiserver",
        ext=f"subjectAltName={ips}IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth",
    )


def client_cert(directory: Path, *, name: str, cn: str, org: str = "") -> ClientCert:
    subject = f"/CN={cn}" + (f"/O={org}" if org else "")
    return sign(directory, name=name, subject=subject, ext="extendedKeyUsage=clientAuth")


def service_account_keys(directory: Path) -> tuple[Path, Path]:
    key, pub = directory / "sa.key", directory / "sa.pub"
    _openssl("genrsa", "-out", str(key), "2048", cwd=directory)
    _openssl("rsa", "-in", str(key), "-pubout", "-out", str(pub), cwd=directory)
    return key, pub
