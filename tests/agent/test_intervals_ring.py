"""Interval rings across real processes and real shared memory: the recorder in a training process writes,
the agent's reader folds the records into a RankActivity; torn reads are detected, the ring is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.api import beacon, limits
from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ring_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"phalanx-test-ring-{os.getpid()}"
    ring.create(path)
    yield path
    path.unlink(missing_ok=True)


def _run(code: str, env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, check=True, timeout=60
    )


def test_steps_and_collectives_of_another_process_become_activity(ring_path: Path, tmp_path: Path) -> None:
    beacon_file = tmp_path / "beacon"
    beacon.create(beacon_file)
    code = """
        import phalanx, phalanx.intervals as iv
        rec = iv.enable()
        assert rec is not None and not rec.cuda
        for step in range(1, 4):
            with iv.collective("all_reduce", group="dp:0,1"):
                pass
            phalanx.report_step(step)
        rec.begin("all_gather", "tp:0-3")  # entered, never completed: the rank waits in it
        """
    _run(code, {ring.ENV_VAR: str(ring_path), beacon.ENV_VAR: str(beacon_file)})
    reader = ring.RingReader(ring_path)
    batch = reader.read()
    assert batch.lost == 0
    assert batch.pid != os.getpid()
    kinds = [(r.kind, r.name, r.number) for r in batch.records]
    assert kinds[:3] == [(ring.BEGIN, "all_reduce", 1), (ring.END, "all_reduce", 1), (ring.MARK, "", 1)]
    assert kinds[-1] == (ring.BEGIN, "all_gather", 1)
    tracker = Tracker()
    tracker.feed(batch)
    act = tracker.activity()
    assert (act.current.name, act.current.group, act.current.seq) == ("all_gather", "tp:0-3", 1)
    assert dict(act.entered) == {"dp:0,1": 3, "tp:0-3": 1}
    assert act.last_record_unix_ns == batch.records[-1].unix_ns
    assert act.device_pending_since_unix_ns == 0  # no GPU: nothing pending on a device
    assert act.step_time_s > 0
    sent = tracker.take_intervals()
    assert [(i.name, i.seq) for i in sent] == [
        ("all_reduce", 1),
        ("all_reduce", 2),
        ("step", 2),
        ("all_reduce", 3),
        ("step", 3),
    ]
    assert all(i.end_unix_ns >= i.start_unix_ns > 0 for i in sent)
    assert tracker.take_intervals() == []  # sent once
    assert reader.read().records == []  # the cursor moved past them


@pytest.mark.parametrize("write_path", ["python", "c"])
def test_reader_never_accepts_a_torn_record_while_a_writer_laps_the_ring(
    tmp_path: Path, write_path: str
) -> None:
    """The reader, in another process, against the Python writer and against the C one
    (``phalanx._ringwrite``, the recorder's write path where built)."""
    path = Path("/dev/shm") / f"phalanx-test-ring-small-{os.getpid()}"
    ring.create(path, capacity=4)  # tiny: the writer laps the reader constantly
    stop = tmp_path / "stop"
    # The writer writes until the reader has raced it long enough (a count of records alone would let a busy
    # machine schedule the whole write between two reads), then prints how many it wrote.
    code = f"""
        import os
        from pathlib import Path
        from phalanx import _ringwrite
        from phalanx.api import intervals as ring
        w = ring.RingWriter(Path({str(path)!r}))
        write = w.write if {write_path!r} == "python" else _ringwrite.Writer(*w.hand_over(), 0, None).write
        n = 0
        while n % 1000 or not os.path.exists({str(stop)!r}):
            # Every field derives from n: a record mixing two writes cannot pass the check below.
            meta = w.meta(ring.BEGIN, False, "op" + "x" * (n % 50), "g:" + str(n % 97))
            write(meta, n, 3 * n)
            n += 1
        print(n)
        """
    try:
        writer = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True
        )
        reader = ring.RingReader(path)
        seen = lost = 0
        last = -1
        deadline = time.monotonic() + 60
        try:
            while True:
                done = writer.poll() is not None
                batch = reader.read()
                lost += batch.lost
                for r in batch.records:
                    n = r.number
                    assert n > last
                    assert r.index == n
                    assert r.name == "op" + "x" * (n % 50)
                    assert r.group == "g:" + str(n % 97)
                    assert r.unix_ns == 3 * n
                    last = n
                seen += len(batch.records)
                if seen > 5000 or time.monotonic() > deadline:
                    stop.touch()
                if done:
                    break
        finally:
            out, _ = writer.communicate(timeout=60)
        assert writer.returncode == 0
        total = int(out)
        assert seen + lost == total  # every record read exactly once, or counted lost
        assert seen > 5000  # the reader raced the writer (not one read after it finished)
        assert last == total - 1
    finally:
        path.unlink(missing_ok=True)


