"""Invalid ElasticJobs are rejected by the real kube-apiserver at admission, with messages a person
understands (the CRD's OpenAPI bounds, enums and CEL rules)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from k8s_harness.controlplane import ControlPlane

pytestmark = [pytest.mark.k8s, pytest.mark.integration]


def _job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodes": {"min": 2, "max": 4},
            "nprocPerNode": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "x", "command": ["train"]}]}},
        },
    }


def _with(path: str, value: Any) -> dict[str, Any]:
    job = _job("bad")
    node = job
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return job


_DELETE = object()

INVALID = [
    (
        "min-above-max",
        _with("spec.nodes", {"min": 5, "max": 3}),
        "nodes.min must not be greater than nodes.max",
    ),
    ("min-zero", _with("spec.nodes", {"min": 0, "max": 3}), "should be greater than or equal to 1"),
    ("no-unit-multiple", _with("spec.nodes", {"min": 3, "max": 3, "unit": 2}), "no multiple of nodes.unit"),
    (
        "parallelism-not-dividing",
        _with("spec.parallelism", {"tensor": 3, "pipeline": 1}),
        "parallelism.tensor x parallelism.pipeline must divide nprocPerNode x nodes.unit",
    ),
    ("bad-duration", _with("spec.heartbeat", {"timeout": "ten seconds"}), "must be a duration such as 500ms"),
    (
        "timeout-below-twice-interval",
        _with("spec.heartbeat", {"interval": "5s", "timeout": "8s"}),
        "heartbeat.timeout must be at least twice heartbeat.interval",
    ),
    ("nproc-zero", _with("spec.nprocPerNode", 0), "nprocPerNode must be a whole number from 1, or auto"),
    ("negative-restarts", _with("spec.restart", {"maxRestarts": -1}), "should be greater than or equal to 0"),
    (
        "unknown-clean-policy",
        _with("spec.cleanPodPolicy", "Sometimes"),
        'supported values: "None", "Running"',
    ),
    ("no-containers", _with("spec.template", {"spec": {"containers": []}}), "should have at least 1 items"),
    ("missing-template", _with("spec.template", _DELETE), "spec.template: Required value"),
    # The Pod templates are Kubernetes' PodSpec: a misspelt or mistyped field is refused, not carried along.
    (
        "misspelt-pod-field",
        _with("spec.template", {"spec": {"containers": [{"name": "t", "image": "x", "comand": ["train"]}]}}),
        'unknown field "spec.template.spec.containers[0].comand"',
    ),
    (
        "mistyped-pod-field",
        _with("spec.template", {"spec": {"containers": [{"name": "t", "image": "x"}], "hostNetwork": "yes"}}),
        "spec.template.spec.hostNetwork: Invalid value",
    ),
    (
        "misspelt-master-toleration",
        _with("spec.master", {"template": {"spec": {"tolerations": [{"key": "a", "efect": "NoSchedule"}]}}}),
        'unknown field "spec.master.template.spec.tolerations[0].efect"',
    ),
    ("unknown-probe", _with("spec.healthChecks", {"probes": ["ping"]}), 'supported values: "matmul"'),
    ("no-probes", _with("spec.healthChecks", {"probes": []}), "should have at least 1 items"),
    (
        "no-confirm",
        _with("spec.healthChecks", {"confirmRounds": 0}),
        "healthChecks.confirmRounds in body should be greater than or equal to 1",
    ),
    (
        "bad-probe-interval",
        _with("spec.healthChecks", {"enabled": True, "interval": "hourly"}),
        "must be a duration such as 500ms",
    ),
    (
        "zero-probe-timeout",
        _with("spec.healthChecks", {"enabled": True, "timeout": "0s"}),
        "healthChecks.timeout must be greater than 0",
    ),
    ("bad-deadline", _with("spec.activeDeadline", "a day"), "must be a duration such as 500ms"),
    ("zero-deadline", _with("spec.activeDeadline", "0s"), "must be greater than 0; leave it out"),
    ("bad-ttl", _with("spec.ttlAfterFinished", "forever"), "must be a duration such as 500ms"),
    (
        "gang-above-max",
        _with("spec.gangScheduling", {"enabled": True, "minNodes": 5}),
        "gangScheduling.minNodes must not be greater than nodes.max",
    ),
    (
        "gang-zero",
        _with("spec.gangScheduling", {"enabled": True, "minNodes": 0}),
        "should be greater than or equal to 1",
    ),
    # Bounds: the operator's memory and API calls grow with these (docs/security.md lists them all).
    ("nodes-max", _with("spec.nodes", {"min": 1, "max": 2147483647}), "less than or equal to 5000"),
    ("nproc-max", _with("spec.nprocPerNode", 1000), "nprocPerNode must be at most 128"),
    ("restarts-max", _with("spec.restart", {"maxRestarts": 10**6}), "less than or equal to 10000"),
    (
        "interval-max",
        _with("spec.heartbeat", {"interval": "2h", "timeout": "5h"}),
        "heartbeat.interval must be at most 1m",
    ),
    ("deadline-max", _with("spec.activeDeadline", "100000h"), "activeDeadline must be at most 8760h"),
    (
        "shm-max",
        _with("spec.sharedMemory", {"sizeLimit": "5Ti"}),
        "sharedMemory.sizeLimit must be at most 4Ti",
    ),
]


@pytest.mark.parametrize(("case", "job", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_job_is_rejected(
    control_plane: ControlPlane, case: str, job: dict[str, Any], message: str
) -> None:
    out = control_plane.kubectl("create", "-f", "-", input_text=json.dumps(job), check=False)
    assert "created" not in out, f"{case}: the apiserver accepted an invalid job"
    assert message in out, f"{case}: expected {message!r} in {out!r}"


def test_kubectl_explain_describes_the_pod_templates(control_plane: ControlPlane) -> None:
    out = control_plane.kubectl("explain", "elasticjobs.spec.template.spec.containers.resources.limits")
    assert "Limits describes the maximum amount of compute resources allowed" in out, out
    out = control_plane.kubectl("explain", "elasticjobs.spec.master.template.spec.affinity.nodeAffinity")
    assert "Describes node affinity scheduling rules for the pod" in out, out


def test_long_name_is_rejected(control_plane: ControlPlane) -> None:
    job = _job("j" * 50)
    out = control_plane.kubectl("create", "-f", "-", input_text=json.dumps(job), check=False)
    assert "the job name must be at most 40 characters" in out


def test_valid_job_gets_defaults_and_immutable_fields(control_plane: ControlPlane) -> None:
    job = _job("defaults")
    control_plane.kubectl("create", "-f", "-", input_text=json.dumps(job))
    try:
        got = json.loads(control_plane.kubectl("get", "ej", "defaults", "-o", "json"))
        # Replaced unconditionally: an operator running beside this test writes the job's status meanwhile.
        del got["metadata"]["resourceVersion"]
        spec = got["spec"]
        assert spec["heartbeat"] == {"interval": "1s", "timeout": "10s"}
        assert spec["parallelism"] == {"tensor": 1, "pipeline": 1}
        assert spec["nodes"]["unit"] == 1
        assert spec["cleanPodPolicy"] == "Running"
        assert spec["restart"]["maxEvictions"] == 3
        assert spec["healthChecks"] == {
            "enabled": False, "probes": ["matmul", "allgather"], "interval": "0s", "timeout": "2m",
            "confirmRounds": 2, "evictSlowNodes": False,
        }  # fmt: skip
        assert spec["gangScheduling"] == {"enabled": False, "scheduler": "kubernetes"}
        changed = copy.deepcopy(got)
        changed["spec"]["nprocPerNode"] = 4
        out = control_plane.kubectl("replace", "-f", "-", input_text=json.dumps(changed), check=False)
        assert "nprocPerNode cannot be changed on a running job" in out
        changed = copy.deepcopy(got)
        changed["spec"]["gangScheduling"] = {"enabled": True}
        out = control_plane.kubectl("replace", "-f", "-", input_text=json.dumps(changed), check=False)
        assert "gangScheduling.enabled cannot be changed on a running job" in out
        changed = copy.deepcopy(got)
        changed["spec"]["gangScheduling"]["scheduler"] = "coscheduling"
        out = control_plane.kubectl("replace", "-f", "-", input_text=json.dumps(changed), check=False)
        assert "gangScheduling.scheduler and schedulerName cannot be changed on a running job" in out
    finally:
        control_plane.kubectl("delete", "ej", "defaults", "--wait=false")
