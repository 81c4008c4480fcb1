"""The ElasticJob contract (phalanx.api.elasticjob) holds on both sides: every status field the master writes
is declared by the CRD's schema (the API server silently drops an undeclared field of a structural schema,
so the operator would never see it), and the names the operator gives a job's objects are the ones the
master and the CLI derive."""

from __future__ import annotations

from typing import Any

from tests.jobviews import job_view

from phalanx.api import elasticjob as ej
from phalanx.api.settings import OperatorSettings
from phalanx.master.store.kube import job_status_patch, parse_state_url
from phalanx.operator import builders, supporting
from phalanx.operator.crd import build_crd
from phalanx.operator.spec import parse_spec

MASTER_JOB_JSON: dict[str, Any] = {
    "phase": "Running",
    "reason": "r",
    "members": ["n0"],
    "round": 3,
    "world_size": 4,
    "restart_count": 1,
    "spec_generation": 2,
    "max_step": 10,
    "committed_checkpoint_step": 8,
    "evictions": [
        {
            "node_id": "j-worker-0-0",
            "machine": "m",
            "reason": "slow",
            "kind": "straggler",
            "requested_at": 1.0,
        }
    ],
}


def _status_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["status"]


def test_every_status_field_the_master_writes_is_declared_by_the_crd() -> None:
    patch = job_status_patch(job_view(**MASTER_JOB_JSON))
    status = _status_schema()["properties"]
    assert set(patch) == ej.MASTER_STATUS_FIELDS, "the master writes exactly the fields the contract gives it"
    assert set(status) >= ej.MASTER_STATUS_FIELDS
    master = status[ej.STATUS_MASTER]["properties"]
    assert set(patch[ej.STATUS_MASTER]) <= set(master)
    eviction = status[ej.STATUS_EVICTIONS]["items"]["properties"]
    assert set(patch[ej.STATUS_EVICTIONS][0]) <= set(eviction)
    assert patch[ej.STATUS_EVICTIONS][0][ej.EVICTION_NODE_ID] == "j-worker-0-0"


def test_the_operator_names_a_jobs_objects_as_the_master_and_the_cli_derive_them() -> None:
    job = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
        "spec": {
            "nodes": {"min": 1, "max": 1},
            "template": {
                "spec": {"containers": [{"name": "t", "image": "i", "command": ["python", "t.py"]}]}
            },
        },
    }
    # The master finds its state ConfigMap from its --state k8s://NAMESPACE/NAME (phalanx.master.store.kube).
    spec = parse_spec(job["spec"])
    master = builders.master_pod(job, spec, settings=OperatorSettings())["spec"]["containers"][0]
    args = master["command"]
    namespace, name = parse_state_url(args[args.index("--state") + 1])
    state = supporting.state_config_map(job)["metadata"]["name"]
    assert (namespace, ej.state_config_map(name)) == ("ns", state)
    assert supporting.token_secret(job, token="t")["stringData"] == {ej.TOKEN_KEY: "t"}
    assert supporting.master_service(job, settings=OperatorSettings())["metadata"]["name"] == ej.master("j")
    pod = builders.worker_pod(job, spec, slot=2, incarnation=5, settings=OperatorSettings())
    assert ej.parse_worker(pod["metadata"]["name"]) == (2, 5)
    assert ej.parse_worker(ej.master("j")) is None


def test_a_status_phase_is_read_as_a_phase_or_as_none() -> None:
    """The phase the API server returns is held as a :class:`Phase` everywhere it is compared: a word that
    is no phase, or none yet, is None, never a string that compares unequal to every phase."""
    assert ej.phase_of("Running") is ej.Phase.RUNNING
    assert ej.phase_of(None) is None
    assert ej.phase_of("") is None
    assert ej.phase_of("running") is None  # the ElasticJob's own phase is written by the operator, exactly
    assert ej.phase_of("running", any_case=True) is ej.Phase.RUNNING  # the master's verdict, in any case
    assert ej.phase_of("Paused", any_case=True) is None
