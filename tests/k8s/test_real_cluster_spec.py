"""An ElasticJob for real clusters, against the real kube-apiserver: the GPU example passes a server-side
dry run, the Pods the operator builds pass the `restricted` Pod Security level (the PodSecurity admission
plugin is on by default), admission refuses what would break on a real node, and a Pod the API server
refuses (a ResourceQuota, a namespace enforcing `restricted`) sets a condition with the API server's own
message, counts its Event up instead of repeating it, and fails the job after spec.createRefusedTimeout."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.cluster import Cluster
from k8s_harness.controlplane import ControlPlane

from phalanx.api.settings import OperatorSettings
from phalanx.operator import builders
from phalanx.operator.spec import parse_spec

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elasticjob.yaml"
GPU_EXAMPLE = ROOT / "examples" / "elasticjob-gpu.yaml"
DRY = "created (server dry run)"


def _namespace(cp: ControlPlane, name: str, *, level: str = "") -> None:
    cp.kubectl("create", "namespace", name)
    if level:
        for mode in ("enforce", "warn"):
            cp.kubectl("label", "namespace", name, f"pod-security.kubernetes.io/{mode}={level}")


def _elastic_job(path: Path) -> dict[str, Any]:
    (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ElasticJob"]
    return dict(job)


def _admitted(cp: ControlPlane, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server would store it (CRD defaults applied), without storing it."""
    out = cp.kubectl(
        "create", "-n", ns, "--dry-run=server", "-o", "json", "-f", "-", input_text=json.dumps(obj)
    )
    return dict(json.loads(out))


def _built_pods(job: dict[str, Any], ns: str) -> list[dict[str, Any]]:
    job = copy.deepcopy(job)
    job["metadata"].update(namespace=ns, uid="00000000-0000-0000-0000-000000000001")
    spec = parse_spec(job["spec"])
    settings = OperatorSettings()
    return [
        builders.master_pod(job, spec, settings=settings),
        builders.worker_pod(job, spec, slot=0, incarnation=0, settings=settings),
    ]


def _dry_create(cp: ControlPlane, ns: str, obj: dict[str, Any]) -> str:
    return cp.kubectl(
        "create", "-n", ns, "--dry-run=server", "-f", "-", input_text=json.dumps(obj), check=False
    )


# ------------------------------------------------------------------------------------------------------
# Examples and Pod Security


