"""``phalanx status`` and ``phalanx timeline`` against a real master that serves HTTPS with a certificate the
operator's own code issues (``phalanx.operator.tls``) for a job: the CLI verifies it against the job's CA and
the name it carries, and says what to do when either does not match."""

from __future__ import annotations

import datetime as dt
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx.operator.tls import master_certificate, new_authority
from tests.master.procs import TOKEN, Master

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cli-tls")
    now = dt.datetime.now(dt.UTC)
    authority = new_authority(common_name="phalanx-jobs", now=now)
    secret = master_certificate("demo", "team-a", authority=authority, now=now)
    (tmp / "ca.crt").write_text(secret["ca.crt"])
    (tmp / "tls.crt").write_text(secret["tls.crt"])
    (tmp / "tls.key").write_text(secret["tls.key"])
    (tmp / "tls.key").chmod(0o600)
    (tmp / "other-ca.crt").write_text(new_authority(common_name="someone-else", now=now).cert_pem)
    master = Master(
        tmp, "--nodes", "1", "--tls-cert-file", str(tmp / "tls.crt"), "--tls-key-file", str(tmp / "tls.key")
    )
    try:
        yield {"master": master, "tmp": tmp, "address": master.http}
    finally:
        master.stop(signal.SIGKILL)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from phalanx.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_status_verifies_the_master_against_the_jobs_ca_and_service_name(
    tls_job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, address = tls_job["tmp"], tls_job["address"]
    monkeypatch.delenv("PHALANX_TLS_CA_FILE", raising=False)
    code, out, err = _main(
        capsys,
        "status",
        "--master",
        f"https://{address}",
        "--token-file",
        str(tmp / "token"),
        "--ca-file",
        str(tmp / "ca.crt"),
        "--server-name",
        "demo-master",
        "-o",
        "json",
    )
    assert code == 0, err
    assert json.loads(out)["job"]["name"] == "test-job"


def test_timeline_takes_the_ca_from_the_environment_and_an_address_without_scheme(
    tls_job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, address = tls_job["tmp"], tls_job["address"]
    monkeypatch.setenv("PHALANX_TLS_CA_FILE", str(tmp / "ca.crt"))
    out_prefix = tmp / "tl"
    code, _, err = _main(
        capsys,
        "timeline",
        "--master",
        address,  # no scheme: https, because a CA is given
        "--token-file",
        str(tmp / "token"),
        "--server-name",
        "phalanx-master",  # every operator-issued certificate carries it
        "--no-png",
        "-o",
        str(out_prefix),
    )
    assert code == 0, err
    assert "traceEvents" in json.loads((tmp / "tl.json").read_text())


def _status_error(capsys: pytest.CaptureFixture[str], tmp: Path, url: str, *extra: str) -> str:
    code, out, err = _main(capsys, "status", "--master", url, "--token-file", str(tmp / "token"), *extra)
    assert code == 1, out
    assert TOKEN not in err  # the token never shows
    return err


def test_a_wrong_ca_a_wrong_name_and_plain_http_each_fail_with_what_to_do(
    tls_job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, address = tls_job["tmp"], tls_job["address"]
    monkeypatch.delenv("PHALANX_TLS_CA_FILE", raising=False)
    url = f"https://{address}"
    err = _status_error(
        capsys, tmp, url, "--ca-file", str(tmp / "other-ca.crt"), "--server-name", "demo-master"
    )
    assert "not signed by" in err, err
    assert "other-ca.crt" in err, err
    assert "--ca-file" in err, err
    err = _status_error(capsys, tmp, url, "--ca-file", str(tmp / "ca.crt"))  # 127.0.0.1 is not in the cert
    assert "does not name 127.0.0.1" in err, err
    assert "--server-name" in err, err
    err = _status_error(capsys, tmp, url, "--server-name", "demo-master")  # no CA: the system's refuse it
    assert "not signed by the system's CAs" in err, err
    err = _status_error(capsys, tmp, f"http://{address}")
    assert "answers HTTPS only" in err, err
    err = _status_error(capsys, tmp, url, "--ca-file", str(tmp / "missing.pem"))
    assert "cannot read" in err, err
    assert "missing.pem" in err, err
