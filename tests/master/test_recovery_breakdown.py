"""The recovery breakdown: a worker is killed, the job restarts, regroups, restores and trains the lost steps
again, and the master's ``/metrics`` text (its real Prometheus registry) says how long each phase took.
The job driven with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.metrics import MasterMetrics
from phalanx.master.state.recovery import RecoveryTracker

from .sim import Sim

TWO = {"rendezvous": {"min_nodes": 2, "max_nodes": 2, "last_call_s": 0.5}, "heartbeat": {"timeout_s": 30.0}}


def _samples(sim: Sim, tmp_path: Path) -> dict[tuple[str, str], float]:
    logs = LogStore(ring_lines=1, max_line_bytes=80, path=tmp_path / "job.log")
    text = generate_latest(MasterMetrics(sim.job, logs).registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "recover" in s.name:
                key = s.labels.get("phase", "") + (f"<={s.labels['le']}" if "le" in s.labels else "")
                out[(s.name, key)] = s.value
    return out


def _kill(sim: Sim, node: str, *, at: float) -> pb.ReportFailureRequest:
    return pb.ReportFailureRequest(
        node_id=node,
        incarnation=sim.inc[node],
        round=sim.job.round_number,
        kind=pb.FAILURE_KIND_WORKER_EXIT,
        failures=[
            pb.WorkerFailure(
                rank=1, exit_code=-9, failure_class=pb.FAILURE_CLASS_KILLED, observed_unix_ns=int(at * 1e9)
            )
        ],
    )


def test_a_restart_is_broken_down_into_detect_reform_restore_and_recompute(tmp_path: Path) -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    for node in ("a", "b"):
        sim.hb(node, step=20)
    t0 = sim.now
    assert _samples(sim, tmp_path)[("phalanx_recoveries_total", "")] == 0
    sim.job.report_failure(_kill(sim, "a", at=t0 - 0.4), now=t0)  # seen 0.4 s after the kill
    sim.now = t0 + 1.0  # both agents rejoin: with every node in, the round completes at once
    sim.join("a", port=2100)
    sim.join("b", port=2200)
    assert sim.job.round_number == 2
    sim.at(t0 + 3.6)
    for node in ("a", "b"):
        sim.hb(node, step=16)  # restored from step 15: the first step of the new round
    sim.at(t0 + 5.6)
    sim.hb("a", step=19)
    assert _samples(sim, tmp_path)[("phalanx_recoveries_total", "")] == 0, "not back at step 20 yet"
    sim.at(t0 + 6.6)
    sim.hb("b", step=20)

    got = _samples(sim, tmp_path)
    assert got[("phalanx_recoveries_total", "")] == 1
    last = {p: got[("phalanx_recovery_last_phase_seconds", p)] for p in RecoveryTracker().sums}
    assert last == pytest.approx({"detect": 0.4, "reform": 1.0, "restore": 2.6, "recompute": 3.0}), last
    for phase, seconds in last.items():
        assert got[("phalanx_recovery_phase_seconds_count", phase)] == 1
        assert abs(got[("phalanx_recovery_phase_seconds_sum", phase)] - seconds) < 1e-6
    assert got[("phalanx_recovery_phase_seconds_bucket", "detect<=0.5")] == 1
    assert got[("phalanx_recovery_phase_seconds_bucket", "detect<=0.25")] == 0
    assert got[("phalanx_recovery_phase_seconds_bucket", "recompute<=+Inf")] == 1


def test_a_failure_during_a_recovery_ends_it_with_what_it_had_and_keeps_the_step_to_reach() -> None:
    tracker = RecoveryTracker()
    tracker.start(now=100.0, failed=99.0, step=50)
    tracker.reformed(now=102.0)
    tracker.start(now=103.0, failed=0.0, step=40)  # a node lost before the first step
    assert tracker.last == {"detect": 1.0, "reform": 2.0}
    assert tracker.current is not None
    assert tracker.current.lost_step == 50
    tracker.reformed(now=104.0)
    tracker.stepped(now=105.0, step=51)  # the first step is already past the lost one: nothing recomputed
    assert tracker.last == {"reform": 1.0, "restore": 1.0, "recompute": 0.0}
    assert tracker.finished == 2
    tracker.stepped(now=106.0, step=60)  # no recovery in progress: nothing changes
    assert tracker.finished == 2
