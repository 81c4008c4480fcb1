"""The master's /v1/job JSON mapped onto the ElasticJob status (phalanx.master.store.kube)."""

from __future__ import annotations

import pytest
from tests.jobviews import job_view

from phalanx.api.errors import StateStoreError
from phalanx.master.store.kube import job_status_patch, parse_state_url


def test_status_mapping() -> None:
    patch = job_status_patch(
        job_view(
            **{
                "job_id": "j",
                "phase": "Restarting",
                "reason": "j-worker-0-0 lost",
                "round": 3,
                "world_size": 4,
                "members": ["a", "b"],
                "restart_count": 1,
                "evictions": [
                    {
                        "node_id": "j-worker-0-0",
                        "machine": "m1",
                        "reason": "no heartbeat",
                        "kind": "heartbeat_timeout",
                        "requested_at": 0,
                    }
                ],
                "committed_checkpoint_step": -1,
                "max_step": 17,
                "spec_generation": 5,
            }
        )
    )
    assert patch["round"] == 3
    assert patch["worldSize"] == 4
    assert patch["step"] == 17
    assert patch["restartCount"] == 1
    assert "lastCommittedCheckpointStep" not in patch
    assert patch["evictions"] == [
        {
            "nodeId": "j-worker-0-0",
            "machine": "m1",
            "reason": "no heartbeat",
            "requestedAt": "1970-01-01T00:00:00Z",
        }
    ]
    assert patch["master"]["phase"] == "Restarting"
    assert patch["master"]["members"] == ["a", "b"]
    assert patch["master"]["observedGeneration"] == 5  # the spec the master follows (its suspend)


def test_state_url() -> None:
    assert parse_state_url("k8s://ns/job") == ("ns", "job")
    with pytest.raises(StateStoreError):
        parse_state_url("k8s://ns")
