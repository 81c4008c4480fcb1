"""The elastic sampler re-splits the remaining samples when the world size changes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.checkpoint import ElasticDistributedSampler


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=300),
    before=st.integers(min_value=1, max_value=8),
    after=st.integers(min_value=1, max_value=8),
    taken=st.integers(min_value=0, max_value=60),
    shuffle=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_no_sample_is_repeated_or_lost_across_a_resize(
    n: int, before: int, after: int, taken: int, shuffle: bool, seed: int
) -> None:
    samplers = [
        ElasticDistributedSampler(n, num_replicas=before, rank=r, shuffle=shuffle, seed=seed)
        for r in range(before)
    ]
    iters = [iter(s) for s in samplers]
    # every rank takes the same number of samples (lock step), as long as each has that many
    steps = min([taken, *(len(s) for s in samplers)])
    seen = [next(it) for it in iters for _ in range(steps)]
    states = [s.state_dict() for s in samplers]
    assert all(state == states[0] for state in states)  # the position is the same on every rank
    resumed = []
    for r in range(after):
        s = ElasticDistributedSampler(n, num_replicas=after, rank=r, shuffle=shuffle, seed=seed)
        s.load_state_dict(states[0])
        part = list(s)
        assert len(part) == len(s)
        resumed += part
    assert sorted(seen + resumed) == list(range(n))


def test_epochs_have_different_orders_and_restart_at_zero() -> None:
    s = ElasticDistributedSampler(50, seed=1)
    first = list(s)
    s.set_epoch(1)
    assert sorted(list(s)) == sorted(first)
    assert list(s) != first
    assert s.state_dict()["consumed"] == 50
    s.set_epoch(2)
    assert s.state_dict()["consumed"] == 0
