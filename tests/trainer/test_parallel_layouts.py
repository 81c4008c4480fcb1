"""Every parallel layout computes the same loss and gradients as the single-process reference.

Tolerance (fp32 on CPU): loss within rel 1e-5; every gradient element within rtol 1e-5 / atol 1e-6 of the
reference shard (torch.allclose). The layouts differ only in summation order, so this is tight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer._procs import run_world

WORKER = Path(__file__).with_name("parallel_worker.py")

WORLD2 = [
    {"tp": 2, "pp": 1},
    {"tp": 2, "pp": 1, "sp": 1},
    {"tp": 2, "pp": 1, "sp": 1, "recompute": 1},
    {"tp": 1, "pp": 2, "micro": 4},
    {"tp": 1, "pp": 1},  # DP=2
    {"tp": 1, "pp": 1, "micro": 2},  # DP=2 with gradient accumulation
]
WORLD4 = [
    {"tp": 2, "pp": 2, "micro": 3},
    {"tp": 2, "pp": 2, "micro": 2, "sp": 1},
    {"tp": 2, "pp": 1},  # TP2 x DP2
    {"tp": 2, "pp": 1, "sp": 1, "micro": 2},
]


def _assert_matches(results: list[list[dict[str, object]]]) -> None:
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            assert r["bad"] == [], (
                f"rank {rank} layout {r['layout']}: gradients differ: {r['bad']} ({r['max_abs_err']})"
            )
            assert math.isclose(float(r["loss"]), float(r["ref_loss"]), rel_tol=1e-5), r
            assert int(r["params"]) > 0


@pytest.mark.integration
@pytest.mark.timeout(240)  # ~10-20 s on an idle machine
def test_world_of_two_matches_reference() -> None:
    _assert_matches(run_world(WORKER, world=2, args=[json.dumps(WORLD2)], timeout_s=220))


@pytest.mark.integration
@pytest.mark.timeout(240)  # ~10-20 s on an idle machine
def test_world_of_four_matches_reference() -> None:
    _assert_matches(run_world(WORKER, world=4, args=[json.dumps(WORLD4)], timeout_s=220))