def test_the_gpu_example_is_accepted_by_a_server_side_dry_run(control_plane: ControlPlane) -> None:
    cp, ns = control_plane, "gpu-example"
    _namespace(cp, ns)
    out = cp.kubectl("apply", "-n", ns, "--dry-run=server", "-f", str(GPU_EXAMPLE))
    assert f"elasticjob.phalanx.dev/llm {DRY}" in out, out
    # With host networking uncommented, as its comment invites.
    text = GPU_EXAMPLE.read_text().replace("# hostNetwork: true", "hostNetwork: true")
    assert "\n      hostNetwork: true\n" in text
    out = cp.kubectl("apply", "-n", ns, "--dry-run=server", "-f", "-", input_text=text)
    assert f"elasticjob.phalanx.dev/llm {DRY}" in out, out
    admitted = _admitted(cp, ns, yaml.safe_load(text))
    spec = parse_spec(admitted["spec"])
    assert (spec.nproc_per_node, spec.shared_memory) == (8, 320 << 30)
    _, worker = _built_pods(admitted, ns)
    assert worker["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    cp.kubectl("delete", "namespace", ns, "--wait=false")


@pytest.mark.parametrize("example", [EXAMPLE, GPU_EXAMPLE], ids=["cpu", "gpu"])
def test_the_operators_pods_pass_the_restricted_level(control_plane: ControlPlane, example: Path) -> None:
    """The master and worker Pods built from the examples are admitted, without a warning, into a namespace
    enforcing `restricted`; the same Pods without the operator's security defaults are refused, and so is a
    worker whose template asks for a privileged container."""
    cp = control_plane
    ns = f"restricted-{example.stem.replace('elasticjob', 'ej')}"
    _namespace(cp, ns, level="restricted")
    job = _admitted(cp, ns, _elastic_job(example))
    cp.kubectl("create", "serviceaccount", "-n", ns, f"{job['metadata']['name']}-master")
    for name in {p["spec"].get("priorityClassName") for p in _built_pods(job, ns)} - {None}:
        # The Priority admission plugin refuses a Pod naming a class that does not exist.
        cp.kubectl("create", "priorityclass", name, "--value=1000", check=False)
    for pod in _built_pods(job, ns):
        out = _dry_create(cp, ns, pod)
        assert f"pod/{pod['metadata']['name']} {DRY}" in out, out
        assert "violate" not in out, out
        bare = copy.deepcopy(pod)
        bare["spec"].pop("securityContext")
        for c in bare["spec"]["containers"]:
            c.pop("securityContext")
        out = _dry_create(cp, ns, bare)
        assert 'violates PodSecurity "restricted:latest"' in out, out
    privileged = copy.deepcopy(job)
    privileged["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    _, worker = _built_pods(privileged, ns)
    out = _dry_create(cp, ns, worker)
    assert 'violates PodSecurity "restricted:latest": privileged' in out, out
    cp.kubectl("delete", "namespace", ns, "--wait=false")


# ------------------------------------------------------------------------------------------------------
# Admission


def _job(name: str, **spec: Any) -> dict[str, Any]:
    container = spec.pop("container", {})
    base = {
        "nodes": {"min": 1, "max": 2},
        "template": {
            "spec": {"containers": [{"name": "t", "image": "x", "command": ["train"], **container}]}
        },
    }
    base.update(spec)
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name},
        "spec": base,
    }


def _gpus(n: Any, **limits: Any) -> dict[str, Any]:
    return {"resources": {"limits": {"nvidia.com/gpu": n, **limits}}}


INVALID = [
    (
        "nproc-above-gpus",
        _job("bad", nprocPerNode=9, container=_gpus(8)),
        "nprocPerNode must not be greater than the first container's nvidia.com/gpu limit",
    ),
    (
        "nproc-above-gpus-as-text",
        _job("bad", nprocPerNode=2, container=_gpus("1")),
        "every process needs a GPU of its own; lower it, or set it to auto",
    ),
    ("nproc-word", _job("bad", nprocPerNode="many"), "nprocPerNode must be a whole number from 1, or auto"),
    ("nproc-zero", _job("bad", nprocPerNode=0), "nprocPerNode must be a whole number from 1, or auto"),
    (
        "shm-too-small",
        _job("bad", sharedMemory={"sizeLimit": "16Mi"}),
        "sharedMemory.sizeLimit must be at least 64Mi",
    ),
    ("shm-no-quantity", _job("bad", sharedMemory={"sizeLimit": "big"}), "must be a quantity such as 16Gi"),
    (
        "shm-above-memory",
        _job("bad", sharedMemory={"sizeLimit": "32Gi"}, container=_gpus(1, memory="16Gi")),
        "sharedMemory.sizeLimit must not be more than the first container's memory limit",
    ),
    (
        "grace-too-short",
        _job("bad", restart={"gracePeriod": "30s"}, terminationGracePeriod="30s"),
        "terminationGracePeriod must be longer than restart.gracePeriod",
    ),
    ("grace-no-duration", _job("bad", terminationGracePeriod="long"), "must be a duration such as 500ms"),
    ("refused-zero", _job("bad", createRefusedTimeout="0s"), "createRefusedTimeout must be greater than 0"),
    (
        "master-resources-twice",
        _job(
            "bad",
            master={
                "resources": {"limits": {"cpu": 1}},
                "template": {
                    "spec": {"containers": [{"name": "master", "resources": {"limits": {"cpu": 1}}}]}
                },
            },
        ),
        "give the master's resources in master.resources or in master.template.spec.containers[0].resources",
    ),
    (
        "master-command",
        _job("bad", master={"template": {"spec": {"containers": [{"name": "master", "command": ["sh"]}]}}}),
        'unknown field "spec.master.template.spec.containers[0].command"',
    ),
    (
        "master-host-network",
        _job("bad", master={"template": {"spec": {"hostNetwork": True}}}),
        'unknown field "spec.master.template.spec.hostNetwork"',
    ),
]


