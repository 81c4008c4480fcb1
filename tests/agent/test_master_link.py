"""One agent against a real `phalanx master`: logs shipped with ReportLogs, progress carried by heartbeats,
a user error in a torch-elastic `@record` script reported with its error-file message, and a failure report
far above the master's request limit cut to it, so its root cause arrives."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from phalanx.agent import failures
from phalanx.agent.client import MasterClient
from phalanx.agent.pool import worker_shm_dir
from phalanx.api.errors import TransportError
from phalanx.api.v1 import master_pb2 as pb
from tests.agent.helpers import DDP, WORKLOAD

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[str, httpx.Client, Path]]:
    with start_master(tmp_path) as started:
        yield started


@contextlib.contextmanager
def start_master(tmp_path: Path, *extra: str) -> Iterator[tuple[str, httpx.Client, Path]]:
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
            *extra,
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
    # Beacons and rings lived in this user's private folder, never at a name in /dev/shm itself, and are
    # removed when the agent exits.
    assert not list(worker_shm_dir().glob("phalanx-link-n0-*"))
    assert not list(Path("/dev/shm").glob("phalanx-link-n0-*"))


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


HUGE_ERROR = """
import json, os, sys, time
message = "RuntimeError: the root cause of it all\\nits second line\\n" + "m" * 500_000
stack = "Traceback (most recent call last):\\n" + '  File "train.py", line 9, in step\\n' * 20_000
error = {"message": {"message": message, "extraInfo": {
    "py_callstack": stack + "RuntimeError: the root cause of it all", "timestamp": str(time.time())}}}
for i in range(30):
    print(f"noise {i} " + "n" * 8000, file=sys.stderr)
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(error, f)
sys.exit(1)
"""


def test_a_report_far_above_the_masters_limit_arrives_cut_with_its_root_cause(tmp_path: Path) -> None:
    """Each rank's report is megabytes and the master takes 64 KiB requests: the agent cuts the report to
    the master's limits, is refused, cuts it shorter, and the master records the root cause."""
    script = tmp_path / "huge_error.py"
    script.write_text(HUGE_ERROR)
    with start_master(tmp_path, "--max-request-bytes", "65536") as (grpc_addr, http, token_file):
        proc = agent(grpc_addr, token_file, tmp_path, "--no-warm-spares", "--no-checkpoint-host", str(script))
        out = "\n".join(line[:300] for line in (proc.stdout + proc.stderr).splitlines()[-40:])
        job = http.get("/v1/job").json()
    assert job["phase"] == "Failed", out
    assert "sending it cut shorter" in proc.stderr, out
    root = job["root_cause"]
    assert root["message"].startswith("RuntimeError: the root cause of it all\nits second line\n"), out
    assert root["traceback"].startswith("Traceback (most recent call last):")
    assert root["traceback"].endswith("RuntimeError: the root cause of it all")
    assert "the root cause of it all" in job["reason"]


def test_stack_dumps_above_the_masters_limit_arrive_cut(
    master: tuple[str, httpx.Client, Path], tmp_path: Path
) -> None:
    """Four ranks of 0.4 MB stacks each: over the master's 1 MiB for one report, which it refuses whole
    (INVALID_ARGUMENT); cut by the agent to equal shares, the report is taken."""
    grpc_addr, _, token_file = master
    client = MasterClient(address=grpc_addr, token=token_file.read_text())
    try:
        ids = {"node_id": "n0", "incarnation": "i0"}
        client.register(pb.RegisterNodeRequest(job_id="link", nproc_per_node=4, **ids))
        stacks = "  frame\n" * 50_000
        ranks = [pb.RankStacks(rank=r, stacks=f"Thread {r} (main)\n{stacks}") for r in range(4)]
        request = pb.ReportStacksRequest(round=0, ranks=ranks, **ids)
        with pytest.raises(TransportError, match="stacks exceed"):
            client.report_stacks(request)  # what the agent sent before
        failures.send_fitted(client.report_stacks, request, failures.fit_stacks_report, what="report stacks")
    finally:
        client.close()
