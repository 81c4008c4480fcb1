"""What the master keeps of the ranks' intervals (phalanx.master.state.timeline): pure logic on real protobuf
messages, and the pure trace builder of ``phalanx timeline``."""

from __future__ import annotations

import time
import tracemalloc

from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb
from phalanx.cli.timeline import flight_recorder_dumps, png_size, trace_events
from phalanx.master.state.beat import read_ranks
from phalanx.master.state.events import EventLog
from phalanx.master.state.timeline import MAX_TRACED_FAILURES, MIN_PER_RANK, Timeline

NS = 1_000_000_000
NOW = 1_800_000_000.0


def iv(name: str, start: float, end: float = 0.0, *, seq: int = 1, group: str = "dp:0,1") -> pb.Interval:
    return pb.Interval(
        name=name,
        group="" if name == "step" else group,
        seq=seq,
        start_unix_ns=int(start * NS),
        end_unix_ns=int(end * NS),
    )


def progress(
    rank: int, *intervals: pb.Interval, pid: int = 100, current: pb.Interval | None = None
) -> pb.RankProgress:
    p = pb.RankProgress(rank=rank, local_rank=rank % 2, step=1, pid=pid, intervals=list(intervals))
    if current is not None:
        p.activity.current.CopyFrom(current)
    elif intervals:
        p.activity.SetInParent()  # as a recorder's rank sends its intervals: with its activity
    return p


def observe(tl: Timeline, node_id: str, ranks: list[pb.RankProgress], *, now: float) -> None:
    """What the job's writer hands the timeline of one heartbeat of ``node_id`` with these ranks."""
    tl.observe(node_id, read_ranks(pb.HeartbeatRequest(ranks=ranks)), now=now)


def spans(tl: Timeline, node: str = "node-0", rank: int = 0, *, now: float = NOW) -> list[dict]:
    answer = tl.window(start=now - 1000, end=now + 1000, now=now, node=node, rank=rank)
    return answer["ranks"][0]["intervals"] if answer["ranks"] else []


def test_an_interval_sent_open_then_closed_is_one_interval() -> None:
    tl = Timeline()
    observe(tl, "node-0", [progress(0, iv("all_reduce", NOW - 2))], now=NOW - 1.9)
    assert [s["open"] for s in spans(tl)] == [True]
    # The recorder's view of the same collective, also as the rank's current activity: still one.
    observe(tl, "node-0", [progress(0, current=iv("all_reduce", NOW - 2))], now=NOW - 1.5)
    observe(tl, "node-0", [progress(0, iv("all_reduce", NOW - 2, NOW - 1))], now=NOW)
    kept = spans(tl)
    assert len(kept) == 1
    assert kept[0]["end_unix_ns"] == int((NOW - 1) * NS)
    assert not kept[0]["open"]


def test_garbage_is_refused_and_names_are_cut_without_refusing_the_beat() -> None:
    tl = Timeline()
    good = iv("all_gather", NOW - 3, NOW - 2)
    garbage = [
        iv("bad\x00name", NOW - 3, NOW - 2),  # unprintable
        iv("all_reduce", NOW - 3, NOW - 4),  # ends before it starts
        iv("all_reduce", NOW + 3600),  # far in the future
        iv("all_reduce", NOW - 86_400, NOW - 86_399),  # far older than the master keeps
        iv("", NOW - 3, NOW - 2),  # no name
        pb.Interval(name="x", seq=-5, start_unix_ns=int((NOW - 3) * NS)),  # negative seq
        pb.Interval(name="x", seq=1, start_unix_ns=-1),
    ]
    long_name = iv("n" * 500, NOW - 3, NOW - 2, group="g" * 500)
    observe(tl, "node-0", [progress(0, *garbage, good, long_name)], now=NOW)
    kept = spans(tl)
    assert [s["name"][:10] for s in kept] == ["all_gather", "n" * 10]
    assert len(kept[1]["name"]) == limits.MAX_NAME_CHARS
    assert len(kept[1]["group"]) == limits.MAX_NAME_CHARS
    assert tl.refused == len(garbage)
    # Negative ranks are not a series.
    observe(tl, "node-0", [progress(-1, good)], now=NOW)
    assert {(r["node"], r["rank"]) for r in tl.window(start=0, end=2 * NOW, now=NOW)["ranks"]} == {
        ("node-0", 0)
    }


def test_a_beat_keeps_only_the_newest_intervals_allowed_per_beat() -> None:
    tl = Timeline()
    many = [iv("step", NOW - 100 + i * 0.01, NOW - 100 + i * 0.01 + 0.005, seq=i) for i in range(300)]
    observe(tl, "node-0", [progress(0, *many)], now=NOW)
    kept = spans(tl)
    assert len(kept) == limits.MAX_INTERVALS_PER_BEAT
    assert kept[-1]["seq"] == 299
    assert tl.refused == 300 - limits.MAX_INTERVALS_PER_BEAT


