"""A restarted master keeps the restart event still waiting for its root cause and the recovery in progress:
both are in the durable state (:mod:`phalanx.master.state.snapshot`). The job driven with an injected clock;
each
"master restart" is a new :class:`Job` built from the old one's state after a JSON round trip, as the state
store does it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from phalanx.api.elasticjob import Phase
from phalanx.api.errors import StateStoreError
from phalanx.diagnostics import rootcause
from phalanx.master.job import Job
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.metrics import MasterMetrics
from phalanx.master.state.nodes import NodeStatus
from phalanx.master.state.recovery import BUCKETS, RecoveryTracker
from phalanx.master.state.snapshot import EVENT_SEQ_GAP

from .sim import Sim, settings
from .test_recovery_breakdown import TWO, _kill
from .test_root_cause import TWO as TWO_SETTLING
from .test_root_cause import echo, kill


def restart_master(sim: Sim, *, at: float, groups: dict[str, Any]) -> dict[str, Any]:
    """Replaces ``sim``'s job by a new master resumed at ``at`` from the old one's saved state; returns it."""
    saved = json.loads(json.dumps(sim.job.durable()))
    sim.job = Job(settings=settings(**groups), now=at, saved=saved)
    sim.now = at
    return saved


PHASES_OF_THE_WHOLE_RECOVERY = {"detect": 0.4, "reform": 1.0, "restore": 2.6, "recompute": 3.0}


@pytest.mark.parametrize("dies_after", ["the restart", "the round re-formed", "the first step"])
def test_a_master_restarted_mid_recovery_finishes_it_with_the_phases_of_the_whole_recovery(
    dies_after: str,
) -> None:
    # The scenario of test_recovery_breakdown, with the master replaced at one point of it.
    sim = Sim(**TWO)
    sim.form("a", "b")
    for node in ("a", "b"):
        sim.hb(node, step=20)
    t0 = sim.now
    sim.job.report_failure(_kill(sim, "a", at=t0 - 0.4), now=t0)
    if dies_after == "the restart":
        restart_master(sim, at=t0 + 0.5, groups=TWO)
        assert sim.job.recovery.current is not None
    sim.now = t0 + 1.0
    sim.join("a", port=2100)
    sim.join("b", port=2200)
    assert sim.job.round_number == 2
    if dies_after == "the round re-formed":
        restart_master(sim, at=t0 + 2.0, groups=TWO)
    sim.at(t0 + 3.6)
    for node in ("a", "b"):
        sim.hb(node, step=16)
    if dies_after == "the first step":
        restart_master(sim, at=t0 + 4.0, groups=TWO)
    sim.at(t0 + 5.6)
    sim.hb("a", step=19)
    assert sim.job.recovery.finished == 0
    sim.at(t0 + 6.6)
    sim.hb("b", step=20)

    tracker = sim.job.recovery
    assert tracker.finished == 1
    assert tracker.current is None
    assert tracker.last == pytest.approx(PHASES_OF_THE_WHOLE_RECOVERY)


def test_a_recovery_moving_on_a_heartbeat_changes_the_durable_state() -> None:
    """The first step and catching up arrive with heartbeats, which change nothing else durable: without a
    save then, a master killed after them would date them again."""
    sim = Sim(**TWO)
    sim.form("a", "b")
    sim.hb("a", step=20)
    sim.job.report_failure(_kill(sim, "a", at=sim.now), now=sim.now)
    sim.join("a", port=2100)
    sim.join("b", port=2200)
    before = sim.job.durable_version
    sim.hb("a", step=16)  # resumed
    assert sim.job.durable_version > before
    before = sim.job.durable_version
    sim.hb("a", step=18)  # nothing moved: heartbeats stay free of saves
    assert sim.job.durable_version == before
    sim.hb("a", step=20)  # caught up
    assert sim.job.durable_version > before


def _metrics(job: Job, tmp_path: Path) -> str:
    logs = LogStore(ring_lines=1, max_line_bytes=80, path=tmp_path / "job.log")
    lines = generate_latest(MasterMetrics(job, logs).registry).decode().splitlines()
    return "\n".join(line for line in lines if "recover" in line and not line.startswith("#"))


def test_the_recovery_totals_behind_the_metrics_survive_a_master_restart(tmp_path: Path) -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    sim.hb("a", step=20)
    t0 = sim.now
    sim.job.report_failure(_kill(sim, "a", at=t0 - 0.4), now=t0)
    sim.now = t0 + 1.0
    sim.join("a", port=2100)
    sim.join("b", port=2200)
    sim.now = t0 + 2.0
    sim.hb("a", step=20)
    before = _metrics(sim.job, tmp_path)
    assert "phalanx_recoveries_total 1.0" in before
    restart_master(sim, at=t0 + 10.0, groups=TWO)
    assert _metrics(sim.job, tmp_path) == before


def test_a_pending_restart_is_emitted_once_by_the_restarted_master_past_the_seq_gap() -> None:
    sim = Sim(**TWO_SETTLING)
    sim.form("a", "b")
    t = sim.now
    sim.job.report_failure(echo(sim, "a", 0, at=t - 0.5), now=t)
    assert sim.job.events.of_kind("restart") == [], "waiting for b's report"
    saved = restart_master(sim, at=t + 0.5, groups=TWO_SETTLING)  # killed within the settling window
    assert saved["pending_restart"]["node"] == "a"

    (restart,) = sim.job.events.of_kind("restart")
    assert (restart.node, restart.rank, restart.round, restart.unix) == ("a", 0, 1, t)
    assert restart.message.startswith("worker failure: rank 0 on a lost its peers first")
    assert restart.seq >= saved["event_seq"] + EVENT_SEQ_GAP, "a poller's since= must not hide it"
    kinds = [e.kind for e in sim.job.events.since(0, limit=100)]
    assert kinds == ["restart", "master_resumed"]
    sim.job.tick(now=t + rootcause.SETTLE_S + 1.0)
    sim.job.report_failure(kill(sim, "b", 3, at=t), now=t + rootcause.SETTLE_S + 1.5)
    assert len(sim.job.events.of_kind("restart")) == 1, "the better cause revises it, it does not repeat"
    (revised,) = sim.job.events.of_kind("root_cause")
    assert (revised.node, revised.rank) == ("b", 3)
    assert sim.job.restart_count == 1

    # A third master, from the second's state: the restart is not pending any more.
    again = restart_master(sim, at=t + 5.0, groups=TWO_SETTLING)
    assert again["pending_restart"] is None
    assert sim.job.events.of_kind("restart") == []


def test_a_state_saved_before_these_keys_existed_still_loads_and_a_malformed_one_is_refused() -> None:
    sim = Sim(**TWO_SETTLING)
    sim.form("a", "b")
    sim.job.report_failure(echo(sim, "a", 0, at=sim.now - 0.5), now=sim.now)
    saved = json.loads(json.dumps(sim.job.durable()))
    old = {k: v for k, v in saved.items() if k not in ("recovery", "pending_restart")}
    resumed = Job(settings=settings(**TWO_SETTLING), now=sim.now + 1, saved=old)
    assert resumed.recovery.current is None
    assert resumed.recovery.finished == 0
    assert resumed.restart_count == 1
    assert resumed.events.of_kind("restart") == []  # lost, as before the pending restart was durable

    for key, bad in [("recovery", {"current": {"started": "x"}}), ("pending_restart", {"round": 1})]:
        with pytest.raises(StateStoreError, match="malformed"):
            Job(settings=settings(**TWO_SETTLING), now=sim.now + 1, saved={**saved, key: bad})
    # A phase or a node status that is no such word: refused as malformed, not carried on as a string.
    node = next(iter(saved["nodes"]))
    for bad_state in [
        {**saved, "phase": "Sleeping"},
        {**saved, "nodes": {**saved["nodes"], node: {**saved["nodes"][node], "status": "dozing"}}},
    ]:
        with pytest.raises(StateStoreError, match="malformed"):
            Job(settings=settings(**TWO_SETTLING), now=sim.now + 1, saved=bad_state)
    restored = Job(settings=settings(**TWO_SETTLING), now=sim.now + 1, saved=saved)
    assert restored.phase is Phase.RESTARTING  # the member, not the string the file holds
    assert {n.status for n in restored.nodes.values()} == {NodeStatus.ALIVE}


def test_histogram_counts_saved_with_other_bucket_bounds_start_again_and_keep_the_total() -> None:
    tracker = RecoveryTracker()
    tracker.start(now=100.0, failed=99.0, step=5)
    tracker.reformed(now=101.0)
    tracker.stepped(now=102.0, step=5)
    saved = json.loads(json.dumps(tracker.to_json()))
    assert RecoveryTracker.from_json(saved) == tracker
    other = {**saved, "buckets": [1.0, 10.0], "counts": {p: [1, 0, 0] for p in saved["counts"]}}
    restored = RecoveryTracker.from_json(other)
    assert (restored.finished, restored.last) == (1, tracker.last)
    assert restored.counts == RecoveryTracker().counts
    assert restored.sums == RecoveryTracker().sums
    assert len(tracker.counts["detect"]) == len(BUCKETS) + 1
