"""Which status changes the master writes into its ElasticJob at once and which wait (pure:
phalanx.master.store.kube.publish_decision, resourceVersion ordering), and how the interval of progress
publishes gets from the job's spec to the master."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.api.errors import ConfigError
from phalanx.api.settings import MasterSettings, OperatorSettings, from_env
from phalanx.master.store.kube import job_status_patch, newer, publish_decision
from phalanx.operator import builders
from phalanx.operator.spec import parse_spec
from tests.jobviews import job_view

INTERVAL = 10.0


def _patch(**status: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "phase": "Running",
        "round": 2,
        "world_size": 4,
        "members": ["a", "b"],
        "max_step": 100,
        "committed_checkpoint_step": 50,
        "spec_generation": 3,
    }
    return job_status_patch(job_view(**{**base, **status}))


def _decide(before: dict[str, Any] | None, after: dict[str, Any], elapsed_s: float = 1.0) -> str:
    return publish_decision(before, after, elapsed_s=elapsed_s, progress_interval_s=INTERVAL)


def test_the_first_status_goes_out_at_once() -> None:
    assert _decide(None, _patch()) == "now"


def test_progress_alone_waits_for_the_interval() -> None:
    assert _decide(_patch(), _patch(max_step=101)) == "later"
    assert _decide(_patch(), _patch(max_step=101), elapsed_s=INTERVAL) == "now"


def test_nothing_new_is_not_sent_even_though_the_timestamp_moved() -> None:
    assert _decide(_patch(), _patch(), elapsed_s=3 * INTERVAL) == "unchanged"


def test_what_the_operator_acts_on_goes_out_at_once() -> None:
    eviction = {
        "node_id": "b",
        "machine": "m",
        "reason": "lost",
        "kind": "heartbeat_timeout",
        "requested_at": 0,
    }
    for change in (
        {"phase": "Restarting"},
        {"phase": "Suspended"},
        {"spec_generation": 4},  # the suspend handshake's observedGeneration
        {"evictions": [eviction]},
        {"round": 3},
        {"world_size": 2},
        {"members": ["a"]},
        {"committed_checkpoint_step": 100},
        {"restart_count": 1},
        {"reason": "node b lost"},
    ):
        assert _decide(_patch(), _patch(max_step=101, **change)) == "now", change


def test_resource_versions_compare_as_numbers() -> None:
    assert newer("1000", "999")
    assert not newer("999", "1000")
    assert not newer("5", "5")
    assert newer("opaque", "5")  # not a number: taken as it comes


def _job_with_master(**master: Any) -> dict[str, Any]:
    container = {"name": "t", "image": "img", "command": ["python", "train.py"]}
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {
            "nodes": {"min": 1, "max": 2},
            "template": {"spec": {"containers": [container]}},
            "master": master,
        },
    }


def test_the_interval_reaches_the_master_from_the_job_spec() -> None:
    """spec.master.statusProgressInterval -> the master Pod's PHALANX_STATUS_PROGRESS_INTERVAL_S, which the
    master reads as status_progress_interval_s; the CRD's limit (1h) holds in the operator too."""
    settings = OperatorSettings()
    for given, expected in (({}, "10.0"), ({"statusProgressInterval": "30s"}, "30.0")):
        job = _job_with_master(**given)
        pod = builders.master_pod(job, parse_spec(job["spec"]), settings=settings)
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PHALANX_STATUS_PROGRESS_INTERVAL_S"] == expected
        master = from_env(MasterSettings, {"PHALANX_JOB_ID": "j", **{k: v for k, v in env.items() if v}})
        assert master.status_progress_interval_s == float(expected)
    with pytest.raises(ConfigError, match="at most 1h"):
        parse_spec(_job_with_master(statusProgressInterval="2h")["spec"])
