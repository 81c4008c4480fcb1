"""`phalanx local` end to end with real faults: SIGKILLed workers and nodes, a SIGSTOPped worker, a killed
master, and a user error on every rank. The workload is tests/agent/workload.py (torch-free, real beacons)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.agent.helpers import STANDS_FOR_ANY_HANG, WORKLOAD, phalanx_local, steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

BASE = ["--heartbeat-timeout", "2s", "--agent-arg=--no-warm-spares", "--agent-arg=--grace-period=1s"]


def run(
    tmp: Path, *args: str, workload: list[str], timeout: float = 80, warm_spares: bool = False
) -> tuple[int, dict[str, Any], str]:
    """``warm_spares``: as by default (each node's zygote imports torch, which this workload never does)."""
    summary = tmp / "summary.json"
    proc = phalanx_local(
        [
            *(arg for arg in BASE if warm_spares is False or arg != "--agent-arg=--no-warm-spares"),
            "--workdir",
            str(tmp / "wd"),
            "--summary-json",
            str(summary),
            *args,
            "--",
            str(WORKLOAD),
            "--dir",
            str(tmp / "d"),
            *workload,
        ],
        cwd=tmp,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert summary.exists(), out
    return proc.returncode, json.loads(summary.read_text()), out


def test_worker_sigkill_restarts_in_place(tmp_path: Path) -> None:
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--inject",
        "kill-worker@step=8,node=1,rank=1",
        workload=["--steps", "30", "--step-time", "0.1"],
    )
    assert code == 0, out
    assert s["exit"] == "succeeded"
    (f,) = s["failures"]
    assert f["kind"] == "kill-worker"
    assert f["node"] == "node-1"
    assert f["detected_at"] is not None
    assert f["recovered_at"] is not None
    assert f["steps_lost"] == 0
    assert f["action"].startswith("workers restarted (round "), f["action"]
    assert s["evictions"] == []
    assert s["rounds"] >= 2
    lines = steps(tmp_path / "d")
    assert max(e["step"] for e in lines) == 29
    # The node's workers were restarted: new processes in a later round, same world size.
    later = [e for e in lines if e["round"] >= 2]
    assert later
    assert {e["world"] for e in later} == {4}
    assert {e["pid"] for e in later}.isdisjoint({e["pid"] for e in lines if e["round"] == 1})


def test_node_sigkill_survivors_shrink_then_replacement_joins(tmp_path: Path) -> None:
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2:3",
        "--nproc-per-node",
        "2",
        "--replace-delay",
        "4s",
        "--inject",
        "kill-node@step=8,node=2",
        workload=["--steps", "110", "--step-time", "0.1"],
    )
    assert code == 0, out
    (ev,) = s["evictions"]
    assert ev["node_id"] == "node-2"
    assert ev["replacement"] == "node-3"
    (f,) = s["failures"]
    assert f["recovered_at"] is not None
    assert "evicted node-2" in f["action"]
    lines = steps(tmp_path / "d")
    rounds: dict[int, set[str]] = {}
    for e in lines:
        rounds.setdefault(e["round"], set()).add(e["node"])
    assert rounds[1] == {"node-0", "node-1", "node-2"}
    # First the survivors alone (world 4), then a later round with the replacement (world 6).
    small = [r for r, nodes in rounds.items() if nodes == {"node-0", "node-1"}]
    grown = [r for r, nodes in rounds.items() if nodes == {"node-0", "node-1", "node-3"}]
    assert small, rounds
    assert grown, rounds
    assert min(grown) > min(small)
    assert {e["world"] for e in lines if e["round"] == min(small)} == {4}
    assert max(e["step"] for e in lines) == 109
    # One fault, one row: the replacement's fold-in is reported with it. The workload checkpoints every
    # step on its own (the master is not told), so the master had no boundary to wait for, and the
    # survivors' last step before the fold-in is the one before the job's first step with node-3.
    fold = f["fold_in"]
    assert (fold["node"], fold["round"], fold["reformed_world"], fold["world"]) == (
        "node-3",
        min(grown),
        4,
        6,
    )
    assert (
        fold["reason"]
        == "scale up: 1 node(s) waiting; the job reports no checkpoints: there is no boundary to wait for"
    )
    first_with_node_3 = min(e["step"] for e in lines if e["round"] == min(grown))
    last_before: dict[int, int] = {}  # each survivor's worker: its last step before the fold-in
    for e in lines:
        if e["round"] == max(small):
            last_before[e["pid"]] = max(last_before.get(e["pid"], -1), e["step"])
    # Ranks step on timers of their own: rank 0's checkpoint may be a step ahead of the slowest rank's.
    assert fold["step"] == first_with_node_3 >= min(last_before.values()) + 1  # no step trained twice
    assert fold["steps_lost"] == 0
    assert 0 < fold["cost_s"] < fold["folded_at"] - f["injected_at"]
    assert f"node-3 folded in at step {first_with_node_3} (round {min(grown)})" in f["action"]
    # The killed agent could not remove its workers' beacons and interval rings; the run did.
    assert not list(Path("/dev/shm").glob(f"phalanx-{s['job_id']}-*")), "shared-memory files left behind"


