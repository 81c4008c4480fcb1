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
from typing import Any

import pytest

from phalanx.checkpoint import shm
from phalanx.checkpoint import storage as storage_lib
from tests.agent.helpers import DDP, master_process, phalanx_local
from tests.conftest import aws_env, environment, minio_server
from tests.eventually import eventually

# 150 s: a test here waits up to 35 s for training and 90 s for the job's end; a loaded machine (make test's
# two lanes) has taken over 60 s for the whole (restart in place included).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SHM = Path("/dev/shm")
STRADDLE = Path(__file__).with_name("straddle_worker.py")


def _job_leftovers(job_id: str) -> list[Path]:
    """The job's files in /dev/shm: beacons at its root, slots in the user's directory there."""
    private = shm.private_dir(SHM)
    mine = list(private.iterdir()) if private.is_dir() else []
    return [p for p in [*SHM.iterdir(), *mine] if job_id in p.name]


def _committed_steps(storage: Path) -> list[int]:
    return storage_lib.committed_steps(storage_lib.open_storage(str(storage))) if storage.exists() else []


def _wait_for(path: Path, *, step: int, timeout_s: float) -> None:
    def reached() -> bool:
        if not path.exists():
            return False
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return bool(lines) and lines[-1]["step"] >= step

    eventually(reached, timeout=timeout_s, what=f"training reaching step {step}")


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
        out, err = proc.communicate(timeout=90)
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
    with master_process(tmp_path, job, "--max-restarts", "0") as master:
        storage = tmp_path / "ckpt"
        log = tmp_path / "steps.jsonl"
        pids = tmp_path / "pids"
        pids.mkdir()
        proc = _agent(
            [
                "--rdzv-endpoint", master.grpc, "--rdzv-id", job, "--token-file", str(master.token_file),
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
            _, err = proc.communicate(timeout=90)
        finally:
            _end(proc)
        assert proc.returncode != 0, "the job cannot succeed with no restarts left"
        assert "save at breakpoint (worker failure): persisted" in err, err
        committed = _committed_steps(storage)
        assert committed, f"nothing committed under {storage}: {sorted(storage.rglob('*'))}"
        # Step 0 was persisted by the script; everything after came from the save at breakpoint.
        assert max(committed) >= failed_at - 1, (committed, failed_at)
        req = urllib.request.Request(
            f"http://{master.http}/v1/job", headers={"Authorization": f"Bearer {master.token}"}
        )

        def committed_step() -> int:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(json.loads(resp.read())["committed_checkpoint_step"])

        eventually(
            lambda: committed_step() == max(committed),
            timeout=10,
            what=f"the master reporting step {max(committed)} committed",
            interval=0.2,
        )
        assert not _job_leftovers(job), _job_leftovers(job)


@pytest.mark.timeout(150)
def test_nodes_that_straddle_a_step_commit_the_step_they_all_hold(tmp_path: Path) -> None:
    """Ranks 0 and 1 hold steps 10 and 11, ranks 2 and 3 steps 9 and 10, when rank 0 crashes. Each node
    alone would persist its newest and no step would have all four shards. The master settles on step 10
    once both nodes reported, and asks rank 0's node, which persisted 11 already, to persist 10 too."""
    storage, run = tmp_path / "ckpt", tmp_path / "run"
    proc = phalanx_local(
        [
            "--nodes", "2", "--nproc-per-node", "2", "--workdir", str(run), "--timeout", "100",
            f"--agent-arg=--checkpoint-dir={storage}", "--",
            str(STRADDLE), "--dir", str(tmp_path / "marks"),
        ],
        cwd=tmp_path,
        timeout=130,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "checkpoint_breakpoint" in out, out
    assert _committed_steps(storage) == [10], sorted(p.name for p in storage.rglob("*"))
    state = json.loads((run / "master-state.json").read_text())
    assert state["committed_checkpoint_step"] == 10, state
    logs = (run / "node-0.log").read_text() + (run / "node-1.log").read_text()
    assert "persisted step 10 of ranks [2, 3]" in logs, logs
    # Rank 0's node reports first (the other node hears of the failure from the master after that) and
    # persists 11; the master then asks it for 10. Should the other node report first on a loaded machine,
    # rank 0's node is answered 10 instead and never persists 11.
    asked = "(persist step 10, the newest every node of round 1 holds): persisted step 10 of ranks [0, 1]"
    answered = "(worker failure): step 10, which every node holds, not 11"
    assert (asked in logs and "persisted step 11 of ranks [0, 1]" in logs) or answered in logs, logs


@pytest.mark.timeout(150)
def test_a_failed_job_persists_every_nodes_newest_step(tmp_path: Path) -> None:
    """No restarts left: the job fails when rank 0 crashes. The crashed node persists its newest step, and
    so does the other node before it leaves, so that step is committed for the job's next run."""
    storage, run = tmp_path / "ckpt", tmp_path / "run"
    proc = phalanx_local(
        [
            "--nodes", "2", "--nproc-per-node", "2", "--workdir", str(run), "--timeout", "100",
            "--max-restarts", "0", f"--agent-arg=--checkpoint-dir={storage}", "--",
            str(STRADDLE), "--dir", str(tmp_path / "marks"), "--lead", "0",
        ],
        cwd=tmp_path,
        timeout=130,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAILED" in out, out
    assert _committed_steps(storage) == [10], sorted(p.name for p in storage.rglob("*"))
    logs = (run / "node-0.log").read_text() + (run / "node-1.log").read_text()
    assert "save at breakpoint (leaving the job): persisted step 10" in logs, logs


@pytest.mark.timeout(150)
def test_a_failed_job_whose_nodes_straddle_a_step_commits_the_common_one(tmp_path: Path) -> None:
    """No restarts left and rank 0's node one step ahead: it persists step 11 and learns that the job
    failed before the other node reported. It asks the master again before leaving, is told step 10, and
    persists it too, so step 10 is committed."""
    storage, run = tmp_path / "ckpt", tmp_path / "run"
    proc = phalanx_local(
        [
            "--nodes", "2", "--nproc-per-node", "2", "--workdir", str(run), "--timeout", "100",
            "--max-restarts", "0", f"--agent-arg=--checkpoint-dir={storage}", "--",
            str(STRADDLE), "--dir", str(tmp_path / "marks"),
        ],
        cwd=tmp_path,
        timeout=130,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert _committed_steps(storage) == [10], sorted(p.name for p in storage.rglob("*"))
    logs = (run / "node-0.log").read_text() + (run / "node-1.log").read_text()
    asked_again = "(step 10, which every node holds): persisted step 10 of ranks [0, 1]"
    answered = "(worker failure): step 10, which every node holds, not 11"  # the other node reported first
    assert (asked_again in logs and "persisted step 11 of ranks [0, 1]" in logs) or answered in logs, logs


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


@pytest.mark.timeout(120)
def test_sigterm_to_every_agent_commits_the_newest_step(tmp_path: Path) -> None:
    """A suspended job, or a drained machine: SIGTERM to both agents of a 2-node job. The script persists
    only step 0; each agent stops its workers, settles the step with the master and persists it, so the
    newest step every rank held in memory is committed before the Pods' shared memory is gone."""
    job = f"flash-leave-{os.getpid()}"
    storage, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    agents: list[subprocess.Popen[str]] = []
    with master_process(tmp_path, job, nodes="2:2") as master:
        try:
            for node in range(2):
                agents.append(_agent(
                    [
                        "--rdzv-endpoint", master.grpc, "--rdzv-id", job,
                        "--token-file", str(master.token_file), "--node-id", f"node-{node}",
                        "--grace-period", "2", "--nproc-per-node", "1",
                        "--checkpoint-dir", str(storage),
                        str(DDP), "--flash", "--persist-every", "1000", "--steps", "2000",
                        "--step-time", "0.05", "--step-log", str(log),
                    ],
                    cwd=tmp_path,
                ))  # fmt: skip
            _wait_for(log, step=11, timeout_s=60)  # so every rank saved step 10: steps are saved once logged
            sent = time.monotonic()
            for proc in agents:
                proc.send_signal(signal.SIGTERM)
            errs = [proc.communicate(timeout=40)[1] for proc in agents]
            print(f"\nSIGTERM to both agents: exited {time.monotonic() - sent:.2f}s later")
            reached = max(json.loads(line)["step"] for line in log.read_text().splitlines())
        finally:
            for proc in agents:
                _end(proc)
    for proc, err in zip(agents, errs, strict=True):
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "save at breakpoint (terminated): persisted step" in err, err
    committed = _committed_steps(storage)
    assert committed, sorted(storage.rglob("*"))
    assert max(committed) >= 10, committed
    # The workers saved every step to memory; what is committed is at most the one in flight behind.
    assert max(committed) >= reached - 1, (committed, reached)
    assert not _job_leftovers(job), _job_leftovers(job)


@pytest.mark.timeout(420)
def test_a_local_run_cut_short_persists_its_newest_step_and_the_next_run_resumes_there(
    tmp_path: Path,
) -> None:
    """`phalanx local` ends its nodes as Kubernetes ends Pods, with SIGTERM: a run stopped by Ctrl-C (or its
    --timeout) persists the newest step its ranks hold in memory, and the next run with the same checkpoint
    directory starts after it. The script itself persists only step 0. The first run is stopped once it has
    trained a while, whatever a cold machine took to start it."""
    storage, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"

    def args(steps: int) -> list[str]:
        return [
            "--nodes", "2", "--nproc-per-node", "1", "--workdir", str(tmp_path / f"run-{steps}"),
            "--timeout", "180s", f"--agent-arg=--checkpoint-dir={storage}", "--",
            str(DDP), "--flash", "--persist-every", "100000", "--steps", str(steps),
            "--step-time", "0.05", "--step-log", str(log),
        ]  # fmt: skip

    # Ctrl-C as in a terminal, even when this suite runs as a background job: a shell starts those with SIGINT
    # ignored, a child inherits that, and its Python then never raises KeyboardInterrupt (the run went on to
    # its --timeout, once). A handled signal is reset to its default in the child.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        first = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "local", *args(100000)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        _wait_for(log, step=12, timeout_s=150)
    finally:
        first.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = first.communicate(timeout=180)
    assert first.returncode == 130, out
    reached = max(json.loads(line)["step"] for line in log.read_text().splitlines())
    committed = _committed_steps(storage)
    assert max(committed) >= reached - 1, (committed, reached, out)
    logs = "".join(p.read_text() for p in (tmp_path / "run-100000").glob("node-*.log"))
    assert "save at breakpoint (terminated): persisted step" in logs, logs
    log.unlink()
    second = phalanx_local(args(max(committed) + 5), cwd=tmp_path, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[0] == max(committed) + 1, steps


@pytest.mark.timeout(120)
def test_a_checkpoint_host_that_dies_or_hangs_is_replaced_and_training_never_notices(tmp_path: Path) -> None:
    """The node's host is SIGKILLed, and its replacement SIGSTOPped. The agent replaces each with a host that
    adopts the node's snapshots; the workers' persists in between fail with an error and are retried at the
    next one. No worker restarts, and persisting resumes after each fault."""
    storage, log, summary = tmp_path / "ckpt", tmp_path / "steps.jsonl", tmp_path / "summary.json"
    proc = phalanx_local(
        [
            "--nodes", "1", "--nproc-per-node", "2", "--workdir", str(tmp_path / "wd"),
            "--summary-json", str(summary), f"--agent-arg=--checkpoint-dir={storage}",
            "--inject", "kill-checkpoint-host@step=10", "--inject", "hang-checkpoint-host@step=40", "--",
            str(DDP), "--flash", "--persist-every", "5", "--steps", "170", "--step-time", "0.1",
            "--step-log", str(log),
        ],
        cwd=tmp_path,
        timeout=110,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    result = json.loads(summary.read_text())
    assert result["exit"] == "succeeded", out
    kill, hang = result["failures"]
    assert (kill["kind"], hang["kind"]) == ("kill-checkpoint-host", "hang-checkpoint-host")
    assert kill["action"].startswith("replaced by its agent"), out
    assert hang["action"].startswith("replaced by its agent"), out
    assert kill["recovered_at"] - kill["injected_at"] < 5, kill  # the agent looks every second
    assert hang["recovered_at"] - hang["injected_at"] < 20, hang  # after 10 s without an answer
    assert result["rounds"] == 1, out  # nobody restarted
    node_log = (tmp_path / "wd" / "node-0.log").read_text()
    assert re.search(r"flash-checkpoint host \(pid \d+\) exited; replaced it", node_log), node_log
    assert re.search(r"flash-checkpoint host \(pid \d+\) does not answer .*replaced it", node_log), node_log
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in steps] == list(range(170))
    assert {e["restart"] for e in steps} == {0}
    assert "persisted step 5 of rank 0" in node_log, node_log  # before the faults ...
    committed = _committed_steps(storage)
    assert max(committed) == 165, committed  # ... and after both
    assert not _job_leftovers(result["job_id"]), _job_leftovers(result["job_id"])


@pytest.mark.timeout(150)
def test_a_restart_in_place_does_not_wait_for_a_hung_storage(tmp_path: Path) -> None:
    """The checkpoint bucket stops answering (its server SIGSTOPped) just before a worker is SIGKILLed.
    The save at breakpoint cannot be written, yet the workers restart at once and train on, loading from
    memory; once the storage is back the breakpoint step reaches it. Before, the restart waited for the
    write (up to its 120 s limit)."""
    job = f"flash-hung-{os.getpid()}"
    log, pids = tmp_path / "steps.jsonl", tmp_path / "pids"
    pids.mkdir()
    bucket = f"ckpt-{os.getpid()}"
    with minio_server(tmp_path / "minio") as (endpoint, server):
        env = aws_env(endpoint)
        with environment(env):
            storage_lib.S3Storage(bucket).client.create_bucket(Bucket=bucket)
        proc = _agent(
            [
                "--standalone", "--rdzv-id", job, "--nproc-per-node", "2", "--max-restarts", "2",
                "--checkpoint-dir", f"s3://{bucket}/run", "--log-dir", str(tmp_path / "logs"),
                str(DDP), "--flash", "--persist-every", "1000", "--steps", "150", "--step-time", "0.05",
                "--step-log", str(log), "--pid-dir", str(pids),
            ],
            cwd=tmp_path,
            env=env,
        )  # fmt: skip
        try:
            _wait_for(log, step=8, timeout_s=40)
            # The first persist (step 0) must be out of the way: on a loaded machine it can still be writing,
            # and a write the stop catches holds the node's persist queue until the storage is back, past the
            # breakpoint step's own snapshot (superseded by then), which the test would then miss.
            with environment(env):
                stored = storage_lib.open_storage(f"s3://{bucket}/run")
                eventually(
                    lambda: 0 in storage_lib.committed_steps(stored), timeout=60, what="step 0 persisted"
                )
            server.send_signal(signal.SIGSTOP)
            try:
                os.kill(int((pids / "rank1.pid").read_text()), signal.SIGKILL)

                def restarted() -> bool:
                    assert proc.poll() is None, proc.communicate()
                    return any(e["restart"] == 1 for e in _steps(log))

                # The storage stays stopped until the restart is seen: a restart waiting for it never comes.
                eventually(
                    restarted, timeout=60, what="the restart, while the storage is stopped", interval=0.1
                )
            finally:
                server.send_signal(signal.SIGCONT)
            out, err = proc.communicate(timeout=60)
        finally:
            _end(proc)
        assert proc.returncode == 0, out + err
        resumed = [e for e in _steps(log) if e["restart"] == 1]
        assert resumed[0]["step"] >= 8
        assert re.search(r"\[rank1\]:flash: loaded step \d+ from memory \(storage reads 0\)", out), out
        persisted = re.search(r"save at breakpoint \(worker failure\): persisted step (\d+) of ranks", err)
        assert persisted, err
        with environment(env):
            committed = storage_lib.committed_steps(storage_lib.open_storage(f"s3://{bucket}/run"))
        assert int(persisted.group(1)) in committed, committed
    assert not _job_leftovers(job), _job_leftovers(job)


def _steps(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
