"""A whole `/v1/job` view for tests about a few of its fields (the rest as a fresh job has them)."""

from __future__ import annotations

from typing import Any

from phalanx.api import views

FRESH: dict[str, Any] = {
    "job_id": "j",
    "phase": "Running",
    "suspended": False,
    "spec_generation": 0,
    "reason": "",
    "round": 1,
    "open_round": None,
    "world_size": 1,
    "members": [],
    "waiting": [],
    "min_nodes": 1,
    "max_nodes": 1,
    "nodes_alive": 1,
    "restart_count": 0,
    "max_restarts": 3,
    "eviction_count": 0,
    "max_evictions": 3,
    "evictions": [],
    "committed_checkpoint_step": -1,
    "max_step": -1,
    "root_cause": None,
    "hang_analysis": None,
    "started_unix": 0.0,
    "completed": [],
    "probe": None,
    "slow_ranks": [],
    "unconfirmed_stragglers": {},
}


def job_view(**fields: Any) -> views.JobView:
    return views.JobView.model_validate({**FRESH, **fields})
