"""ElasticJobs under Kueue on real containers: a ClusterQueue with quota for one job at a time, a second job
that waits saying why and runs when the first is done, a higher priority that preempts a running job, which
suspends with its progress kept and resumes from its step, and the ClusterQueue's usage right throughout."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.conftest import Target
from e2e.test_elasticjob import LOADED, example_documents
from phalanx.operator import kueue as kueue_module

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(720)]

QUEUE = "phalanx-e2e"
CPU_PER_JOB = 0.75
"""The master's 250m and two workers' 250m each: the ClusterQueue's 1 CPU holds one job at a time."""


@pytest.fixture(scope="module")
def kueue(phalanx: Target) -> Iterator[Target]:
    """Kueue running against the cluster, with a flavor, a ClusterQueue for one job and two priorities."""
    with contextlib.ExitStack() as stack:
        if phalanx.kueue is not None:
            stack.enter_context(phalanx.kueue())
        elif "workloads.kueue.x-k8s.io" not in phalanx.kube("get", "crd", "-o", "name", check=False):
            pytest.fail("this cluster has no Kueue: install it with ElasticJob.v1alpha1.phalanx.dev in its "
                        "integrations.externalFrameworks (docs/queues.md)")  # fmt: skip
        objects = yaml.safe_dump_all(_cluster_queue())
        phalanx.kube("apply", "-f", "-", input_text=objects)
        stack.callback(phalanx.kube, "delete", "-f", "-", "--ignore-not-found", "--wait=false",
                       input_text=objects, check=False)  # fmt: skip
        yield phalanx


def _cluster_queue() -> list[dict[str, Any]]:
    kueue = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": kueue, "kind": "ResourceFlavor", "metadata": {"name": QUEUE},
         "spec": {"nodeLabels": {"kubernetes.io/os": "linux"}}},
        {"apiVersion": kueue, "kind": "ClusterQueue", "metadata": {"name": QUEUE},
         "spec": {
             "namespaceSelector": {},
             "preemption": {"withinClusterQueue": "LowerPriority"},
             "resourceGroups": [{
                 "coveredResources": ["cpu", "memory"],
                 "flavors": [{"name": QUEUE, "resources": [
                     {"name": "cpu", "nominalQuota": "1"}, {"name": "memory", "nominalQuota": "16Gi"},
                 ]}],
             }],
         }},
        *({"apiVersion": kueue, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}
          for name, value in (("e2e-low", 10), ("e2e-high", 1000))),
    ]  # fmt: skip


def _submit(t: Target, ns: str, name: str, *, priority: str, steps: int, claim: str = "") -> None:
    """The example ElasticJob as ``name`` in the LocalQueue: 2 nodes x 1 process, a quarter CPU for each Pod;
    with ``claim``, it persists only when its Pods are deleted (and at step 0) to that shared volume."""
    docs = example_documents()
    job = copy.deepcopy(next(d for d in docs if d["kind"] == "ElasticJob"))
    job["metadata"] = {
        "name": name,
        "labels": {kueue_module.QUEUE_LABEL: "team", kueue_module.PRIORITY_LABEL: priority},
    }
    spec = job["spec"]
    spec["nprocPerNode"] = 1
    quarter = {"requests": {"cpu": "250m", "memory": "512Mi"}}
    spec["master"] = {"resources": quarter}
    (container,) = spec["template"]["spec"]["containers"]
    container["resources"] = quarter
    container["env"] = [{"name": k, "value": v} for k, v in (
        ("TINY_STEPS", str(steps)), ("TINY_STEP_S", "0.2"), ("TINY_PERSIST_EVERY", "100000"))]  # fmt: skip
    if claim:
        spec["checkpoint"] = {"storagePath": "/ckpt"}
        container["volumeMounts"].append({"name": "ckpt", "mountPath": "/ckpt"})
        spec["template"]["spec"]["volumes"].append(
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": claim}}
        )
    config_map = [d for d in docs if d["kind"] == "ConfigMap"]
    t.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all([*config_map, job]))


def _status(t: Target, ns: str, name: str) -> dict[str, Any]:
    return dict(t.kube.get("ej", name, "-n", ns).get("status") or {})


def _condition(t: Target, ns: str, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(t, ns, name).get("conditions") or [] if c["type"] == kind), {})