def test_old_intervals_age_out_and_silent_ranks_are_dropped() -> None:
    tl = Timeline(max_age_s=10)
    observe(tl, "node-0", [progress(0, iv("step", NOW - 12, NOW - 11, seq=1))], now=NOW - 10.5)
    observe(tl, "node-1", [progress(1, iv("step", NOW - 12, NOW - 11, seq=1))], now=NOW - 10.5)
    observe(tl, "node-0", [progress(0, iv("step", NOW - 1, NOW - 0.5, seq=2))], now=NOW)
    assert [s["seq"] for s in spans(tl)] == [2]
    tl.sweep(now=NOW)
    assert [r["node"] for r in tl.window(start=0, end=2 * NOW, now=NOW)["ranks"]] == ["node-0"]
    assert tl.total == 1


def test_many_ranks_share_the_budget_and_memory_stays_bounded() -> None:
    """1,000 ranks each sending more than their share of the budget: every rank keeps its share and the
    memory per kept interval is small enough that the default budget bounds the master's memory."""
    budget = 40_000
    tl = Timeline(budget=budget, per_rank=4096)
    beats = [
        (
            f"node-{node}",
            [
                progress(
                    node * 4 + r,
                    *[
                        iv("all_reduce", NOW - 30 + i * 1e-3, NOW - 30 + i * 1e-3 + 5e-4, seq=i)
                        for i in range(70)
                    ],
                )
                for r in range(4)
            ],
        )
        for node in range(250)
    ]
    tracemalloc.start()
    try:
        for node_id, ranks in beats:
            observe(tl, node_id, ranks, now=NOW)
        # The first ranks kept more while they were fewer; their next beat trims them to the share.
        assert tl.total > 1000 * tl.cap()
        for node_id, ranks in beats:
            observe(tl, node_id, [progress(r.rank) for r in ranks], now=NOW)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    cap = tl.cap()
    assert cap == MIN_PER_RANK  # 40,000 / 1,000 ranks is below the floor
    assert tl.total == 1000 * cap
    assert all(len(r["intervals"]) == cap for r in tl.window(start=0, end=2 * NOW, now=NOW)["ranks"])
    per_interval = used / tl.total
    assert per_interval < 300, per_interval
    # The default budget at this size per interval: the master's bound for any number of ranks.
    assert Timeline().budget * per_interval < 100 * 2**20


def test_a_restarted_process_leaves_its_open_intervals_unfinished() -> None:
    tl = Timeline()
    observe(tl, "node-0", [progress(0, iv("all_reduce", NOW - 5), pid=100)], now=NOW - 4)
    observe(tl, "node-0", [progress(0, iv("step", NOW - 1, NOW - 0.5, seq=9), pid=200)], now=NOW)
    first, second = spans(tl)
    assert first["unfinished"]
    assert first["end_unix_ns"] == int((NOW - 4) * NS)
    assert not second["unfinished"]


def test_a_process_restarted_without_a_recorder_still_ends_what_the_old_one_left_open() -> None:
    """A beat with no intervals and no activity is passed over only for a node none of whose ranks has a
    series: here rank 0's new process (pid 200) records nothing, and its beat still closes the old one's."""
    tl = Timeline()
    observe(tl, "node-0", [progress(0, iv("all_reduce", NOW - 5), pid=100)], now=NOW - 4)
    observe(tl, "node-0", [progress(0, pid=200)], now=NOW)
    (left,) = spans(tl)
    assert left["unfinished"]
    assert left["end_unix_ns"] == int((NOW - 4) * NS)


def test_a_node_whose_series_were_swept_is_passed_over_again() -> None:
    tl = Timeline(max_age_s=60)
    observe(tl, "node-0", [progress(0, iv("step", NOW - 2, NOW - 1), pid=100)], now=NOW)
    later = NOW + 600
    observe(tl, "node-1", [progress(1, iv("step", later - 2, later - 1))], now=later)  # sweeps node-0
    observe(tl, "node-0", [progress(0, pid=200)], now=later)
    assert spans(tl, now=later) == []
    assert tl.window(start=0, end=2 * later, now=later)["ranks"][0]["node"] == "node-1"


def test_failures_are_remembered_with_their_event_seq_as_id() -> None:
    tl = Timeline()
    log = EventLog()
    log.add("round_complete", now=NOW - 9)
    failure = log.add("failure", now=NOW - 5, node="node-1", rank=3, message="rank 3 exited 1")
    tl.note_event(log.since(0)[0])
    tl.note_event(failure)
    assert tl.failure(failure.seq) == {
        "id": failure.seq,
        "unix": NOW - 5,
        "kind": "failure",
        "node": "node-1",
        "rank": 3,
        "round": 0,
        "message": "rank 3 exited 1",
    }
    assert [f["id"] for f in tl.failures()] == [failure.seq]
    assert tl.window(start=NOW - 4, end=NOW, now=NOW)["failures"] == []


