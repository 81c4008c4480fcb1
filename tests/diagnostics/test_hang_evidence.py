"""Hang verdicts with evidence (device, host, beacon), suspects across ranks, and the policy blaming the
suspect node: pure functions with injected clocks and activities."""

from __future__ import annotations

import json

from phalanx.api.failures import FailureClass
from phalanx.api.settings import HangSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.master.decide.failure_policy import FailureRecord, PolicyInput, Verdict, decide_failure

S = HangSettings()  # the defaults: floor 10 s, idle floor 60 s, factor 3
NS = 1_000_000_000
T0 = 1_700_000_000 * NS  # the recorder's wall clock


def _history(step_s: float = 0.1, steps: int = 20) -> hang.RankHistory:
    h = hang.RankHistory(started_at=0.0)
    for i in range(steps):
        h.observe(step=i, now=1.0 + step_s * i)
    return h


def _activity(
    *,
    last_ns: int = T0,
    pending_ns: int = 0,
    current: tuple[str, str, int] | None = None,
    entered: dict[str, int] | None = None,
) -> pb.RankActivity:
    act = pb.RankActivity(last_record_unix_ns=last_ns, device_pending_since_unix_ns=pending_ns)
    if current:
        act.current.CopyFrom(pb.Interval(name=current[0], group=current[1], seq=current[2]))
    for group, seq in (entered or {}).items():
        act.entered[group] = seq
    return act


def test_defaults_are_floor_10s_and_three_p99_steps() -> None:
    assert (S.floor_s, S.idle_floor_s, S.factor) == (10.0, 60.0, 3.0)
    assert hang.timeout_for(_history(0.1), S) == 10.0
    assert hang.timeout_for(_history(5.0), S) == 15.0
    assert hang.timeout_for(_history(0.1), S, waiting=False) == 60.0
    assert hang.timeout_for(_history(30.0), S, waiting=False) == 90.0


def test_silence_outside_any_collective_waits_for_the_idle_floor() -> None:
    """A rank between collectives (persisting a checkpoint, evaluating, tearing down after its last step)
    is not hung after 10 s; its peers, waiting for it in their next collective, are what catch a stall."""
    h = _history()
    act = _activity(entered={"dp:0,1": 19})
    assert not hang.evidence_verdict(h, S, now=2.0, activity=act, now_unix_ns=T0 + 59 * NS).hung
    v = hang.evidence_verdict(h, S, now=2.0, activity=act, now_unix_ns=T0 + 61 * NS)
    assert (v.hung, v.side, v.timeout_s) == (True, "host", 60.0)
    assert hang.describe(0, v) == "rank 0 hung after step 19, in no collective (host side, 61.0 s > 60.0 s)"


def test_host_side_hang_names_the_collective_the_rank_waits_in() -> None:
    h = _history()
    act = _activity(current=("all_reduce", "dp:0,1", 41))
    quiet = hang.evidence_verdict(h, S, now=2.0, activity=act, now_unix_ns=T0 + 9 * NS)
    assert not quiet.hung
    v = hang.evidence_verdict(h, S, now=2.0, activity=act, now_unix_ns=T0 + int(12.3 * NS))
    assert (v.hung, v.side) == (True, "host")
    assert hang.describe(1, v) == "rank 1 hung in all_reduce #41 of dp:0,1 (host side, 12.3 s > 10.0 s)"
    ev = hang.evidence(v, act)
    assert (ev.side, ev.activity.current.seq) == ("host", 41)


def test_device_work_pending_past_the_timeout_is_a_device_side_hang() -> None:
    h = _history()
    # The host keeps recording (it runs ahead), but a CUDA event recorded 11 s ago has not completed.
    act = _activity(last_ns=T0 + 11 * NS, pending_ns=T0, current=("all_reduce", "dp:0,1", 7))
    v = hang.evidence_verdict(h, S, now=2.0, activity=act, now_unix_ns=T0 + 11 * NS)
    assert (v.hung, v.side) == (True, "device")
    assert "all_reduce #7 of dp:0,1 (device side, 11.0 s > 10.0 s)" in hang.describe(0, v)
    outside = _activity(last_ns=T0 + 11 * NS, pending_ns=T0)
    v = hang.evidence_verdict(h, S, now=2.0, activity=outside, now_unix_ns=T0 + 11 * NS)
    assert hang.describe(0, v) == "rank 0 hung after step 19, in no collective (device side, 11.0 s > 10.0 s)"


def test_without_a_recorder_the_beacon_decides() -> None:
    h = _history()
    last = 1.0 + 0.1 * 19
    for act in (None, pb.RankActivity()):
        assert not hang.evidence_verdict(h, S, now=last + 59.9, activity=act, now_unix_ns=0).hung
        v = hang.evidence_verdict(h, S, now=last + 60.1, activity=act, now_unix_ns=0)
        assert (v.hung, v.side) == (True, "beacon")
        assert hang.describe(3, v).startswith("rank 3 hung: no progress past step 19")
        assert hang.evidence(v, act).side == "beacon"