@pytest.mark.parametrize(("case", "job", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_real_cluster_specs_are_rejected(
    control_plane: ControlPlane, case: str, job: dict[str, Any], message: str
) -> None:
    out = control_plane.kubectl("create", "-f", "-", input_text=json.dumps(job), check=False)
    assert "created" not in out, f"{case}: the apiserver accepted an invalid job"
    assert message in out, f"{case}: expected {message!r} in {out!r}"


def test_real_cluster_fields_are_defaulted_and_accepted(control_plane: ControlPlane) -> None:
    job = _job(
        "real",
        nprocPerNode="auto",
        container=_gpus(8, memory="64Gi"),
        master={
            "template": {
                "spec": {
                    "tolerations": [{"key": "k", "operator": "Exists"}],
                    "containers": [{"name": "master", "resources": {"limits": {"memory": "1Gi"}}}],
                }
            }
        },
    )
    got = _admitted(control_plane, "default", job)["spec"]
    assert got["nprocPerNode"] == "auto"
    assert got["sharedMemory"] == {"enabled": True}
    assert got["createRefusedTimeout"] == "10m"
    assert "terminationGracePeriod" not in got, "its default follows restart.gracePeriod"
    assert got["master"]["template"]["spec"]["tolerations"] == [{"key": "k", "operator": "Exists"}]
    spec = parse_spec(got)
    assert (spec.nproc_per_node, spec.shared_memory, spec.termination_grace_s) == (8, 16 << 30, 135.0)
    # 8 GPUs, 16Gi of /dev/shm by default: 2Gi a process, capped at the 64Gi memory limit (not reached).
    got = _admitted(control_plane, "default", _job("one", nprocPerNode=4, container=_gpus(4)))["spec"]
    assert got["nprocPerNode"] == 4


# ------------------------------------------------------------------------------------------------------
# Pods the API server refuses (these need the operator: the `cluster` fixture)


def _status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict(cluster.get_json("ej", name, "-n", ns).get("status") or {})


def _condition(cluster: Cluster, ns: str, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(cluster, ns, name).get("conditions", []) if c["type"] == kind), {})


def _failed_create_events(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    items = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.kind=ElasticJob")[
        "items"
    ]
    return [e for e in items if e["reason"] == "FailedCreate"]


def _sleeper(name: str, **spec: Any) -> dict[str, Any]:
    """A job whose workers only sleep: these tests are about creating Pods, not training."""
    job = _job(name, nodes={"min": 2, "max": 2}, **spec)
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["sleep", "120"]
    return job


def test_a_quota_refusal_is_reported_with_the_apis_message_counted_up_and_recovered(cluster: Cluster) -> None:
    cp, ns = cluster.cp, "quota"
    _namespace(cp, ns)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "pods"},
        "spec": {"hard": {"pods": "0"}},
    }
    cp.kubectl("apply", "-n", ns, "-f", "-", input_text=json.dumps(quota))
    # The test control plane runs no quota controller: the status it would publish is set by hand. The
    # quota admission plugin (on by default) enforces status.hard.
    status = {"status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}}
    cp.kubectl(
        "patch",
        "resourcequota",
        "pods",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    cp.kubectl("apply", "-n", ns, "-f", "-", input_text=json.dumps(_sleeper("quota")))
    refused = cluster.wait_for(
        "the ReplicaFailure condition",
        lambda: (c := _condition(cluster, ns, "quota", "ReplicaFailure")).get("status") == "True" and c,
        timeout=60,
    )
    assert refused["reason"] == "FailedCreate"
    # The API server's own words.
    assert (
        'cannot create Pod quota-master: pods "quota-master" is forbidden: exceeded quota: pods'
        in refused["message"]
    )
    assert "limited: pods=0" in refused["message"]
    cluster.wait_for(
        "a refusal counted up rather than repeated",
        lambda: sum(e.get("count", 1) for e in _failed_create_events(cluster, ns)) >= 9,
        timeout=60,
    )
    events = _failed_create_events(cluster, ns)
    assert len(events) <= 3, [e["message"] for e in events]  # one per refused Pod, not one per pass
    assert all(e["type"] == "Warning" for e in events)
    status = _status(cluster, ns, "quota")
    assert status["phase"] == "Created", "not failed before spec.createRefusedTimeout (10m)"
    assert status.get("replacements", 0) == 0, "a refused Pod is no replacement"
    assert sorted(status["refusedPods"]) == ["quota-master", "quota-worker-0-0", "quota-worker-1-0"]
    # The quota is raised: the same Pods are created, and the condition says the job got what it needs.
    raised = {"status": {"hard": {"pods": "10"}, "used": {"pods": "0"}}}
    cp.kubectl(
        "patch",
        "resourcequota",
        "pods",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(raised),
    )
    cluster.wait_for(
        "the refusal settled",
        lambda: _condition(cluster, ns, "quota", "ReplicaFailure").get("status") == "False",
        timeout=60,
    )
    pods = cluster.get_json("pods", "-n", ns, "-l", "phalanx.dev/job=quota")["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == [
        "quota-master",
        "quota-worker-0-0",
        "quota-worker-1-0",
    ]
    status = _status(cluster, ns, "quota")
    assert status.get("replacements", 0) == 0
    assert status["refusedPods"] == []
    cp.kubectl("delete", "namespace", ns, "--wait=false")


def test_a_privileged_template_in_a_restricted_namespace_fails_the_job_in_bounded_time(
    cluster: Cluster,
) -> None:
    """The master Pod (the operator's defaults) is admitted; the workers, asking for a privileged
    container, are refused by the PodSecurity admission plugin; after createRefusedTimeout the job
    fails, with the API server's message, instead of trying forever."""
    cp, ns = cluster.cp, "restricted-refusal"
    _namespace(cp, ns, level="restricted")
    job = _sleeper("priv", createRefusedTimeout="15s", container={"securityContext": {"privileged": True}})
    cp.kubectl("apply", "-n", ns, "-f", "-", input_text=json.dumps(job))
    refused = cluster.wait_for(
        "the ReplicaFailure condition",
        lambda: (c := _condition(cluster, ns, "priv", "ReplicaFailure")).get("status") == "True" and c,
        timeout=60,
    )
    assert (
        'cannot create Pod priv-worker-0-0: pods "priv-worker-0-0" is forbidden: violates PodSecurity'
        in (refused["message"])
    )
    assert 'container "t" must not set securityContext.privileged=true' in refused["message"]
    assert "priv-master" not in _status(cluster, ns, "priv").get("refusedPods", []), "the master passes"
    cluster.wait_for("job Failed", lambda: _status(cluster, ns, "priv").get("phase") == "Failed", timeout=60)
    failed = _condition(cluster, ns, "priv", "Failed")
    assert failed["reason"] == "FailedCreate"
    assert "longer than spec.createRefusedTimeout (15s)" in failed["message"]
    assert "violates PodSecurity" in failed["message"]
    assert _status(cluster, ns, "priv").get("replacements", 0) == 0
    assert len(_failed_create_events(cluster, ns)) <= 2, "one Event per refused Pod, counted up"
    cp.kubectl("delete", "namespace", ns, "--wait=false")