def test_only_the_newest_hangs_keep_their_flight_recorder_dumps_and_an_answer_in_hand_is_never_changed() -> (
    None
):
    tl = Timeline()
    log = EventLog()
    held = []
    for k in range(MAX_TRACED_FAILURES + 2):
        evidence = [{"rank": 0, "side": "device", "nccl_trace": f"dump {k}"}, {"rank": 1, "side": "host"}]
        tl.note_event(log.add("failure", now=NOW - 50 + k, node="node-0", rank=0), hang=evidence)
        held.append(tl.window(start=NOW - 60, end=NOW, now=NOW)["failures"][-1])
    kept = [f["hang"][0] for f in tl.failures()]
    assert [r.get("nccl_trace") for r in kept] == [None, None] + [f"dump {k}" for k in range(2, 18)]
    assert kept[0] == {"rank": 0, "side": "device", "nccl_trace_dropped": True}
    assert tl.failures()[0]["hang"][1] == {"rank": 1, "side": "host"}
    # What an earlier answer holds (being encoded in another thread, say) is a dict the drop never touched.
    assert held[0]["hang"][0]["nccl_trace"] == "dump 0"
    # The trace names the evidence and leaves the dumps to files of their own.
    window = tl.window(start=NOW - 60, end=NOW, now=NOW)
    instants = [e for e in trace_events(window)["traceEvents"] if e["ph"] == "i"]
    assert instants[-1]["args"]["hang"] == [
        {"rank": 0, "side": "device", "nccl_trace_chars": 7},
        {"rank": 1, "side": "host"},
    ]
    assert flight_recorder_dumps(window)[-1] == (f"flight-{window['failures'][-1]['id']}-rank0", "dump 17")
    assert len(flight_recorder_dumps(window)) == MAX_TRACED_FAILURES


def test_the_trace_nests_each_ranks_slices_and_draws_open_ones_to_now() -> None:
    timeline = {
        "start_unix": NOW - 10,
        "end_unix": NOW,
        "now_unix": NOW,
        "ranks": [
            {
                "node": "node-0",
                "rank": 0,
                "local_rank": 0,
                "intervals": [
                    {
                        "name": "step",
                        "group": "",
                        "seq": 4,
                        "start_unix_ns": int((NOW - 9) * NS),
                        "end_unix_ns": int((NOW - 8) * NS),
                        "device": False,
                    },
                    # Outlasts its step (clock skew): cut at the step's end.
                    {
                        "name": "all_reduce",
                        "group": "dp",
                        "seq": 7,
                        "start_unix_ns": int((NOW - 8.5) * NS),
                        "end_unix_ns": int((NOW - 7.5) * NS),
                        "device": True,
                    },
                    {
                        "name": "all_reduce",
                        "group": "dp",
                        "seq": 8,
                        "start_unix_ns": int((NOW - 2) * NS),
                        "end_unix_ns": 0,
                        "device": False,
                    },
                ],
            }
        ],
        "failures": [
            {
                "id": 12,
                "unix": NOW - 1,
                "kind": "hang",
                "node": "node-0",
                "rank": 0,
                "round": 1,
                "message": "m",
            }
        ],
    }
    trace = trace_events(timeline)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(s["name"], s["ts"], s["dur"]) for s in slices] == [
        ("step", 1e6, 1e6),
        ("all_reduce", 1.5e6, 0.5e6),
        ("all_reduce (open)", 8e6, 2e6),
    ]
    assert slices[1]["args"]["clipped"]
    assert slices[2]["args"]["open"]
    (instant,) = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert instant["ts"] == 9e6
    assert instant["s"] == "g"
    assert png_size(1) == (1400, 300)
    assert png_size(40)[1] > png_size(10)[1]


def test_observe_is_cheap_enough_for_a_thousand_ranks() -> None:
    """One beat of 8 ranks x 256 intervals, the most a node may send, costs milliseconds."""
    tl = Timeline()
    beat = [
        progress(
            r, *[iv("all_reduce", NOW - 5 + i * 1e-3, NOW - 5 + i * 1e-3 + 5e-4, seq=i) for i in range(256)]
        )
        for r in range(8)
    ]
    start = time.perf_counter()
    observe(tl, "node-0", beat, now=NOW)
    assert time.perf_counter() - start < 0.5


def test_an_answer_holds_each_ranks_newest_share_of_its_limit() -> None:
    tl = Timeline()
    for r in range(4):
        observe(
            tl,
            "node-0",
            [progress(r, *[iv("step", NOW - 50 + i, NOW - 49.5 + i, seq=i) for i in range(40)])],
            now=NOW,
        )
    answer = tl.window(start=NOW - 100, end=NOW, now=NOW, limit=40)
    assert [[s["seq"] for s in r["intervals"]] for r in answer["ranks"]] == [list(range(30, 40))] * 4
    assert answer["omitted"] == 4 * 30