def test_hung_worker_is_detected_and_recovered(tmp_path: Path) -> None:
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--agent-arg=--hang-floor=2s",
        "--agent-arg=--hang-idle-floor=2s",  # the torch-free workload has no recorder: its beacon decides
        STANDS_FOR_ANY_HANG,
        "--inject",
        "hang-worker@step=8,node=0,rank=1",
        workload=["--steps", "50", "--step-time", "0.1"],
    )
    assert code == 0, out
    (f,) = s["failures"]
    assert f["kind"] == "hang-worker"
    assert f["detected_at"] is not None
    assert 1.5 < f["detected_at"] - f["injected_at"] < 10
    assert f["recovered_at"] is not None
    assert "hung: no progress past step" in (tmp_path / "wd" / "node-0.log").read_text()
    assert max(e["step"] for e in steps(tmp_path / "d")) == 49
    # The stacks of both nodes made it into the analysis (node-0's agent sent its own before reporting the
    # hang), and the stopped rank, which cannot answer SIGUSR1, is the odd one.
    assert re.search(r"event hang_analysis +node-0 +ranks \[\d\] on node-0 differ from the 3 of 4", out), out


def test_master_restart_does_not_interrupt_training(tmp_path: Path) -> None:
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--inject",
        "kill-master@step=10",
        workload=["--steps", "60", "--step-time", "0.1"],
    )
    assert code == 0, out
    assert "master_resumed" in out
    (f,) = s["failures"]
    assert f["kind"] == "kill-master"
    assert f["recovered_at"] is not None
    lines = steps(tmp_path / "d")
    # The same four worker processes ran every step, in round 1: nothing was restarted.
    assert len({e["pid"] for e in lines}) == 4
    assert {e["round"] for e in lines} == {1}
    assert max(e["step"] for e in lines) == 59
    assert s["rounds"] == 1


def test_user_error_on_every_rank_fails_fast(tmp_path: Path) -> None:
    code, s, _ = run(
        tmp_path,
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        # The ranks start together, as a trainer's first collective makes them: every rank reaches the bad
        # batch within moments of the others, however late a loaded machine started one node's workers.
        workload=["--steps", "50", "--step-time", "0.2", "--fail-at", "5", "--start-together"],
    )
    assert code != 0
    assert s["exit"] == "failed"
    assert "bad batch at step 5" in s["reason"], s
    assert s["wall_seconds"] < 30
    assert s["rounds"] == 1  # failed at once, no restart


def test_regroup_capable_workers_survive_membership_changes(tmp_path: Path) -> None:
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2:3",
        "--nproc-per-node",
        "2",
        "--replace-delay",
        "3s",
        "--inject",
        "kill-node@step=8,node=2",
        workload=["--steps", "100", "--step-time", "0.1", "--regroup"],
    )
    assert code == 0, out
    assert s["evictions"][0]["replacement"] == "node-3"
    # The summary says what the workers' beacons showed: the survivors re-formed in their own processes.
    (f,) = s["failures"]
    assert f["action"].startswith("re-formed in process at world 4 (round 2); evicted node-2"), f["action"]
    lines = steps(tmp_path / "d")
    survivors = [e for e in lines if e["node"] in ("node-0", "node-1")]
    # The survivors' processes were never restarted: the agents rewrote the round file instead.
    assert len({e["pid"] for e in survivors}) == 4
    worlds = [e["world"] for e in survivors]
    assert worlds[0] == 6
    assert 4 in worlds
    assert worlds[-1] == 6  # the replacement joined a later round
    assert {e["node"] for e in lines if e["round"] == max(e["round"] for e in lines)} == {
        "node-0",
        "node-1",
        "node-3",
    }
    assert "regrouped in place" in (tmp_path / "wd" / "node-0.log").read_text()


