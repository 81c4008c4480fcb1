"""The recorder's CUDA path on a real GPU: intervals timed by CUDA events with no synchronisation on the
training thread, completion written by the watcher thread, and a kernel that spins past the timeout judged
a device-side hang. Skipped (never faked) without a GPU."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker
from phalanx.api.settings import HangSettings
from phalanx.diagnostics import hang

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(60),
]


@pytest.fixture
def ring_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"phalanx-test-cuda-ring-{os.getpid()}"
    ring.create(path)
    yield path
    path.unlink(missing_ok=True)


def _cycles_per_second() -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / (time.perf_counter() - start)


def test_a_spinning_kernel_is_a_device_side_hang_and_completes_later(ring_path: Path) -> None:
    from phalanx.intervals import Recorder

    rec = Recorder(ring_path, cuda=True)
    reader, tracker = ring.RingReader(ring_path), Tracker()
    history = hang.RankHistory(started_at=0.0)
    settings = HangSettings(floor_s=1.0)
    try:
        for step in range(5):  # normal steps: every device marker completes
            x = torch.randn(256, 256, device="cuda")
            with rec.collective("all_reduce", "dp:0"):
                x = x @ x
            rec.step(step)
            history.observe(step=step, now=time.monotonic())
            time.sleep(0.02)
        torch.cuda.synchronize()
        time.sleep(0.05)  # the watcher's poll
        tracker.feed(reader.read())
        assert tracker.device_pending_since_ns() == 0
        closed = tracker.take_intervals()
        assert any(i.name == "all_reduce" and i.device for i in closed)

        spin = int(4.0 * _cycles_per_second())  # at the calibrated clock: boosted, it ends sooner
        launched = time.time_ns()
        token = rec.begin("all_reduce", "dp:0")
        torch.cuda._sleep(spin)  # seconds on the device; the host returns at once
        rec.end(token)
        assert time.time_ns() - launched < 0.5e9  # no synchronisation on the training path
        verdict = None
        while time.time_ns() - launched < 2.5e9:
            tracker.feed(reader.read())
            v = hang.evidence_verdict(
                history,
                settings,
                now=time.monotonic(),
                activity=tracker.activity(),
                now_unix_ns=time.time_ns(),
            )
            if v.hung:
                verdict = v
                break
            time.sleep(0.05)
        assert verdict is not None
        assert verdict.side == "device"
        assert "in all_reduce #6 of dp:0 (device side" in hang.describe(0, verdict)
        torch.cuda.synchronize()
        time.sleep(0.05)
        tracker.feed(reader.read())
        assert tracker.device_pending_since_ns() == 0  # the watcher saw it complete
        (done,) = [i for i in tracker.take_intervals() if i.seq == 6]
        assert done.device
        assert done.end_unix_ns - done.start_unix_ns > 2.5e9
    finally:
        rec.close()
