"""The probe program's pure parts in-process: the matmul checksum and the ring pairing."""

from __future__ import annotations

import pytest
import torch

from phalanx.diagnostics.probe import checksum_error, ring_pairs


@pytest.mark.parametrize(("dtype", "n"), [(torch.float32, 256), (torch.float32, 512), (torch.bfloat16, 256)])
def test_checksum_accepts_correct_products_and_catches_one_changed_element(
    dtype: torch.dtype, n: int
) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    c = a @ b
    assert checksum_error(a, b, c) == ""
    typical = float(c.float().abs().median())
    c[n // 3, n // 2] += 8 * typical  # a corruption a few times the size of a typical element
    error = checksum_error(a, b, c)
    assert f"column {n // 2}'s checksum" in error
    assert "silent data corruption" in error


def test_checksum_rejects_non_finite_results() -> None:
    a = torch.ones(8, 8)
    c = a @ a
    c[1, 1] = float("nan")
    assert checksum_error(a, a, c) == "the product holds inf or NaN values"


@pytest.mark.parametrize("world", [3, 4, 5, 6, 7, 8])
def test_ring_pairs_cover_the_ring_and_never_share_a_node_within_a_phase(world: int) -> None:
    pairs = ring_pairs(world)
    assert sorted((a, b) for _, _, a, b in pairs) == sorted((k, (k + 1) % world) for k in range(world))
    for phase in {p[0] for p in pairs}:
        nodes = [n for p in pairs if p[0] == phase for n in p[2:]]
        assert len(nodes) == len(set(nodes)), phase
    assert len({p[0] for p in pairs}) == (3 if world % 2 else 2)


def test_ring_pairs_of_two_and_one() -> None:
    assert ring_pairs(2) == [(0, 0, 0, 1)]
    assert ring_pairs(1) == []
