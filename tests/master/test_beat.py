"""A heartbeat's ranks read once (phalanx.master.state.beat): what each reader gets is what it read from the
ranks itself before, on real protobuf messages of every shape a rank sends."""

from __future__ import annotations

import math
import random

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.errors import RequestError
from phalanx.master.state.beat import read_ranks


def random_rank(rng: random.Random, rank: int) -> pb.RankProgress:
    r = pb.RankProgress(
        rank=rank,
        local_rank=rank % 8,
        step=rng.choice([-1, 0, 7, rng.randrange(1000)]),
        step_unix_ns=rng.choice([0, 1_800_000_000_000_000_000 + rng.randrange(10**9)]),
        beacon_age_s=rng.random(),
        pid=1000 + rank,
    )
    if rng.random() < 0.5:  # a recorder's: its activity, and what it recorded since the last beat
        r.activity.step_time_s = rng.choice([0.0, rng.random()])
        r.activity.collective_time_s = rng.choice([0.0, rng.random()])
        if rng.random() < 0.5:
            r.intervals.add(name="step", seq=r.step, start_unix_ns=1, end_unix_ns=2)
    return r


@pytest.mark.parametrize("seed", range(20))
def test_the_one_pass_reads_what_each_reader_read_for_itself(seed: int) -> None:
    rng = random.Random(seed)
    ranks = [random_rank(rng, rank) for rank in range(rng.randrange(1, 9))]
    beat = read_ranks(pb.HeartbeatRequest(ranks=ranks))
    assert beat.progress == ranks
    assert beat.top == max(r.step for r in ranks)
    assert beat.activities == [(r.rank, r.activity) for r in ranks if r.HasField("activity")]
    assert beat.recorded == any(r.HasField("activity") for r in ranks)
    with_activity = {r.rank: r.HasField("activity") for r in ranks}
    assert beat.stepped == [
        (
            r.rank,
            r.step,
            r.step_unix_ns / 1e9,
            r.activity.step_time_s if with_activity[r.rank] else 0.0,
            r.activity.collective_time_s if with_activity[r.rank] else 0.0,
        )
        for r in ranks
        if r.step >= 0 and r.step_unix_ns > 0
    ]


def test_a_beat_without_ranks_reads_as_none() -> None:
    beat = read_ranks(pb.HeartbeatRequest(node_id="n"))
    assert (beat.progress, beat.stepped, beat.activities, beat.recorded) == ([], [], [], False)


@pytest.mark.parametrize("field", ["beacon_age_s", "activity.step_time_s", "activity.collective_time_s"])
def test_a_number_that_is_not_finite_is_refused_naming_the_rank_and_field(field: str) -> None:
    ranks = [pb.RankProgress(rank=0, step=1), pb.RankProgress(rank=1, step=1)]
    target = ranks[1].activity if field.startswith("activity.") else ranks[1]
    setattr(target, field.rsplit(".", maxsplit=1)[-1], math.nan)
    with pytest.raises(RequestError, match=rf"^ranks\[1\]\.{field} must be a finite number, got nan$"):
        read_ranks(pb.HeartbeatRequest(ranks=ranks))
