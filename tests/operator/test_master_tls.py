"""TLS issued by the operator (setting ``tls_ca_secret``): the certificates it makes, where they go, and a
real master serving the issued certificate to the agent's real client and to a scraper."""

from __future__ import annotations

import datetime as dt
import signal
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from tests.master.procs import AUTH, TOKEN, Master

from phalanx.api import auth
from phalanx.api.settings import OperatorSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc
from phalanx.operator import builders, tls
from phalanx.operator.actions import Create, Observed
from phalanx.operator.reconcile import reconcile
from phalanx.operator.spec import parse_spec

NOW = dt.datetime.now(dt.UTC)
TLS = OperatorSettings(tls_ca_secret="phalanx-ca")


def _verify(pems: dict[str, str], name: str) -> None:
    leaf = x509.load_pem_x509_certificate(pems[tls.CERT_KEY].encode())
    store = Store([x509.load_pem_x509_certificate(pems[tls.CA_CERT_KEY].encode())])
    verifier = PolicyBuilder().store(store).time(NOW).build_server_verifier(x509.DNSName(name))
    verifier.verify(leaf, [])


def test_a_job_certificate_names_its_own_master_only() -> None:
    authority = tls.new_authority(common_name="test CA", now=NOW)
    pems = tls.master_certificate("tiny", "team-a", authority=authority, now=NOW)
    for name in ("tiny-master.team-a.svc", "tiny-master.team-a.svc.cluster.local", tls.SCRAPE_NAME):
        _verify(pems, name)
    for name in ("other-master.team-a.svc", "tiny-master.team-b.svc"):
        with pytest.raises(VerificationError):
            _verify(pems, name)
    assert authority.key_pem not in pems.values(), "the CA's key must never reach a job"
    # Names past a common name's 64 characters: a 40-character job in a 63-character namespace.
    job, namespace = "j" * 40, "n" * 63
    _verify(
        tls.master_certificate(job, namespace, authority=authority, now=NOW), f"{job}-master.{namespace}.svc"
    )
    other = tls.new_authority(common_name="another CA", now=NOW)
    forged = tls.master_certificate("tiny", "team-a", authority=other, now=NOW)
    with pytest.raises(VerificationError):
        _verify({**forged, tls.CA_CERT_KEY: authority.cert_pem}, "tiny-master.team-a.svc")


def _job() -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u1", "generation": 1},
        "spec": {
            "nodes": {"min": 1, "max": 1},
            "template": {
                "spec": {"containers": [{"name": "t", "image": "i", "command": ["python", "t.py"]}]}
            },
        },
        "status": {},
    }


def _mounted_keys(pod: dict[str, Any]) -> list[str]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "phalanx-tls"]
    return [item["key"] for item in volume["secret"]["items"]]


def test_the_master_gets_its_key_and_workers_the_ca_certificate_only() -> None:
    issued: list[int] = []

    def issue() -> dict[str, str]:
        issued.append(1)
        return {"ca.crt": "CA", "tls.crt": "CERT", "tls.key": "KEY"}

    observed = Observed(job=_job(), pods=[], existing=frozenset())
    actions = reconcile(observed, now=0.0, settings=TLS, new_token="t" * 20, issue_tls=issue)
    (secret,) = [a.obj for a in actions if isinstance(a, Create) and a.obj["metadata"]["name"] == "tiny-tls"]
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["stringData"] == {"ca.crt": "CA", "tls.crt": "CERT", "tls.key": "KEY"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u1"
    # Issued once, when the Secret is made; a pass that finds it issues nothing.
    existing = frozenset((a.obj["kind"], a.obj["metadata"]["name"]) for a in actions if isinstance(a, Create))
    reconcile(Observed(job=_job(), pods=[], existing=existing), now=1.0, settings=TLS, new_token="t" * 20,
              issue_tls=issue)  # fmt: skip
    assert len(issued) == 1

    spec = parse_spec(_job()["spec"])
    master = builders.master_pod(_job(), spec, settings=TLS)
    command = master["spec"]["containers"][0]["command"]
    assert command[command.index("--tls-cert-file") + 1] == "/var/run/phalanx/tls/tls.crt"
    assert command[command.index("--tls-key-file") + 1] == "/var/run/phalanx/tls/tls.key"
    # The CA certificate too: the liveness probe verifies the master by it.
    assert sorted(_mounted_keys(master)) == ["ca.crt", "tls.crt", "tls.key"]
    worker = builders.worker_pod(_job(), spec, slot=0, incarnation=0, settings=TLS)
    assert _mounted_keys(worker) == ["ca.crt"]
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env[auth.TLS_CA_ENV] == "/var/run/phalanx/tls/ca.crt"
    # TLS off: no Secret, no mount, no flag.
    plain = builders.master_pod(_job(), spec, settings=OperatorSettings())
    assert "--tls-cert-file" not in plain["spec"]["containers"][0]["command"]
    assert all(v["name"] != "phalanx-tls" for v in plain["spec"]["volumes"])


@pytest.mark.integration
def test_a_master_serves_the_issued_certificate_to_agents_and_scrapers(tmp_path: Path) -> None:
    authority = tls.new_authority(common_name="test CA", now=NOW)
    pems = tls.master_certificate("tiny", "team-a", authority=authority, now=NOW)
    for key, text in pems.items():
        (tmp_path / key).write_text(text)
    master = Master(
        tmp_path, "--nodes", "1:1", "--tls-cert-file", str(tmp_path / "tls.crt"),
        "--tls-key-file", str(tmp_path / "tls.key"),
    )  # fmt: skip
    try:
        grpc_port, http_port = master.ports
        # The agent's channel, as in a worker Pod: the CA from the mounted file, the master by its Service
        # name (resolved here to the loopback address the master listens on).
        override = [("grpc.ssl_target_name_override", "tiny-master.team-a.svc")]
        channel = auth.master_channel(
            f"127.0.0.1:{grpc_port}", ca_file=str(tmp_path / "ca.crt"), options=override
        )
        stub = pb_grpc.MasterStub(channel)
        request = pb.RegisterNodeRequest(
            job_id="test-job", node_id="n0", incarnation="i0", host="127.0.0.1", nproc_per_node=1
        )
        answer = stub.RegisterNode(request, metadata=AUTH, timeout=10)
        assert answer.heartbeat_interval_s > 0
        channel.close()
        # Another job's name is refused by the handshake, whatever the token.
        wrong = [("grpc.ssl_target_name_override", "other-master.team-a.svc")]
        channel = auth.master_channel(
            f"127.0.0.1:{grpc_port}", ca_file=str(tmp_path / "ca.crt"), options=wrong
        )
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.MasterStub(channel).RegisterNode(request, metadata=AUTH, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        # Prometheus: the same CA, the scrape name, HTTPS.
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with (
            socket.create_connection(("127.0.0.1", http_port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=tls.SCRAPE_NAME) as conn,
        ):
            conn.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            assert conn.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        master.stop(signal.SIGKILL)
