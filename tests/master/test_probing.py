"""Probe rounds driven with an injected clock: scheduling, RUN_PROBE actions, timeouts, verdicts turned
into evictions, the eviction budget, stale reports. No sockets, no sleeps."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.api import settings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.errors import RequestError
from phalanx.master.job import Job
from phalanx.master.job.probes import PROBE_KINDS, STEPLESS_PROBE_AFTER_S, round_kinds

from .sim import Sim, kinds

NODES = ("a", "b", "c", "d")


def make(*, n: int = 4, max_evictions: int = 3, **probes: Any) -> Sim:
    sim = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": n, "last_call_s": 1.0},
        heartbeat={"timeout_s": 30.0},
        restart={"max_evictions": max_evictions},
        probes={"enabled": True, "timeout_s": 10.0, **probes},
    )
    sim.form(*NODES[:n])
    assert sim.job.phase == "Running"
    return sim


def probe_actions(sim: Sim, node: str) -> list[pb.Action]:
    return [a for a in sim.hb(node) if a.kind == pb.ACTION_KIND_RUN_PROBE]


def report(
    sim: Sim, node: str, kind: int, measurements: list[pb.ProbeMeasurement], *, probe_round: int
) -> None:
    req = pb.ReportProbeRequest(
        node_id=node,
        incarnation=sim.inc[node],
        probe=kind,
        measurements=measurements,
        probe_round=probe_round,
    )
    sim.job.report_probe(req, now=sim.now)


def matmul(sim: Sim, node: str, rate: float, *, probe_round: int, ok: bool = True) -> None:
    m = pb.ProbeMeasurement(ok=ok, rate=rate, elapsed_s=1.0, error="" if ok else "wrong result")
    report(sim, node, pb.PROBE_KIND_MATMUL, [m], probe_round=probe_round)


def allgather(sim: Sim, node: str, rates: dict[str, float], *, probe_round: int) -> None:
    ms = [pb.ProbeMeasurement(peer_node_id=p, ok=True, rate=r, elapsed_s=1.0) for p, r in rates.items()]
    report(sim, node, pb.PROBE_KIND_ALLGATHER, ms, probe_round=probe_round)


def ring_rates(
    members: list[str], slow: str = "", *, good: float = 10.0, bad: float = 1.0
) -> dict[str, dict[str, float]]:
    """Each node's pairwise bandwidth to its ring neighbours; pairs with ``slow`` get ``bad``."""
    out: dict[str, dict[str, float]] = {m: {} for m in members}
    w = len(members)
    for i in range(w):
        a, b = members[i], members[(i + 1) % w]
        rate = bad if slow in (a, b) else good
        out[a][b] = rate
        out[b][a] = rate
    return out


def good_round(
    sim: Sim, probe_round: int, *, slow_matmul: str = "", failed: str = "", silent: str = ""
) -> None:
    members = sim.job.members
    rates = ring_rates(members)
    for node in members:
        if node == silent:
            continue
        if node == failed:
            matmul(sim, node, 0.0, probe_round=probe_round, ok=False)
        else:
            matmul(sim, node, 2.0 if node == slow_matmul else 10.0, probe_round=probe_round)
        allgather(sim, node, rates[node], probe_round=probe_round)


def test_probe_round_sends_tagged_matmul_and_pairwise_allgather_to_every_member() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    members = sim.job.members
    store = sim.job.round
    assert store is not None
    for node in members:
        acts = probe_actions(sim, node)
        assert [a.probe for a in acts] == [pb.PROBE_KIND_MATMUL, pb.PROBE_KIND_ALLGATHER]
        assert all(a.probe_round == probe.id and a.round == sim.job.round_number for a in acts)
        gather = acts[1]
        assert list(gather.probe_group) == members
        assert (gather.probe_store_addr, gather.probe_store_port) == (store.store_host, store.store_port + 1)
        assert probe_actions(sim, node) == []  # sent once
    assert sim.job.status().probe.result == "running"
    with pytest.raises(RequestError, match="still running"):
        sim.job.start_probe(now=sim.now, trigger="again")


def test_single_member_round_probes_matmul_only() -> None:
    sim = make(n=1)
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    assert [a.probe for a in probe_actions(sim, "a")] == [pb.PROBE_KIND_MATMUL]
    matmul(sim, "a", 5.0, probe_round=probe.id)
    assert probe.result == "ok"