def test_ring_and_beat_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    ring.create(path, capacity=32)
    assert path.stat().st_size == ring.size_for(32)
    w = ring.RingWriter(path)
    long = "é" * 100  # two bytes each: cut at a character boundary, within MAX_NAME_CHARS bytes
    for n in range(100):
        w.append(ring.BEGIN, name=long, group="dp:0,1", number=n + 1)
    batch = ring.RingReader(path).read()
    assert batch.lost == 68
    assert [r.number for r in batch.records] == list(range(69, 101))
    assert batch.records[0].name == "é" * (limits.MAX_NAME_CHARS // 2)

    tracker = Tracker()
    records: list[ring.Record] = []
    for n in range(1, 1001):
        for kind, at in ((ring.BEGIN, 10 * n), (ring.END, 10 * n + 5)):
            records.append(
                ring.Record(index=len(records), kind=kind, name="all_reduce", group="dp:0,1", number=n,
                            unix_ns=at, device=False)
            )  # fmt: skip
    tracker.feed(ring.Batch(records=records, lost=0, last_record_ns=0, pid=1))
    sent = tracker.take_intervals()
    assert len(sent) == limits.MAX_INTERVALS_PER_BEAT
    assert sent[-1].seq == 1000  # the newest are kept


def test_a_file_that_is_not_a_ring_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not an interval ring"):
        ring.RingReader(path)


def test_group_names_are_compact_and_round_trip() -> None:
    assert ring.group_name("dp", [2, 0]) == "dp:0,2"
    assert ring.group_name("dp", list(range(1024))) == "dp:0-1023"
    assert ring.group_name("pp", list(range(3, 512, 8))) == "pp:3-507/8"
    for ranks in ([0, 1], [0, 2, 4, 6, 9], [5], [*range(0, 100, 3), 200]):
        assert ring.parse_group(ring.group_name("g", ranks)) == ("g", ranks)


def test_enable_outside_phalanx_run_is_off() -> None:
    code = """
        import os, phalanx, phalanx.intervals as iv
        os.environ.pop("PHALANX_INTERVALS_FILE", None)
        assert iv.enable() is None
        with iv.collective("all_reduce", group="dp:0,1"):
            pass
        phalanx.report_step(1)
        print("ok")
        """
    env = {k: v for k, v in os.environ.items() if k not in (ring.ENV_VAR, beacon.ENV_VAR)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == "ok"


def test_threads_write_without_a_lock_and_every_record_is_read_once(tmp_path: Path) -> None:
    """The training thread, the CUDA watcher and collective callbacks write one ring at once, with no lock:
    each record claims its slot atomically, so records of different threads interleave but never share a
    slot. The reader, reading meanwhile, gets every record once and whole (a record overtaken by a later one
    is waited for: test_a_record_claimed_and_never_completed_is_skipped_after_a_while)."""
    path = tmp_path / "ring"
    per_thread, threads = 20_000, 4
    ring.create(path, capacity=1 << 17)  # room for every record: nothing may be lost
    writer = ring.RingWriter(path)
    reader = ring.RingReader(path)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: claims and completions interleave

    def write(t: int) -> None:
        for n in range(per_thread):
            writer.append(ring.MARK, name=f"op{t}", group=f"g:{t}", number=n, unix_ns=n)

    workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
    try:
        for w in workers:
            w.start()
        seen: dict[str, list[int]] = {}
        lost = 0
        while True:
            done = not any(w.is_alive() for w in workers)
            batch = reader.read()
            lost += batch.lost
            for r in batch.records:
                assert r.group == "g:" + r.name[2:]  # name and group of the same write
                assert r.unix_ns == r.number
                seen.setdefault(r.name, []).append(r.number)
            if done and not batch.records:
                break
    finally:
        sys.setswitchinterval(switch)
        for w in workers:
            w.join()
    assert lost == 0
    assert reader.cursor == threads * per_thread
    for t in range(threads):
        assert sorted(seen[f"op{t}"]) == list(range(per_thread))


def test_an_interval_ends_in_its_own_slot_only(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    ring.create(path, capacity=8)
    writer, reader = ring.RingWriter(path), ring.RingReader(path)
    token = writer.append(ring.BEGIN, name="all_reduce", group="dp:0,1", number=1, unix_ns=100)
    assert [(r.kind, r.number) for r in reader.read().records] == [(ring.BEGIN, 1)]
    writer.end(token, 250)
    (end,) = reader.read().records  # read again until its end is set
    assert (end.kind, end.name, end.group, end.number) == (ring.END, "all_reduce", "dp:0,1", 1)
    assert end.unix_ns == 250

    late = writer.append(ring.BEGIN, name="all_gather", group="tp:0,1", number=1, unix_ns=300)
    for n in range(8):  # the writer laps the ring: the all-gather's slot now holds a step boundary
        writer.append(ring.MARK, number=n, unix_ns=400 + n)
    writer.end(late, 999)  # too late: must not end the record that took its slot
    batch = ring.RingReader(path).read()
    assert [r.kind for r in batch.records] == [ring.MARK] * 8
    assert all(r.unix_ns != 999 for r in batch.records)


def test_a_record_claimed_and_never_completed_is_skipped_after_a_while(tmp_path: Path) -> None:
    """A writer that died (or raised) between claiming a slot and completing it: records written after it
    are read once the reader has waited for it for a while, and it is counted lost."""
    path = tmp_path / "ring"
    ring.create(path, capacity=64)
    writer, reader = ring.RingWriter(path), ring.RingReader(path)
    writer.append(ring.MARK, number=1)
    next(writer._claim)  # the fault: a slot claimed by a write that never completes
    writer.append(ring.MARK, number=3)
    assert [r.number for r in reader.read().records] == [1]  # waits for the incomplete one first
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        batch = reader.read()
        if batch.records:
            break
        time.sleep(0.05)
    assert [r.number for r in batch.records] == [3]
    assert batch.lost == 1
