"""The collective a late rank waits in, read from torch's flight recorder (phalanx.flight). The lookout's
decisions are driven by functions standing for torch and the ring (pure logic); the whole path runs in a real
two-rank gloo job of an unmodified loop under phalanx-run's instrumentation, whose hooks are on for a sampled
step only: the rank blocked in an all-reduce its peer never enters shows it open in its ring, numbered as c10d
numbers it, from when it was issued; the peer shows the newest collective it entered; the master's suspects
name the peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import flight
from phalanx.api import beacon
from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker
from phalanx.api.ports import free_port
from phalanx.diagnostics import hang

ROOT = Path(__file__).resolve().parents[2]


def _entry(seq: int, *, retired: bool, group: str = "0", issued_ns: int = 0) -> flight.Entry:
    issued = issued_ns or seq * 1000
    return flight.Entry(group=group, seq=seq, op="all_reduce", issued_ns=issued, retired=retired)


class _World:
    """torch and the ring as the lookout sees them, set by the test."""

    def __init__(self) -> None:
        self.progress = 0
        self.seqs: dict[str, int] = {"0": 0}
        self.entries: list[flight.Entry] = []
        self.reads = 0
        self.written: list[tuple[str, int, int, int]] = []  # (group, seq, start, end or 0)

    def read(self) -> list[flight.Entry]:
        self.reads += 1
        return list(self.entries)

    def begin(self, e: flight.Entry, group: str) -> int:
        self.written.append((group, e.seq, e.issued_ns, 0))
        return len(self.written) - 1

    def end(self, token: int, unix_ns: int) -> None:
        group, seq, start, _ = self.written[token]
        self.written[token] = (group, seq, start, unix_ns)

    def lookout(self) -> flight.Lookout:
        return flight.Lookout(
            progress=lambda: self.progress,
            seqs=lambda: self.seqs,
            read=self.read,
            group_of={"0": "pg:0,1"}.get,
            begin=self.begin,
            end=self.end,
        )


def test_parse_keeps_what_a_dump_says_and_skips_what_it_cannot_read() -> None:
    dump = {
        "entries": [
            {
                "process_group": ["0", "default_pg"],
                "collective_seq_id": 7,
                "profiling_name": "gloo:all_reduce",
                "time_created_ns": 123,
                "retired": False,
            },
            {"process_group": ["0"], "collective_seq_id": "x"},
            {"collective_seq_id": 8},
        ]
    }
    assert flight.parse(json.dumps(dump)) == [_entry(7, retired=False, issued_ns=123)]
    assert flight.parse(b"not json") == []
    assert flight.parse("[1, 2]") == []


def test_the_oldest_unretired_collective_is_the_one_waited_in() -> None:
    entries = [_entry(5, retired=True), _entry(6, retired=False), _entry(7, retired=False)]
    assert flight.waiting(entries) == {"0": entries[1]}
    assert flight.newest(entries) == {"0": entries[2]}


def test_a_rank_making_progress_is_never_read() -> None:
    w = _World()
    look = w.lookout()
    for i in range(100):  # 10 s of 0.1 s ticks, a step each
        w.progress += 1
        w.seqs["0"] += 2
        look.tick(i * 0.1, 0)
    assert w.reads == 0


def test_a_late_rank_in_a_collective_shows_it_open_from_its_issue_and_closes_it_on_progress() -> None:
    w, t = _World(), 0.0
    look = w.lookout()
    for _ in range(10):  # steps every 0.1 s
        t += 0.1
        w.progress += 1
        look.tick(t, 0)
    w.seqs["0"], w.entries = 9, [_entry(8, retired=True), _entry(9, retired=False)]
    look.tick(t + 0.5, 0)
    assert w.reads == 0, "not late yet"
    look.tick(t + flight.LATE_MIN_S + 0.01, 0)
    assert w.reads == 1
    assert w.written == [("pg:0,1", 9, 9000, 0)], "the one waited in, open since its issue"
    look.tick(t + flight.LATE_MIN_S + 0.5, 0)
    assert w.reads == 1, "read again only once a rescan is due"
    look.tick(t + flight.LATE_MIN_S + flight.RESCAN_S + 0.02, 0)
    assert w.reads == 2, "an open interval of ours is read again: it may have completed"
    assert w.written == [("pg:0,1", 9, 9000, 0)], "nothing written twice"
    w.progress += 1
    look.tick(t + 5, 77)
    assert w.written == [("pg:0,1", 9, 9000, 77)], "progress closes it"


def test_a_late_rank_outside_collectives_shows_the_newest_it_entered_and_is_not_read_again() -> None:
    w = _World()
    look = w.lookout()
    look.tick(0.0, 0)
    w.seqs["0"], w.entries = 4, [_entry(3, retired=True), _entry(4, retired=True)]
    look.tick(2.0, 0)
    assert w.written == [("pg:0,1", 4, 4000, 4000)], "entered: an interval of no length at its issue"
    for t in (4.0, 6.0, 30.0):
        look.tick(t, 0)
    assert w.reads == 1, "nothing issued since, nothing of ours open: no read"
    w.seqs["0"], w.entries = 5, [*w.entries, _entry(5, retired=True)]
    look.tick(32.0, 0)
    assert w.reads == 2
    assert w.written[-1] == ("pg:0,1", 5, 5000, 5000)


def test_lateness_is_learned_from_the_gaps_between_progress() -> None:
    w = _World()
    look = w.lookout()
    for i in range(5):  # a 30 s step
        w.progress += 1
        look.tick(30.0 * i, 0)
    assert look.late_after() == pytest.approx(45.0)
    w.seqs["0"] = 1
    look.tick(120 + 40, 0)
    assert w.reads == 0
    look.tick(120 + 46, 0)
    assert w.reads == 1


def test_a_group_gone_is_not_written() -> None:
    w = _World()
    look = w.lookout()
    look.tick(0.0, 0)
    w.seqs, w.entries = {"9": 1}, [_entry(1, retired=False, group="9")]
    look.tick(2.0, 0)
    assert w.reads == 1
    assert w.written == []


# ---- the real thing ---------------------------------------------------------------------------------------


@pytest.fixture
def rings(tmp_path: Path) -> Iterator[list[Path]]:
    paths = [Path("/dev/shm") / f"phalanx-test-flight-{os.getpid()}-{rank}" for rank in (0, 1)]
    for p in paths:
        ring.create(p)
    yield paths
    for p in paths:
        p.unlink(missing_ok=True)


def _read(reader: ring.RingReader, tracker: Tracker, records: list[ring.Record]) -> None:
    batch = reader.read()
    records.extend(batch.records)
    tracker.feed(batch)


def test_a_rank_blocked_in_an_all_reduce_its_peer_never_enters_shows_it_from_the_flight_recorder(
    rings: list[Path], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 15):
        pytest.skip(f"torch {torch.__version__} keeps no flight recorder of gloo's collectives")
    steps, ready = 60, tmp_path / "ready"
    base = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "2000",  # as the agent sets it
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    procs = []
    for rank, path in enumerate(rings):
        beacon_file = tmp_path / f"beacon-{rank}"
        beacon.create(beacon_file)
        env = {**base, "RANK": str(rank), ring.ENV_VAR: str(path), beacon.ENV_VAR: str(beacon_file)}
        worker = ROOT / "tests" / "agent" / "flight_worker.py"
        procs.append(subprocess.Popen([sys.executable, str(worker), str(ready), str(steps)], env=env))
    readers = [ring.RingReader(p) for p in rings]
    trackers = [Tracker(), Tracker()]
    records: list[list[ring.Record]] = [[], []]
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{ready}-{r}").exists() for r in (0, 1)):
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the ranks never finished their steps"
            for r in (0, 1):
                _read(readers[r], trackers[r], records[r])
            time.sleep(0.05)
        seq = int(Path(f"{ready}-0").read_text())
        stopped_at = time.time_ns()
        deadline = time.monotonic() + 15
        while trackers[0].current() is None or trackers[1].entered.get("pg:0,1", 0) < seq - 1:
            assert time.monotonic() < deadline, (trackers[0].activity(), trackers[1].activity())
            time.sleep(0.1)
            for r in (0, 1):
                _read(readers[r], trackers[r], records[r])
        seen_at = time.time_ns()
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    current = trackers[0].current()
    assert current is not None
    assert (current.name, current.group, current.number) == ("all_reduce", "pg:0,1", seq)
    assert current.unix_ns < stopped_at + 200_000_000, "open since it was issued, not since it was read"
    assert seen_at - stopped_at < 5e9, "read within seconds: long before the 10 s floor of a verdict"
    assert trackers[1].current() is None
    assert trackers[1].entered["pg:0,1"] == seq - 1
    # the hooks were on for a sampled step only, numbered as c10d numbers (2 all-reduces a step)
    hooked = [r for r in records[0] if r.kind == ring.BEGIN and r.group == "pg:0,1" and r.number < seq]
    assert 0 < len(hooked) < steps, len(hooked)
    assert {r.number % 2 for r in hooked} == {0, 1}
    suspects = hang.find_suspects({0: trackers[0].activity(), 1: trackers[1].activity()})
    assert suspects is not None
    assert (suspects.op, suspects.group, suspects.seq, suspects.ranks) == ("all_reduce", "pg:0,1", seq, [1])


def test_step_and_collective_times_are_medians_over_the_same_sampled_steps() -> None:
    """A plain script's collectives are timed one step in a while: the step time the straggler scores pair
    with the time in collectives is that of the same steps, not of every step."""
    records: list[ring.Record] = []

    def add(kind: int, at_ms: float, number: int, name: str = "", group: str = "") -> None:
        records.append(ring.Record(len(records), kind, name, group, number, int(at_ms * 1e6), False))

    t = 0.0
    for step in range(40):
        sampled = step % 10 == 5
        if sampled:  # a slow sampled step: 30 ms, 10 of them in an all-reduce
            add(ring.BEGIN, t + 10, step, "all_reduce", "pg:0,1")
            add(ring.END, t + 20, step, "all_reduce", "pg:0,1")
        t += 30 if sampled else 10
        add(ring.MARK, t, step)
    tracker = Tracker()
    in_order = sorted(records, key=lambda r: r.unix_ns)
    tracker.feed(ring.Batch(records=in_order, lost=0, last_record_ns=0, pid=1))
    act = tracker.activity()
    assert act.step_time_s == pytest.approx(0.030)
    assert act.collective_time_s == pytest.approx(0.010)
    unsampled = Tracker()
    unsampled.feed(ring.Batch(records=[r for r in records if not r.group], lost=0, last_record_ns=0, pid=1))
    assert unsampled.activity().step_time_s == pytest.approx(0.010)
    assert unsampled.activity().collective_time_s == 0


def test_torch_releases_are_read_for_the_lookouts_floor() -> None:
    assert flight._release("2.15.0+cu132") == (2, 15)
    assert flight._release("2.16.0a0+git1234") == (2, 16)
    assert flight._release("2.14.1") < flight.FIRST_RECORDING_TORCH
    assert flight._release("garbage") == (0, 0)