def _pods(t: Target, ns: str, name: str, role: str = "") -> list[dict[str, Any]]:
    selector = f"phalanx.dev/job={name}" + (f",phalanx.dev/role={role}" if role else "")
    return [p for p in t.kube.get("pods", "-n", ns, "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def _phase(t: Target, ns: str, name: str, phase: str) -> bool:
    status = _status(t, ns, name)
    failed = [c for c in status.get("conditions") or [] if c["type"] == "Failed" and c["status"] == "True"]
    assert not failed, f"{name} failed: {failed[0].get('message')}"
    return status.get("phase") == phase


def _usage(t: Target) -> tuple[float, int]:
    """The ClusterQueue's reserved CPUs and pending Workloads, as Kueue reports them."""
    status = t.kube.get("clusterqueue", QUEUE).get("status") or {}
    cpu = 0.0
    for flavor in status.get("flavorsReservation") or []:
        for resource in flavor.get("resources") or []:
            if resource["name"] == "cpu":
                total = str(resource.get("total", "0"))
                cpu += float(total[:-1]) / 1000 if total.endswith("m") else float(total)
    return cpu, int(status.get("pendingWorkloads", 0))


def test_jobs_queue_for_their_quota_and_a_preempted_job_resumes_from_its_step(kueue: Target, ns: str) -> None:
    t = kueue
    t.kube("apply", "-f", "-", input_text=yaml.safe_dump({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team", "namespace": ns}, "spec": {"clusterQueue": QUEUE},
    }))  # fmt: skip
    claim = t.shared_storage(ns)

    # The first job is admitted and placed by its flavor; the second waits with no Pod at all, saying why.
    _submit(t, ns, "first", priority="e2e-low", steps=150, claim=claim)
    t.kube.wait_for("the first job training", lambda: _status(t, ns, "first").get("step", -1) >= 8,
                    timeout=300, namespace=ns)  # fmt: skip
    for pod in _pods(t, ns, "first"):
        assert pod["spec"]["nodeSelector"]["kubernetes.io/os"] == "linux", "the flavor's node labels"
    _submit(t, ns, "second", priority="e2e-low", steps=10)
    t.kube.wait_for(
        "the second job queued for quota",
        lambda: "insufficient" in _condition(t, ns, "second", "Admitted").get("message", ""),
        timeout=60, namespace=ns,
    )  # fmt: skip
    assert _condition(t, ns, "second", "Admitted")["reason"] == "Queued"
    assert _condition(t, ns, "second", "Suspended")["reason"] == "Queued"
    assert _pods(t, ns, "second") == [], "a job never admitted has no Pod, not even its master"
    t.kube.wait_for("the first job's quota reserved, the second pending",
                    lambda: _usage(t) == (CPU_PER_JOB, 1), timeout=30, namespace=ns)  # fmt: skip

    # A higher priority preempts the first job: it suspends, its agents persisting the newest step.
    _submit(t, ns, "urgent", priority="e2e-high", steps=10)
    t.kube.wait_for("the first job preempted and suspended", lambda: _phase(t, ns, "first", "Suspended"),
                    timeout=180, namespace=ns)  # fmt: skip
    assert _condition(t, ns, "first", "Admitted")["reason"] == "EvictedPreempted"
    assert _pods(t, ns, "first", "worker") == []
    reached = int(_status(t, ns, "first")["step"])
    t.kube.wait_for("the urgent job succeeded", lambda: _phase(t, ns, "urgent", "Succeeded"),
                    timeout=240, namespace=ns)  # fmt: skip

    # Readmitted before the second (the older of the two), the first resumes from the step it persisted.
    t.kube.wait_for(
        "the first job resumed",
        lambda: _status(t, ns, "first").get("phase") == "Running" and len(_pods(t, ns, "first")) == 3,
        timeout=240, namespace=ns,
    )  # fmt: skip
    assert _pods(t, ns, "second") == [], "the second still waits: the quota is the first's again"
    t.kube.wait_for(
        "the resumed job loaded its step", lambda: _loaded(t, ns, "first"), timeout=180, namespace=ns
    )
    assert min(step for step, _ in _loaded(t, ns, "first")) >= reached - 1, (reached, _loaded(t, ns, "first"))
    t.kube.wait_for("the first job succeeded", lambda: _phase(t, ns, "first", "Succeeded"),
                    timeout=300, namespace=ns)  # fmt: skip
    status = _status(t, ns, "first")
    assert (status.get("replacements", 0), status.get("disruptions", 0)) == (0, 0), (
        "preemption costs no budget"
    )
    t.kube.wait_for("the second job succeeded", lambda: _phase(t, ns, "second", "Succeeded"),
                    timeout=300, namespace=ns)  # fmt: skip
    t.kube.wait_for("the ClusterQueue empty", lambda: _usage(t) == (0.0, 0), timeout=60, namespace=ns)


def _loaded(t: Target, ns: str, name: str) -> list[tuple[int, str]]:
    """(step, source) of every step the job's live worker Pods loaded."""
    found = []
    for pod in _pods(t, ns, name, "worker"):
        logs = t.kube("logs", "-n", ns, pod["metadata"]["name"], "--all-containers", check=False)
        found += [(int(step), source) for step, source in LOADED.findall(logs)]
    return found
