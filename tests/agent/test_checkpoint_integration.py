"""The agent-owned flash-checkpoint host, end to end with real processes: a SIGKILLed worker's restarted
ranks load from the host's shared memory (no storage read), the agent persists the last in-memory step
when workers fail (save at breakpoint) and the master learns the committed step, and no segment of the
job outlives the agent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from phalanx.checkpoint import storage as storage_lib
from tests.agent.helpers import DDP

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SHM = Path("/dev/shm")


def _job_leftovers(job_id: str) -> list[Path]:
    return [p for p in SHM.iterdir() if job_id in p.name]


def _committed_steps(storage: Path) -> list[int]:
    return storage_lib.committed_steps(storage_lib.open_storage(str(storage))) if storage.exists() else []


def _wait_for(path: Path, *, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if lines and lines[-1]["step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step} in {timeout_s}s")


def _agent(args: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli.run", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _end(proc: subprocess.Popen[str]) -> None:
    """Ends an agent a failed test left running; SIGTERM first, so it stops its standalone master."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_restarted_workers_load_from_agent_owned_memory(tmp_path: Path) -> None:
    job = f"flash-mem-{os.getpid()}"
    log = tmp_path / "steps.jsonl"
    pids = tmp_path / "pids"
    pids.mkdir()
    storage = tmp_path / "ckpt"
    proc = _agent(
        [
            "--standalone", "--rdzv-id", job, "--nproc-per-node", "2", "--max-restarts", "2",
            "--checkpoint-dir", str(storage), "--log-dir", str(tmp_path / "logs"),
            str(DDP), "--flash", "--persist-every", "1000", "--steps", "60", "--step-time", "0.05",
            "--step-log", str(log), "--pid-dir", str(pids),
        ],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_for(log, step=8, timeout_s=35)
        # The host was started by the agent and owns the segments.
        segments = [p for p in _job_leftovers(job) if p.name.startswith("phx-")]
        assert len(segments) == 4, segments  # two slots for each of the two ranks, owned by the host
        os.kill(int((pids / "rank1.pid").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=45)
    finally:
        _end(proc)
    assert proc.returncode == 0, out + err
    assert "flash-checkpoint host running" in err
    loads = re.findall(r"\[rank(\d)\]:flash: loaded step (\d+) from (\w+) \(storage reads (\d+)\)", out)
    assert sorted(r for r, *_ in loads) == ["0", "1"], out
    for _rank, step, source, reads in loads:
        assert source == "memory", loads
        assert reads == "0", loads
        assert int(step) >= 8
    # Nothing was persisted by the script (persist every 1000 steps); the save at breakpoint wrote the
    # failure's step, but the restarted ranks did not read it: storage reads 0 above.
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[-1] == 59
    assert sorted(set(steps)) == list(range(60))  # nothing skipped; at most the step in flight redone
    assert not _job_leftovers(job), _job_leftovers(job)


def test_save_at_breakpoint_persists_and_master_learns_it(tmp_path: Path) -> None:
    job = f"flash-bp-{os.getpid()}"
    token = tmp_path / "token"
    token.write_text("t0k3n-" + "x" * 20)
    token.chmod(0o600)
    master = subprocess.Popen(
        [
            sys.executable, "-m", "phalanx", "master", "--job-id", job, "--nodes", "1:1", "--port", "0",
            "--http-port", "0", "--token-file", str(token), "--state", str(tmp_path / "state.json"),
            "--max-restarts", "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    try:
        assert master.stdout is not None
        values = dict(master.stdout.readline().strip().split("=", 1) for _ in range(2))
        storage = tmp_path / "ckpt"
        log = tmp_path / "steps.jsonl"
        pids = tmp_path / "pids"
        pids.mkdir()
        proc = _agent(
            [
                "--rdzv-endpoint", values["PHALANX_MASTER_GRPC"], "--rdzv-id", job,
                "--token-file", str(token),
                "--nproc-per-node", "2", "--max-restarts", "0", "--checkpoint-dir", str(storage),
                str(DDP), "--flash", "--persist-every", "1000", "--steps", "400", "--step-time", "0.03",
                "--step-log", str(log), "--pid-dir", str(pids),
            ],
            cwd=tmp_path,
        )  # fmt: skip
        try:
            _wait_for(log, step=8, timeout_s=35)
            os.kill(int((pids / "rank0.pid").read_text()), signal.SIGKILL)
            failed_at = [json.loads(line) for line in log.read_text().splitlines()][-1]["step"]
            _, err = proc.communicate(timeout=40)
        finally:
            _end(proc)
        assert proc.returncode != 0, "the job cannot succeed with no restarts left"
        assert "save at breakpoint (worker failure): persisted" in err, err
        committed = _committed_steps(storage)
        assert committed, f"nothing committed under {storage}: {sorted(storage.rglob('*'))}"
        # Step 0 was persisted by the script; everything after came from the save at breakpoint.
        assert max(committed) >= failed_at - 1, (committed, failed_at)
        req = urllib.request.Request(
            f"http://{values['PHALANX_MASTER_HTTP']}/v1/job",
            headers={"Authorization": f"Bearer {token.read_text()}"},
        )
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(req, timeout=5) as resp:
                status = json.loads(resp.read())
            if status["committed_checkpoint_step"] == max(committed) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status["committed_checkpoint_step"] == max(committed), status
        assert not _job_leftovers(job), _job_leftovers(job)
    finally:
        master.terminate()
        master.wait(10)
        if master.stdout is not None:
            master.stdout.close()


def test_sigterm_to_the_agent_releases_the_nodes_memory(tmp_path: Path) -> None:
    job = f"flash-term-{os.getpid()}"
    log = tmp_path / "steps.jsonl"
    proc = _agent(
        [
            "--standalone", "--rdzv-id", job, "--nproc-per-node", "2", "--grace-period", "2",
            str(DDP), "--flash", "--steps", "1000", "--step-time", "0.05", "--step-log", str(log),
        ],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_for(log, step=3, timeout_s=35)
        segments = [p for p in _job_leftovers(job) if p.name.startswith("phx-")]
        assert len(segments) == 4, segments  # two slots for each of the two ranks, owned by the host
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        _end(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not _job_leftovers(job), _job_leftovers(job)