def test_disabled_or_no_round_refuses() -> None:
    sim = Sim(probes={"enabled": False})
    with pytest.raises(RequestError, match="disabled"):
        sim.job.start_probe(now=sim.now, trigger="test")
    sim = Sim(probes={"enabled": True})
    with pytest.raises(RequestError, match="no rendezvous round"):
        sim.job.start_probe(now=sim.now, trigger="test")


def test_all_good_results_end_the_round_ok_without_evictions() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id)
    assert probe.result == "ok"
    assert sim.job.evictions == []
    assert sim.job.stats.probe_rounds == {"ok": 1}
    assert sim.job.events.of_kind("probe_finished")[0].message.startswith("ok")


def test_failed_matmul_evicts_the_node_and_reopens_the_round() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id, failed="c")
    assert probe.result == "evicted"
    assert probe.evicted == ["c"]
    ev = sim.job.evictions[0]
    assert (ev.node_id, ev.kind) == ("c", "probe_failed")
    assert "wrong result" in ev.reason
    assert sim.job.stats.evictions == {"probe_failed": 1}
    assert sim.job.events.of_kind("probe_failed")[0].node == "c"
    assert sim.job.phase == "Restarting"
    assert kinds(sim.hb("c")) == ["EXIT"]
    assert kinds(sim.hb("a")) == ["REJOIN"]


def next_probe(sim: Sim) -> Any:
    """The probe round the master starts on its next tick."""
    before = sim.job.probe
    sim.at(sim.now + 0.1)
    assert sim.job.probe is not before, "no probe round started"
    return sim.job.probe


def test_slow_matmul_is_a_straggler_once_a_second_round_confirms_it() -> None:
    sim = make()
    first = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, first.id, slow_matmul="b")
    assert (first.result, first.evicted, sim.job.evictions) == ("suspects", [], [])
    assert sim.job.status().unconfirmed_stragglers == {"b": 1}
    [event] = sim.job.events.of_kind("probe_finished")
    assert event.message == "suspects: 1 verdict(s); b slow, to be confirmed"
    second = next_probe(sim)
    assert second.trigger == "confirming b (slow in 1 of 2 rounds)"
    good_round(sim, second.id, slow_matmul="b")
    assert second.evicted == ["b"]
    assert sim.job.evictions[0].kind == "straggler"
    assert sim.job.stats.evictions == {"straggler": 1}
    events = sim.job.events.of_kind("straggler")
    assert [e.node for e in events] == ["b", "b"]
    assert events[0].message.startswith("high confidence")
    assert sim.job.status().unconfirmed_stragglers == {}


def test_a_node_slow_in_one_round_only_is_not_evicted() -> None:
    sim = make()
    first = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, first.id, slow_matmul="b")
    second = next_probe(sim)
    good_round(sim, second.id)  # a busy host measured slow once
    assert second.result == "ok"
    assert sim.job.evictions == []
    assert sim.job.status().unconfirmed_stragglers == {}
    sim.at(sim.now + 0.1)
    assert sim.job.probe is second  # nothing left to confirm: no third round


def test_an_inconclusive_round_confirms_nothing_and_starts_no_other() -> None:
    sim = make()
    first = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, first.id, slow_matmul="b")
    second = next_probe(sim)
    sim.at(sim.now + 11.0)  # nobody reports: the probe setup broke
    assert second.result == "inconclusive"
    assert sim.job.status().unconfirmed_stragglers == {}
    sim.at(sim.now + 0.1)
    assert sim.job.probe is second


def test_one_confirm_round_evicts_on_the_first_verdict() -> None:
    sim = make(stragglers={"confirm_rounds": 1})
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id, slow_matmul="b")
    assert probe.evicted == ["b"]


def test_slow_link_node_is_isolated_by_its_two_bad_pairs() -> None:
    sim = make()
    for _ in range(2):
        probe = sim.job.start_probe(now=sim.now, trigger="test") if sim.job.probe is None else next_probe(sim)
        members = sim.job.members
        rates = ring_rates(members, slow="d")
        for node in members:
            matmul(sim, node, 10.0, probe_round=probe.id)
            allgather(sim, node, rates[node], probe_round=probe.id)
    assert probe.evicted == ["d"]
    assert sim.job.evictions[0].kind == "straggler"


def test_timeout_fails_the_silent_node() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    t0 = sim.now
    good_round(sim, probe.id, silent="b")
    sim.at(t0 + 9.9)
    for node in sim.job.members:
        sim.hb(node)
    assert probe.result == "running"
    sim.at(t0 + 10.0)
    assert probe.result == "evicted"
    assert probe.evicted == ["b"]
    assert "no matmul probe report within 10s" in sim.job.evictions[0].reason