def test_a_replacement_that_joins_as_training_ends_does_not_hold_up_the_job(tmp_path: Path) -> None:
    """The round with the replacement is written while the survivors take their last step: they finish
    without forming it, and the replacement's workers would wait for them forever. The job succeeds
    without it (before, it waited until the newcomer gave up, then everyone trained again from the last
    checkpoint)."""
    code, s, out = run(
        tmp_path,
        "--nodes",
        "2:3",
        "--nproc-per-node",
        "2",
        "--replace-delay",
        "0s",
        "--timeout",
        "60s",
        "--inject",
        "kill-node@step=5,node=2",
        workload=["--steps", "100000", "--step-time", "0.1", "--regroup", "--finish-when-joined"],
    )
    assert code == 0, out
    assert s["exit"] == "succeeded", s
    assert "node-3 joined it as training ended and had nothing left to train" in s["reason"], s
    assert s["evictions"][0]["replacement"] == "node-3"
    assert "joined round" in (tmp_path / "wd" / "node-3.log").read_text()  # its workers did start


def test_a_node_whose_steps_lag_is_flagged_and_probed(tmp_path: Path) -> None:
    """node-1's ranks take three times longer a step (independent ranks: no collective evens them out).
    The master's step-time check flags them, not node-0's, and starts a probe round, whose healthy
    results evict nobody."""
    code, s, out = run(
        tmp_path,
        "--nodes", "2", "--nproc-per-node", "2",
        "--master-arg=--probes-enabled=true", "--master-arg=--probes-kinds=matmul",
        "--master-arg=--probes-stragglers-step-check-interval-s=2",
        workload=["--steps", "50", "--step-time", "0.1", "--slow-node", "node-1"],
    )  # fmt: skip
    assert code == 0, out
    assert s["exit"] == "succeeded"
    flagged = [line for line in out.splitlines() if "event slow_steps" in line]
    assert len(flagged) == 2, out  # node-1's two ranks, once each
    assert all(" node-1 " in line for line in flagged), flagged
    assert any(
        "event probe_started" in line and "slow steps on node-1" in line for line in out.splitlines()
    ), out
    assert s["evictions"] == []


@pytest.mark.timeout(180)
def test_a_probe_round_runs_every_kind_on_every_node(tmp_path: Path) -> None:
    """The default probe kinds, matmul and all-gather, reach every node in one heartbeat; each node runs
    them one after the other and the round ends with every report in. The thresholds are lenient: this
    machine's CPU rates are noise, and the point here is that every report arrives. Both are forked
    from the node's warm probe server (on by default), which the first one forks from the zygote."""
    code, s, out = run(
        tmp_path,
        "--nodes", "2",
        "--master-arg=--probes-enabled=true", "--master-arg=--probes-on-round-complete=true",
        "--master-arg=--probes-stragglers-compute-threshold=0.01",
        "--master-arg=--probes-stragglers-link-threshold=0.01",
        # 40 s of training: both probes take 9 s on an idle machine and were not done 16 s in under a full
        # suite's load, when the job's end aborted the round.
        workload=["--steps", "400", "--step-time", "0.1"],
        timeout=150,
        warm_spares=True,  # the default: the probe server is forked from the zygote
    )  # fmt: skip
    assert code == 0, out
    assert s["exit"] == "succeeded"
    finished = [line for line in out.splitlines() if "event probe_finished" in line]
    assert finished, out
    assert all(" ok:" in line for line in finished), out
    for node in ("node-0", "node-1"):
        log = (tmp_path / "wd" / f"{node}.log").read_text()
        done = [line for line in log.splitlines() if "probe done" in line]
        assert len(done) == 2, log  # the matmul and the all-gather
        assert all("failed: []" in line for line in done), log
        assert all("(warm)" in line for line in done), log
        assert "the probe server is a fork of the zygote" in log, log  # torch imported once on the node