def test_slow_steps_stretch_the_evidence_timeout() -> None:
    h = _history(step_s=5.0, steps=10)  # 3 x p99 = 15 s
    act = _activity(current=("all_reduce", "dp:0,1", 9))
    assert not hang.evidence_verdict(h, S, now=50.0, activity=act, now_unix_ns=T0 + 14 * NS).hung
    assert hang.evidence_verdict(h, S, now=50.0, activity=act, now_unix_ns=T0 + 16 * NS).hung


def test_disabled_detection_never_hangs() -> None:
    off = HangSettings(enabled=False)
    act = _activity(pending_ns=T0)
    assert not hang.evidence_verdict(_history(), off, now=2.0, activity=act, now_unix_ns=T0 + 1000 * NS).hung


def test_the_members_that_never_entered_the_collective_are_the_suspects() -> None:
    acts = {
        0: _activity(current=("all_reduce", "dp:0-3", 42), entered={"dp:0-3": 42}),
        1: _activity(current=("all_reduce", "dp:0-3", 42), entered={"dp:0-3": 42}),
        2: _activity(entered={"dp:0-3": 41}),  # stopped (or sleeping) before it entered #42
        3: _activity(current=("all_reduce", "dp:0-3", 42), entered={"dp:0-3": 42}),
    }
    found = hang.find_suspects(acts)
    assert found is not None
    assert (found.op, found.group, found.seq, found.ranks, found.waiting) == (
        "all_reduce",
        "dp:0-3",
        42,
        [2],
        [0, 1, 3],
    )
    assert found.describe() == "rank(s) 2 never entered all_reduce #42 of dp:0-3; rank(s) 0, 1, 3 wait in it"


def test_no_suspects_when_everyone_entered_or_nobody_waits() -> None:
    all_in = {r: _activity(current=("all_reduce", "dp:0,1", 5), entered={"dp:0,1": 5}) for r in (0, 1)}
    assert hang.find_suspects(all_in) is None
    idle = {0: _activity(entered={"dp:0,1": 5}), 1: _activity(entered={"dp:0,1": 4})}
    assert hang.find_suspects(idle) is None
    # A member never heard of is not accused.
    assert (
        hang.find_suspects({0: _activity(current=("all_reduce", "dp:0,1", 5), entered={"dp:0,1": 5})}) is None
    )


def test_a_rank_that_never_used_the_group_is_a_suspect() -> None:
    acts = {0: _activity(current=("broadcast", "pp:0,1", 1), entered={"pp:0,1": 1}), 1: _activity()}
    found = hang.find_suspects(acts)
    assert found is not None
    assert found.ranks == [1]


def _decide(*, suspect: str, hangs: dict[str, int]) -> object:
    rec = FailureRecord(
        node_id="node-0", round=1, rank=0, failure_class=FailureClass.HANG, kind="hang", message="hung"
    )
    return decide_failure(
        PolicyInput(
            node_id="node-0",
            report=[rec],
            round_records=[rec],
            members=["node-0", "node-1"],
            world_size=2,
            restart_count=0,
            max_restarts=3,
            eviction_count=0,
            max_evictions=3,
            hang_suspect=suspect,
            suspect_hang_count=hangs.get(suspect, 0),
        ),
        now=0.0,
    )


def test_policy_blames_the_suspect_node_not_the_reporter() -> None:
    first = _decide(suspect="node-1", hangs={})
    assert (first.verdict, first.blamed, first.dump_stacks) == (Verdict.RESTART, "node-1", True)  # type: ignore[attr-defined]
    assert "blamed on node-1" in first.reason  # type: ignore[attr-defined]
    # The reporter hung before, the suspect did not: a restart, no eviction of the reporter.
    assert _decide(suspect="node-1", hangs={"node-0": 1}).verdict is Verdict.RESTART  # type: ignore[attr-defined]
    second = _decide(suspect="node-1", hangs={"node-1": 1})
    assert (second.verdict, second.blamed) == (Verdict.EVICT, "node-1")  # type: ignore[attr-defined]
    # No suspect: nobody is charged, not even a reporter that hung before (it may be the victim).
    alone = _decide(suspect="", hangs={"node-0": 1})
    assert (alone.verdict, alone.blamed) == (Verdict.RESTART, "")  # type: ignore[attr-defined]


def test_a_flight_recorder_dump_is_summed_up_by_where_each_group_waits() -> None:
    dump = {
        "entries": [{"collective_seq_id": 1}, {"collective_seq_id": 2}],
        "pg_status": {
            "1": {"last_enqueued_collective": 7, "last_completed_collective": 7},
            "0": {"last_enqueued_collective": "2", "last_completed_collective": "1"},
        },
    }
    assert hang.flight_recorder_summary(json.dumps(dump)) == (
        "flight recorder: 2 entries; pg 0 enqueued #2, completed #1; pg 1 enqueued #7, completed #7"
    )
    cut = json.dumps(dump)[:20] + "\n... (cut)"
    assert hang.flight_recorder_summary(cut) == f"flight recorder: {len(cut)} characters, cut"
    failed = json.dumps({"error": "RuntimeError: no process group"})
    assert hang.flight_recorder_summary(failed) == "flight recorder: none (RuntimeError: no process group)"
    assert hang.flight_recorder_summary("[1, 2]") == "flight recorder: not a dump"
    assert hang.flight_recorder_summary('{"pg_status": {"0": 5}}') == "flight recorder: 0 entries"