def test_nobody_reporting_is_inconclusive_and_evicts_nobody() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    sim.at(sim.now + 11.0)
    assert probe.result == "inconclusive"
    assert sim.job.evictions == []
    assert sim.job.stats.probe_rounds == {"inconclusive": 1}


def test_most_members_failing_is_inconclusive() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    members = sim.job.members
    rates = ring_rates(members)
    for i, node in enumerate(members):
        matmul(sim, node, 10.0, probe_round=probe.id, ok=i == 0)
        allgather(sim, node, rates[node], probe_round=probe.id)
    assert probe.result == "inconclusive"
    assert sim.job.evictions == []
    assert len(sim.job.events.of_kind("probe_failed")) == 3  # the verdicts are still told


def test_one_of_two_members_failing_is_evicted() -> None:
    sim = make(n=2)
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id, failed="b")
    assert probe.evicted == ["b"]


def test_spent_budget_keeps_the_suspect_and_the_job() -> None:
    sim = make(max_evictions=0)
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id, failed="a")
    assert probe.result == "suspects"
    assert sim.job.evictions == []
    assert sim.job.phase == "Running"
    assert sim.job.nodes["a"].status == "alive"


def test_stale_and_duplicate_reports_are_ignored() -> None:
    sim = make()
    first = sim.job.start_probe(now=sim.now, trigger="one")
    good_round(sim, first.id)
    assert first.result == "ok"
    second = sim.job.start_probe(now=sim.now, trigger="two")
    assert second.id == first.id + 1
    # a late failure from the first round must not count in the second
    matmul(sim, "a", 0.0, probe_round=first.id, ok=False)
    assert "a" not in second.reports.get("matmul", {})
    matmul(sim, "a", 10.0, probe_round=second.id)
    matmul(sim, "a", 0.0, probe_round=second.id, ok=False)  # duplicate
    assert second.reports["matmul"]["a"][0].ok
    assert second.stale_reports == 2
    assert sim.job.stats.probe_reports_stale == 2
    # untagged (0) reports count for the running round
    matmul(sim, "b", 10.0, probe_round=0)
    assert "b" in second.reports["matmul"]
    # the node view still shows what was reported last, tagged
    assert sim.job.nodes["a"].probes["matmul"][0].probe_round == second.id


def test_on_round_complete_schedules_one_round_per_rendezvous_round() -> None:
    sim = make(on_round_complete=True)
    sim.at(sim.now + 0.1)
    probe = sim.job.probe
    assert probe is not None
    assert probe.trigger == "rendezvous round 1 completed"
    good_round(sim, probe.id)
    sim.at(sim.now + 0.1)
    assert sim.job.probe is probe  # no second round for the same rendezvous round
    sim.fail("a", msg="boom")  # restart in place: rendezvous round 2
    for node in sim.job.members:
        sim.join(node)
    sim.at(sim.now + 1.5)
    assert sim.job.round_number == 2
    sim.at(sim.now + 0.1)
    assert sim.job.probe is not probe
    assert sim.job.probe is not None
    assert sim.job.probe.rendezvous_round == 2


def advance(sim: Sim, until: float, *, step: int | None = 1) -> None:
    """Moves the clock in 5 s steps, every member heartbeating (its worker at ``step``; None: no worker
    reports steps), so nobody is lost on the way."""
    while sim.now < until:
        sim.at(min(until, sim.now + 5.0))
        beat(sim, step=step)


def beat(sim: Sim, *, step: int | None) -> None:
    """One heartbeat of every member, then the master's tick, which sees the steps."""
    for node in sim.job.members:
        sim.hb(node, step=step)
    sim.at(sim.now)


def test_interval_schedules_periodic_rounds() -> None:
    sim = make(interval_s=60.0)
    beat(sim, step=0)  # the round trains from its start
    t0 = sim.now
    advance(sim, t0 + 55.0)
    assert sim.job.probe is None
    advance(sim, t0 + 61.0)
    probe = sim.job.probe
    assert probe is not None
    assert probe.trigger == "every 60s"
    good_round(sim, probe.id)
    advance(sim, t0 + 115.0)
    assert sim.job.probe is probe
    advance(sim, t0 + 125.0)
    assert sim.job.probe is not probe


