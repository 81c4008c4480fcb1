"""The phalanx trainer's collectives record through the interval recorder: two real gloo ranks, each with
its own ring, and the agent-side tracker reading them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.api import beacon
from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker
from tests.trainer._procs import run_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WORKER = Path(__file__).with_name("intervals_trainer_worker.py")


def test_gradient_sync_and_tensor_regions_are_recorded(tmp_path: Path) -> None:
    rings = [Path("/dev/shm") / f"phalanx-test-trainer-{os.getpid()}-{r}" for r in range(2)]
    beacons = [tmp_path / f"beacon{r}" for r in range(2)]
    for path, b in zip(rings, beacons, strict=True):
        ring.create(path)
        beacon.create(b)
    # run_world gives every rank the same environment: each rank picks its own ring through a template.
    os.environ["PHALANX_TEST_RING_TEMPLATE"] = str(rings[0])[:-1]
    try:
        script = tmp_path / "launch.py"
        script.write_text(
            "import os, runpy, sys\n"
            "r = os.environ['RANK']\n"
            "os.environ['PHALANX_INTERVALS_FILE'] = os.environ['PHALANX_TEST_RING_TEMPLATE'] + r\n"
            f"os.environ['PHALANX_BEACON_FILE'] = {str(tmp_path)!r} + '/beacon' + r\n"
            f"sys.argv = [{str(WORKER)!r}]\n"
            f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n"
        )
        run_world(script, world=2, args=[], timeout_s=60)
        seen = []
        for path in rings:
            tracker = Tracker()
            tracker.feed(ring.RingReader(path).read())
            seen.append(tracker)
    finally:
        os.environ.pop("PHALANX_TEST_RING_TEMPLATE", None)
        for path in rings:
            path.unlink(missing_ok=True)
    for tracker in seen:
        act = tracker.activity()
        assert not act.current.name  # every collective completed
        # Two gradient buckets a step (one per parameter), and one tensor-parallel all-reduce a step.
        assert act.entered["dp:0,1"] == 6
        assert act.entered["tp:0,1"] == 3
        names = {(i.name, i.group) for i in tracker.take_intervals()}
        assert names == {("all_reduce", "dp:0,1"), ("all_reduce", "tp:0,1"), ("step", "")}
    # Both ranks issued the same sequence numbers in each group: the suspect rule relies on it.
    assert dict(seen[0].activity().entered) == dict(seen[1].activity().entered)
