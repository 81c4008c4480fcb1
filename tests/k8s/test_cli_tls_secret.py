"""``phalanx status`` / ``phalanx timeline`` with ``--job`` against a job whose master serves TLS: the CA
comes from the job's Secret ``<job>-tls`` (as the operator writes it, by ``phalanx.operator.tls``), the URL
becomes https and the name checked is ``<job>-master``, on the real control plane and a real TLS master
process."""

from __future__ import annotations

import datetime as dt
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_harness.controlplane import ControlPlane
from tests.master.procs import TOKEN, Master

from phalanx.cli.main import main
from phalanx.operator.tls import master_certificate, new_authority

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

JOB, NS = "tls-cli", "cli-tls"


@pytest.fixture(scope="module")
def tls_job(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    cp, tmp = control_plane, tmp_path_factory.mktemp("tls-cli")
    now = dt.datetime.now(dt.UTC)
    secret = master_certificate(JOB, NS, authority=new_authority(common_name="ops-ca", now=now), now=now)
    (tmp / "tls.crt").write_text(secret["tls.crt"])
    (tmp / "tls.key").write_text(secret["tls.key"])
    (tmp / "tls.key").chmod(0o600)
    master = Master(
        tmp, "--nodes", "1", "--tls-cert-file", str(tmp / "tls.crt"), "--tls-key-file", str(tmp / "tls.key")
    )
    cp.kubectl("create", "namespace", NS)
    objects = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{JOB}-token"},
            "stringData": {"token": TOKEN},
        },
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{JOB}-tls"}, "stringData": secret},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{JOB}-master"},
            "spec": {"ports": [{"name": "http", "port": 8080}], "selector": {"phalanx.dev/job": JOB}},
        },
    ]
    items = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    cp.kubectl("apply", "-n", NS, "-f", "-", input_text=items)
    try:
        yield {"master": master, "kubeconfig": str(cp.kubeconfig), "tmp": tmp}
    finally:
        master.stop(signal.SIGKILL)
        cp.kubectl("delete", "namespace", NS, "--wait=false")


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_ca_and_the_name_come_from_the_jobs_secret(
    tls_job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PHALANX_TLS_CA_FILE", raising=False)
    kube = ["-n", NS, "--kubeconfig", tls_job["kubeconfig"]]
    # A port-forward's address: no scheme, 127.0.0.1, which the certificate does not name.
    address = tls_job["master"].http
    code, out, err = _main(capsys, "status", JOB, *kube, "--master", address, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["job"]["name"] == "test-job"
    out_prefix = Path(tls_job["tmp"]) / "tl"
    code, out, err = _main(
        capsys, "timeline", "--job", JOB, *kube, "--master", address, "--no-png", "-o", str(out_prefix)
    )
    assert code == 0, err
    # Without --master, the Service's in-cluster https address; from here the hint says how to forward it.
    code, _, err = _main(capsys, "timeline", "--job", JOB, *kube, "--timeout", "3", "--no-png")
    assert code == 1
    assert f"https://{JOB}-master.{NS}.svc:8080" in err, err
    assert "--master https://127.0.0.1:8080" in err, err