def test_a_round_re_formed_after_an_eviction_is_probed_interval_s_after_its_first_step() -> None:
    # The processes of a re-formed round start beside the replacement's (import torch, load a checkpoint);
    # measured then, a healthy node looks slow (a confirming round right after would evict it). The wait
    # counts from the round's first step, however long the start takes.
    sim = make(interval_s=20.0)
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    good_round(sim, probe.id, failed="c")
    assert probe.evicted == ["c"]
    advance(sim, sim.now + 15.0)  # the replacement comes late
    sim.form("a", "b", "d", "e")
    assert sim.job.phase == "Running"
    formed = sim.now
    advance(sim, formed + 40.0, step=-1)  # a slow start: the new processes have not stepped yet
    assert sim.job.probe is probe
    advance(sim, formed + 55.0)  # the first step at +45 s
    assert sim.job.probe is probe
    advance(sim, formed + 66.0)
    assert sim.job.probe is not probe
    assert sim.job.probe.trigger == "every 20s"


def test_a_round_whose_ranks_report_no_step_is_probed_from_a_while_after_it_completed() -> None:
    sim = make(interval_s=20.0)
    formed = sim.now
    advance(sim, formed + STEPLESS_PROBE_AFTER_S + 15.0, step=None)
    assert sim.job.probe is None
    advance(sim, formed + STEPLESS_PROBE_AFTER_S + 21.0, step=None)
    assert sim.job.probe is not None
    assert sim.job.probe.trigger == "every 20s"


def test_rendezvous_change_aborts_the_probe_round() -> None:
    sim = make()
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    sim.fail("a", msg="boom")
    sim.at(sim.now + 0.1)
    assert probe.result == "aborted"
    matmul(sim, "b", 0.0, probe_round=probe.id, ok=False)  # late: ignored
    assert sim.job.evictions == []


def test_probe_ids_survive_a_master_restart() -> None:
    sim = make()
    sim.job.start_probe(now=sim.now, trigger="test")
    saved = sim.job.durable()
    resumed = Job(settings=sim.job.settings, now=sim.now, saved=saved)
    assert resumed.next_probe == 2


@pytest.mark.parametrize(
    ("configured", "members", "expected"),
    [
        (("matmul", "allgather"), 4, ("matmul", "allgather")),
        (("matmul", "allgather"), 1, ("matmul",)),
        (("matmul",), 4, ("matmul",)),
        (("allgather",), 2, ("allgather",)),
        (("allgather",), 1, ()),
    ],
)
def test_round_kinds_are_the_configured_ones_allgather_only_in_pairs(
    configured: tuple[str, ...], members: int, expected: tuple[str, ...]
) -> None:
    assert round_kinds(configured=configured, members=members) == expected


def test_the_master_knows_every_kind_the_settings_accept() -> None:
    assert sorted(PROBE_KINDS.values()) == sorted(settings.PROBE_KINDS)


def test_matmul_only_round_sends_and_waits_for_matmul_only() -> None:
    sim = make(kinds="matmul", stragglers={"confirm_rounds": 1})
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    assert probe.kinds == ("matmul",)
    for node in sim.job.members:
        assert [a.probe for a in probe_actions(sim, node)] == [pb.PROBE_KIND_MATMUL]
    rates = ring_rates(sim.job.members)
    allgather(sim, "a", rates["a"], probe_round=probe.id)  # not asked for: stale
    assert probe.stale_reports == 1
    for node in sim.job.members:
        matmul(sim, node, 2.0 if node == "c" else 10.0, probe_round=probe.id)
    assert probe.result == "evicted"  # complete without any all-gather report
    assert probe.evicted == ["c"]
    assert set(probe.view().reported) == {"matmul"}


def test_allgather_only_round_sends_and_judges_allgather_only() -> None:
    sim = make(kinds="allgather", stragglers={"confirm_rounds": 1})
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    members = sim.job.members
    for node in members:
        acts = probe_actions(sim, node)
        assert [a.probe for a in acts] == [pb.PROBE_KIND_ALLGATHER]
        assert list(acts[0].probe_group) == members
    matmul(sim, "a", 0.0, probe_round=probe.id, ok=False)  # a failure nobody asked for evicts nobody
    assert probe.stale_reports == 1
    rates = ring_rates(members, slow="d")
    for node in members:
        allgather(sim, node, rates[node], probe_round=probe.id)
    assert probe.evicted == ["d"]
    assert {v.kind for v in probe.verdicts} == {"slow_link"}


def test_allgather_only_on_one_node_starts_no_round() -> None:
    sim = make(n=1, kinds="allgather", on_round_complete=True, interval_s=5.0)
    with pytest.raises(RequestError, match=r"no probe of probes.kinds='allgather' runs on 1 node\(s\)"):
        sim.job.start_probe(now=sim.now, trigger="test")
    advance(sim, sim.now + 12.0)  # neither trigger starts a round that would measure nothing
    assert sim.job.probe is None
