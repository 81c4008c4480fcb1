"""One agent against a real `phalanx master`: logs shipped with ReportLogs, progress carried by heartbeats,
and a user error in a torch-elastic `@record` script reported with its error-file message."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.helpers import DDP, WORKLOAD

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[str, httpx.Client, Path]]:
    token = secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    log = (tmp_path / "master.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "master",
            "--job-id",
            "link",
            "--nodes",
            "1",
            "--port",
            "0",
            "--http-port",
            "0",
            "--token-file",
            str(token_file),
            "--state",
            str(tmp_path / "state.json"),
            "--heartbeat-timeout",
            "2s",
            "--max-restarts",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
    )
    log.close()  # the master holds its own descriptor
    assert proc.stdout is not None
    grpc_addr = proc.stdout.readline().decode().strip().split("=", 1)[1]
    http_addr = proc.stdout.readline().decode().strip().split("=", 1)[1]
    client = httpx.Client(base_url=f"http://{http_addr}", headers={"Authorization": f"Bearer {token}"})
    try:
        yield grpc_addr, client, token_file
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def agent(grpc_addr: str, token_file: Path, tmp: Path, *script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli.run",
            "--rdzv-endpoint",
            grpc_addr,
            "--rdzv-id",
            "link",
            "--node-id",
            "n0",
            "--token-file",
            str(token_file),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--log-dir",
            str(tmp / "logs"),
            *script,
        ],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
        cwd=tmp,
    )


def test_logs_and_progress_reach_the_master(master: tuple[str, httpx.Client, Path], tmp_path: Path) -> None:
    grpc_addr, http, token_file = master
    proc = agent(
        grpc_addr,
        token_file,
        tmp_path,
        "--no-warm-spares",
        str(WORKLOAD),
        "--dir",
        str(tmp_path / "d"),
        "--steps",
        "15",
        "--step-time",
        "0.2",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank0]:rank 0/2 starting at step 0" in proc.stdout
    job = http.get("/v1/job").json()
    assert job["phase"] == "Succeeded"
    assert job["max_step"] == 14  # from the beacons, through heartbeats
    lines = http.get("/v1/logs", params={"tail": 1000}).json()["lines"]
    assert {(line["rank"], line["text"]) for line in lines} >= {
        (0, "rank 0/2 starting at step 0"),
        (1, "rank 1/2 starting at step 0"),
    }
    # Beacons are removed when the agent exits.
    assert not list(Path("/dev/shm").glob("phalanx-link-n0-*.beacon"))


def test_user_error_reported_from_the_error_file(
    master: tuple[str, httpx.Client, Path], tmp_path: Path
) -> None:
    grpc_addr, http, token_file = master
    proc = agent(grpc_addr, token_file, tmp_path, str(DDP), "--steps", "20", "--fail-at", "2")
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    job = http.get("/v1/job").json()
    assert job["phase"] == "Failed", (proc.stdout + proc.stderr)[-3000:]
    assert "bad batch at step 2: loss is NaN" in job["reason"]
    # Failed at once: restarting cannot fix the same error on every rank. The agent's output tells why not.
    assert job["restart_count"] == 0, (proc.stdout + proc.stderr)[-3000:]
    # torch elastic's @record wrote the error file the agent read.
    assert "bad batch" in (tmp_path / "logs" / "round1" / "0" / "error.json").read_text()


def test_user_error_on_every_rank_fails_at_once_when_a_rank_is_slow_to_exit(
    master: tuple[str, httpx.Client, Path], tmp_path: Path
) -> None:
    """Rank 1 raises the same error but is still tearing down when the agent stops it: its error file
    still counts, so the job fails at once instead of spending restarts on a bug on every rank."""
    grpc_addr, http, token_file = master
    proc = agent(
        grpc_addr,
        token_file,
        tmp_path,
        str(WORKLOAD),
        "--dir",
        str(tmp_path / "d"),
        "--fail-at",
        "3",
        "--slow-exit-rank",
        "1",
        "--slow-exit-s",
        "20",
    )
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    job = http.get("/v1/job").json()
    assert job["phase"] == "Failed", (proc.stdout + proc.stderr)[-3000:]
    assert "user error on every rank" in job["reason"], job["reason"]
    assert "bad batch at step 3" in job["reason"]
    assert job["restart_count"] == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "worker failure: rank 0 exit 1, rank 1 exit -15" in proc.stderr, proc.stderr[-3000:]
