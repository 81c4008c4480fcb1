"""The phalanx trainer's pipeline sends and receives are recorded like its collectives: a stage that waits
for a stalled neighbour is caught in ``recv`` of the channel from that neighbour, and the neighbour, which
never entered that message, is the suspect. Two real gloo ranks, each with its own ring."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.api import beacon
from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker
from tests.trainer._procs import run_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WORKER = Path(__file__).with_name("pipeline_intervals_worker.py")


def test_a_stage_waiting_for_a_stalled_neighbour_names_the_recv_and_the_peer(tmp_path: Path) -> None:
    prefix = Path("/dev/shm") / f"phalanx-test-pipeline-{os.getpid()}-"
    rings = [Path(f"{prefix}{r}") for r in range(2)]
    for r, path in enumerate(rings):
        ring.create(path)
        beacon.create(tmp_path / f"beacon{r}")
    script = tmp_path / "launch.py"
    script.write_text(
        "import os, runpy, sys\n"
        "r = os.environ['RANK']\n"
        "os.environ['PHALANX_INTERVALS_FILE'] = os.environ['PHALANX_TEST_RING_TEMPLATE'] + r\n"
        f"os.environ['PHALANX_BEACON_FILE'] = {str(tmp_path)!r} + '/beacon' + r\n"
        f"sys.argv = [{str(WORKER)!r}]\n"
        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n"
    )
    os.environ["PHALANX_TEST_RING_TEMPLATE"] = str(prefix)
    try:
        results = run_world(script, world=2, args=[], timeout_s=60)
        finished = []
        for path in rings:
            tracker = Tracker()
            tracker.feed(ring.RingReader(path).read())
            finished.append(tracker.activity())
    finally:
        os.environ.pop("PHALANX_TEST_RING_TEMPLATE", None)
        for path in rings:
            path.unlink(missing_ok=True)
    seen = results[0]
    # Step 0 moved two micro-batches each way; stage 1 then waited for the third activation.
    assert seen["current"] == {"name": "recv", "group": "pp:0>1"}, seen
    assert seen["entered"]["1"]["pp:0>1"] == 3, seen
    assert seen["entered"]["0"]["pp:0>1"] == 2, seen
    assert seen["suspects"] == [0], seen
    assert "rank(s) 0 never entered recv #3 of pp:0>1" in seen["suspects_text"], seen
    assert seen["verdict"].startswith("rank 1 hung in recv #3 of pp:0>1 (host side"), seen
    # Both ends numbered every channel alike, and every send and receive completed.
    for act in finished:
        assert not act.current.name
    channels = [{g: n for g, n in act.entered.items() if g.startswith("pp:")} for act in finished]
    assert channels[0] == channels[1] == {"pp:0>1": 4, "pp:1>0": 4}, channels
