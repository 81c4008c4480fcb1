"""TLS on the master's gRPC and HTTP servers, with a CA made by the test: the agent's client trusts the master
only through the CA it is given, plain-text clients get nowhere, and TLS stays off unless asked for."""

from __future__ import annotations

import datetime
import ipaddress
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from phalanx.agent.client import MasterClient, MasterUnavailableError
from phalanx.api.errors import ConfigError
from phalanx.api.settings import MasterSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.checkpoint.report import MasterReporter
from phalanx.master.serve.server import TLS_HANDSHAKE_TIMEOUT_S

from .procs import TOKEN, Master

pytestmark = pytest.mark.integration


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(directory: Path, name: str) -> tuple[Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def make_server_cert(
    directory: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("phalanx-master"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "master.crt", directory / "master.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Master, Path, Path]]:
    tmp = tmp_path_factory.mktemp("tls")
    ca_path, ca, ca_key = make_ca(tmp, "job-ca")
    other_ca_path, _, _ = make_ca(tmp, "another-ca")
    cert, key = make_server_cert(tmp, ca, ca_key)
    m = Master(tmp, "--nodes", "1", "--tls-cert-file", str(cert), "--tls-key-file", str(key))
    yield m, ca_path, other_ca_path
    m.stop(signal.SIGKILL)


def register(client: MasterClient, node: str) -> pb.RegisterNodeResponse:
    req = pb.RegisterNodeRequest(job_id="test-job", node_id=node, incarnation=f"{node}-1", nproc_per_node=1)
    return client.register(req, timeout=5)


def test_the_agent_reaches_a_tls_master_through_the_ca_it_is_given(
    tls_master: tuple[Master, Path, Path],
) -> None:
    master, ca, _ = tls_master
    client = MasterClient(address=master.grpc, token=TOKEN, ca_file=str(ca))
    try:
        assert register(client, "node-0").heartbeat_timeout_s > 0
    finally:
        client.close()


def test_the_ca_comes_from_the_agents_environment(
    tls_master: tuple[Master, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, ca, _ = tls_master
    monkeypatch.setenv("PHALANX_TLS_CA_FILE", str(ca))
    client = MasterClient(address=master.grpc, token=TOKEN)
    try:
        assert register(client, "node-1").heartbeat_timeout_s > 0
    finally:
        client.close()


@pytest.mark.parametrize("trust", ["none", "another CA"])
def test_a_client_that_cannot_verify_the_master_gets_nowhere(
    tls_master: tuple[Master, Path, Path], trust: str
) -> None:
    master, _, other_ca = tls_master
    client = MasterClient(address=master.grpc, token=TOKEN, ca_file="" if trust == "none" else str(other_ca))
    try:
        with pytest.raises(MasterUnavailableError):
            register(client, "node-x")
    finally:
        client.close()


def test_the_checkpoint_host_reports_to_a_tls_master_through_the_agents_ca(
    tls_master: tuple[Master, Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The checkpoint host inherits the agent's environment: its reports reach the master over TLS too, or a
    job with TLS on would never see a checkpoint committed."""
    master, ca, _ = tls_master
    client = MasterClient(address=master.grpc, token=TOKEN, ca_file=str(ca))
    try:
        register(client, "node-ckpt")
    finally:
        client.close()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    monkeypatch.setenv("PHALANX_TLS_CA_FILE", str(ca))
    reporter = MasterReporter(
        addr=master.grpc, token_file=str(token_file), node_id="node-ckpt", incarnation="node-ckpt-1"
    )
    reporter.report(step=7, ranks=[0], world_size=1, error="no space left on device")
    reporter.close(timeout_s=10)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), headers=headers) as http:
        events = http.get(f"https://{master.http}/v1/events").json()["events"]
    assert any("no space left on device" in json.dumps(e) for e in events), events


def test_http_is_served_over_tls_only(tls_master: tuple[Master, Path, Path]) -> None:
    master, ca, other_ca = tls_master
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), headers=headers) as client:
        assert client.get(f"https://{master.http}/healthz").json()["status"] == "ok"
        assert client.get(f"https://{master.http}/v1/job").status_code == 200
    untrusting = ssl.create_default_context(cafile=str(other_ca))
    with httpx.Client(verify=untrusting) as client, pytest.raises(httpx.ConnectError):
        client.get(f"https://{master.http}/healthz", headers=headers)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{master.http}/healthz", headers=headers, timeout=5)


def test_tls_needs_both_files_and_is_off_by_default(tmp_path: Path) -> None:
    assert MasterSettings(job_id="j").tls_cert_file == ""
    with pytest.raises(ConfigError, match=r"^tls_key_file: "):
        MasterSettings(job_id="j", tls_cert_file=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"^PHALANX_TLS_CA_FILE: cannot read"):
        MasterClient(address="127.0.0.1:1", token=TOKEN, ca_file=str(tmp_path / "missing.pem"))


def _livez(master: Master, token_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The master Pod's exec liveness probe, as the kubelet runs it."""
    _, port = master.ports
    command = [sys.executable, "-m", "phalanx.master.livez", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.run(
        [*command, "--token-file", str(token_file), "--timeout-s", "3", *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_the_liveness_probe_passes_with_the_token_and_ca_and_fails_for_a_stopped_master(
    tls_master: tuple[Master, Path, Path], tmp_path: Path
) -> None:
    master, ca, other_ca = tls_master
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text(TOKEN + "\n")
    wrong.write_text("not-the-job-token-at-all\n")
    verified = ("--ca-file", str(ca), "--server-name", "localhost")
    ok = _livez(master, token, *verified)
    assert ok.returncode == 0, ok.stderr
    refused = _livez(master, wrong, *verified)
    assert refused.returncode == 1
    assert "answered /healthz with HTTP/1.1 401" in refused.stderr, refused.stderr
    untrusted = _livez(master, token, "--ca-file", str(other_ca), "--server-name", "localhost")
    assert untrusted.returncode == 1
    assert "did not answer" in untrusted.stderr, untrusted.stderr
    master.proc.send_signal(signal.SIGSTOP)  # a hung master: its socket still accepts, nothing answers
    try:
        hung = _livez(master, token, *verified)
    finally:
        master.proc.send_signal(signal.SIGCONT)
    assert hung.returncode == 1
    assert "did not answer" in hung.stderr, hung.stderr
    assert _livez(master, token, *verified).returncode == 0, "answers again once continued"


def test_connections_that_never_start_tls_are_closed_after_the_handshake_timeout(
    tls_master: tuple[Master, Path, Path],
) -> None:
    """200 connections to the HTTP port that never send a ClientHello: the master keeps serving, and closes
    each once TLS_HANDSHAKE_TIMEOUT_S is out (asyncio's own default, 60 s, would hold them past the wait)."""
    master, ca, _ = tls_master
    _, port = master.ports
    opened = time.monotonic()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    try:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), headers=headers) as client:
            assert client.get(f"https://{master.http}/healthz").status_code == 200
        deadline = opened + TLS_HANDSHAKE_TIMEOUT_S + 15
        closed = 0
        for conn in silent:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += conn.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        still_open = len(silent) - closed
        assert not still_open, f"{still_open} still open {time.monotonic() - opened:.0f} s on"
    finally:
        for conn in silent:
            conn.close()
