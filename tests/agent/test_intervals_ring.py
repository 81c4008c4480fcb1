"""Interval rings across real processes and real shared memory: the recorder in a training process writes,
the agent's reader folds the records into a RankActivity; torn reads are detected, the ring is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.api import beacon, limits
from phalanx.api import intervals as ring

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
    tracker = ring.Tracker()
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


def test_reader_never_accepts_a_torn_record_while_a_writer_laps_the_ring(tmp_path: Path) -> None:
    path = Path("/dev/shm") / f"phalanx-test-ring-small-{os.getpid()}"
    ring.create(path, capacity=4)  # tiny: the writer laps the reader constantly
    total = 200_000
    code = f"""
        from pathlib import Path
        from phalanx.api import intervals as ring
        w = ring.RingWriter(Path({str(path)!r}))
        for n in range({total}):
            # Every field derives from n: a record mixing two writes cannot pass the check below.
            group = "g:" + str(n % 97)
            w.append(ring.BEGIN, name="op" + "x" * (n % 50), group=group, number=n, unix_ns=3 * n)
        """
    try:
        writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])
        reader = ring.RingReader(path)
        seen = lost = 0
        last = -1
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
                if done:
                    break
        finally:
            writer.wait(timeout=60)
        assert writer.returncode == 0
        assert seen + lost == total  # every record read exactly once, or counted lost
        assert seen > 1000
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

    tracker = ring.Tracker()
    records = []
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
