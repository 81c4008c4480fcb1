"""Progress beacons and round files across real processes and real shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.api import auth, beacon
from phalanx.api import round as round_file


@pytest.fixture
def beacon_path() -> Path:
    path = Path("/dev/shm") / f"phalanx-test-beacon-{os.getpid()}"
    beacon.create(path)
    yield path
    path.unlink(missing_ok=True)


def test_fresh_beacon_reads_step_minus_one(beacon_path: Path) -> None:
    assert beacon.BeaconReader(beacon_path).read().step == -1


def test_report_step_in_another_process_is_seen_by_the_reader(beacon_path: Path) -> None:
    code = "import phalanx\nfor s in range(1, 1001): phalanx.report_step(s)\n"
    env = {**os.environ, beacon.ENV_VAR: str(beacon_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    reading = beacon.BeaconReader(beacon_path).read()
    assert reading.step == 1000
    assert reading.unix_ns > 0
    assert reading.pid != os.getpid()


def test_reader_never_sees_a_torn_write_while_a_writer_runs(beacon_path: Path) -> None:
    code = "import phalanx\nfor s in range(200000): phalanx.report_step(s)\n"
    env = {**os.environ, beacon.ENV_VAR: str(beacon_path)}
    writer = subprocess.Popen([sys.executable, "-c", code], env=env)
    reader = beacon.BeaconReader(beacon_path)
    last = -1
    try:
        while writer.poll() is None:
            step = reader.read().step
            assert step >= last  # steps only move forward, and no half-written value appears
            last = step
    finally:
        writer.wait(timeout=60)
    assert reader.read().step == 199999


def test_report_step_outside_phalanx_run_is_a_no_op() -> None:
    code = (
        "import os, phalanx\nos.environ.pop('PHALANX_BEACON_FILE', None)\nphalanx.report_step(3)\nprint('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != beacon.ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "ok"


def test_round_file_round_trip_is_atomic_json(tmp_path: Path) -> None:
    path = tmp_path / "round.json"
    assert round_file.read(path) is None
    info = round_file.RoundInfo(
        round=3, group_rank=1, rank_offset=2, world_size=6, local_world_size=2,
        store_host="127.0.0.1", store_port=29500, restart_count=1, members=["a", "b", "c"], joined=["c"],
        store_key=auth.store_key("t" * 24, "round/3/127.0.0.1:29500"),
    )  # fmt: skip
    round_file.write(path, info)
    assert round_file.read(path) == info
    assert info.rank(1) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["round.json"]  # no temporary left behind
    assert path.stat().st_mode & 0o777 == 0o600, "it holds the round's store key"


def test_a_store_key_is_the_jobs_own_and_new_for_every_round_and_store() -> None:
    key = auth.store_key("t" * 24, "round/3/10.0.0.1:29500")
    assert len(key) == 32
    int(key, 16)  # hex
    assert key == auth.store_key("t" * 24, "round/3/10.0.0.1:29500"), "every member derives the same"
    others = {
        auth.store_key("u" * 24, "round/3/10.0.0.1:29500"),  # another job's token
        auth.store_key("t" * 24, "round/4/10.0.0.1:29500"),  # the next round
        auth.store_key("t" * 24, "round/3/10.0.0.1:29502"),  # another store
        auth.store_key("t" * 24, "probe/3/10.0.0.1:29500"),  # a probe round of that number
    }
    assert key not in others
    assert len(others) == 4


def test_announce_regroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(round_file.REGROUP_ENV_VAR, raising=False)
    assert round_file.announce_regroup() is False
    target = tmp_path / "regroup"
    monkeypatch.setenv(round_file.REGROUP_ENV_VAR, str(target))
    assert round_file.announce_regroup() is True
    assert target.read_text() == str(os.getpid())
