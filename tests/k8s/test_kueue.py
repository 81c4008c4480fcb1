"""ElasticJobs under a real Kueue (its manager built by scripts/go-tools, with its webhooks): a ClusterQueue
with quota for one job at a time, three jobs, a preemption, and the preempted job's progress kept."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.cluster import Cluster
from k8s_harness.kubelet import IMAGE_USER
from k8s_harness.kueue import Kueue

from phalanx.operator import kueue as kueue_module

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SHARED = "/var/run/phalanx-test/shared"
NS = "queued"
CPU_PER_JOB = 1.5
"""The master's 0.5 CPU and two workers' 0.5 each: the ClusterQueue's 2 CPUs hold one job at a time."""


def _queue_objects() -> list[dict[str, Any]]:
    """A flavor of the process nodes only (the simulated ones run nothing), a ClusterQueue whose quota fits
    one job and which preempts lower priorities for a higher one, its LocalQueue, and two priorities."""
    kueue = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": kueue, "kind": "ResourceFlavor", "metadata": {"name": "process-nodes"},
         "spec": {"nodeLabels": {"phalanx.dev/test-kubelet": "process"}}},
        {"apiVersion": kueue, "kind": "ClusterQueue", "metadata": {"name": "phalanx-test"},
         "spec": {
             "namespaceSelector": {},
             "preemption": {"withinClusterQueue": "LowerPriority"},
             "resourceGroups": [{
                 "coveredResources": ["cpu", "memory"],
                 "flavors": [{"name": "process-nodes", "resources": [
                     {"name": "cpu", "nominalQuota": "2"}, {"name": "memory", "nominalQuota": "64Gi"},
                 ]}],
             }],
         }},
        {"apiVersion": kueue, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": NS},
         "spec": {"clusterQueue": "phalanx-test"}},
        {"apiVersion": kueue, "kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10},
        {"apiVersion": kueue, "kind": "WorkloadPriorityClass", "metadata": {"name": "high"}, "value": 1000},
    ]  # fmt: skip


def _job(name: str, *, priority: str, steps: int, shared: Path, s3: dict[str, str]) -> dict[str, Any]:
    """2 nodes x 1 process of examples/ddp_mlp.py in the LocalQueue, saving every step to shared memory and
    persisting only when its Pods are deleted (and at step 0); its steps logged to ``shared``."""
    secret = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    env = [{"name": k, "value": v} for k, v in s3.items() if k not in secret] + [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": "s3", "key": k}}} for k in sorted(secret)
    ]
    half_a_cpu = {"requests": {"cpu": "500m", "memory": "256Mi"}}
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {
            "name": name,
            "labels": {kueue_module.QUEUE_LABEL: "team", kueue_module.PRIORITY_LABEL: priority},
        },
        "spec": {
            "nodes": {"min": 2, "max": 2},
            "heartbeat": {"interval": "1s", "timeout": "6s"},
            "restart": {"gracePeriod": "3s", "maxEvictions": 0},
            "checkpoint": {"storagePath": f"s3://{NS}/{name}"},
            "master": {"resources": half_a_cpu},
            "template": {"spec": {
                "containers": [{
                    "name": "trainer", "image": "x", "resources": half_a_cpu,
                    "command": [
                        "python", str(ROOT / "examples" / "ddp_mlp.py"), "--flash",
                        "--persist-every", "100000", "--steps", str(steps), "--step-time", "0.1",
                        "--step-log", f"{SHARED}/{name}.jsonl",
                    ],
                    "env": env,
                    "volumeMounts": [{"name": "shared", "mountPath": SHARED}],
                }],
                "volumes": [{"name": "shared", "hostPath": {"path": str(shared)}}],
            }},
        },
    }  # fmt: skip


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(cluster.get_json("ej", name, "-n", NS).get("status") or {})


def _condition(cluster: Cluster, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(cluster, name).get("conditions") or [] if c["type"] == kind), {})


def _pods(cluster: Cluster, name: str, role: str = "") -> list[dict[str, Any]]:
    selector = f"phalanx.dev/job={name}" + (f",phalanx.dev/role={role}" if role else "")
    return list(cluster.get_json("pods", "-n", NS, "-l", selector)["items"])


def _steps(shared: Path, name: str) -> list[dict[str, Any]]:
    log = shared / f"{name}.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []


def _usage(cluster: Cluster) -> tuple[float, int]:
    """The ClusterQueue's reserved CPUs and pending Workloads, as Kueue reports them."""
    status = cluster.get_json("clusterqueues", "phalanx-test").get("status") or {}
    cpu = 0.0
    for flavor in status.get("flavorsReservation") or []:
        for resource in flavor.get("resources") or []:
            if resource["name"] == "cpu":
                total = str(resource.get("total", "0"))
                cpu += float(total[:-1]) / 1000 if total.endswith("m") else float(total)
    return cpu, int(status.get("pendingWorkloads", 0))


def _workload(cluster: Cluster, name: str) -> dict[str, Any]:
    items = cluster.get_json("workloads", "-n", NS, "-l", f"phalanx.dev/job={name}")["items"]
    assert len(items) == 1, [w["metadata"]["name"] for w in items]
    return dict(items[0])


def _not_failed(cluster: Cluster, *names: str) -> bool:
    for name in names:
        failed = _condition(cluster, name, "Failed")
        assert failed.get("status") != "True", f"{name} failed: {failed.get('message')}"
    return False


@pytest.mark.timeout(420)
def test_jobs_wait_in_the_queue_and_a_preempted_job_resumes_from_its_step(
    cluster: Cluster, kueue: Kueue, tmp_path: Path, minio: str
) -> None:
    from phalanx.checkpoint import storage as storage_lib

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, *IMAGE_USER)
    storage_lib.S3Storage(NS).client.create_bucket(Bucket=NS)
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    s3 = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_REGION", *keys)}
    kubectl = cluster.cp.kubectl
    kubectl("create", "namespace", NS)
    kubectl("create", "secret", "generic", "s3", "-n", NS, *(f"--from-literal={k}={s3[k]}" for k in keys))
    kubectl("apply", "-f", "-", input_text=yaml.safe_dump_all(_queue_objects()))

    def submit(name: str, priority: str, steps: int) -> None:
        job = _job(name, priority=priority, steps=steps, shared=shared, s3=s3)
        kubectl("create", "-n", NS, "-f", "-", input_text=json.dumps(job))

    # The first job is admitted and runs where its flavor is; the second waits, without a Pod, saying why.
    submit("first", "low", 300)
    cluster.wait_for(
        "the first job training",
        lambda: len(_steps(shared, "first")) >= 10 or _not_failed(cluster, "first"),
        timeout=120,
    )
    for pod in _pods(cluster, "first"):
        assert pod["spec"]["nodeSelector"]["phalanx.dev/test-kubelet"] == "process", pod["metadata"]["name"]
    submit("second", "low", 20)
    cluster.wait_for(
        "the second job queued",
        lambda: (
            _condition(cluster, "second", "Admitted").get("reason") == "Queued"
            and "insufficient" in _condition(cluster, "second", "Admitted").get("message", "")
        ),
        timeout=60,
    )
    assert _pods(cluster, "second") == [], "a job Kueue has not admitted has no Pod, not even its master"
    assert _status(cluster, "second")["phase"] == "Suspended"
    assert _condition(cluster, "second", "Suspended")["reason"] == "Queued"
    cluster.wait_for(  # the ClusterQueue's status is written a moment after its Workloads'
        "the first job's quota reserved, the second pending",
        lambda: _usage(cluster) == (CPU_PER_JOB, 1),
        timeout=30,
    )

    # A job of higher priority preempts the first, which suspends with its progress persisted.
    submit("urgent", "high", 20)
    cluster.wait_for(
        "the first job evicted and suspended",
        lambda: _status(cluster, "first").get("phase") == "Suspended" or _not_failed(cluster, "first"),
        timeout=120,
    )
    assert _condition(cluster, "first", "Admitted")["reason"] == "EvictedPreempted"
    assert _pods(cluster, "first", "worker") == []
    assert len(_pods(cluster, "first", "master")) == 1, "the master keeps the job's state"
    reached = _steps(shared, "first")[-1]["step"]
    committed = storage_lib.committed_steps(storage_lib.open_storage(f"s3://{NS}/first"))
    assert max(committed) >= reached - 1, (committed, reached)
    evicted_at = time.time()
    cluster.wait_for(
        "the urgent job succeeded",
        lambda: _status(cluster, "urgent").get("phase") == "Succeeded" or _not_failed(cluster, "urgent"),
        timeout=120,
    )
    finished = {c["type"]: c["status"] for c in _workload(cluster, "urgent")["status"]["conditions"]}
    assert finished.get("Finished") == "True", "a finished job frees its quota at once"

    # Readmitted (the older of the two waiting), the first job resumes after the step it persisted.
    cluster.wait_for(
        "the first job succeeded",
        lambda: _status(cluster, "first").get("phase") == "Succeeded" or _not_failed(cluster, "first"),
        timeout=150,
    )
    after = [s for s in _steps(shared, "first") if s["time"] > evicted_at]
    assert after[0]["step"] == max(committed) + 1, "resumed from the step its agents persisted"
    assert after[-1]["step"] == 299
    status = _status(cluster, "first")
    spent = (status.get("replacements", 0), status.get("disruptions", 0))
    assert spent == (0, 0), "a preemption costs no budget"
    cluster.wait_for(
        "the second job succeeded",
        lambda: _status(cluster, "second").get("phase") == "Succeeded" or _not_failed(cluster, "second"),
        timeout=120,
    )
    cluster.wait_for("the ClusterQueue empty", lambda: _usage(cluster) == (0.0, 0), timeout=30)
    kubectl("delete", "namespace", NS, "--wait=false")
    queues = yaml.safe_dump_all(_queue_objects()[:2])
    kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input_text=queues)
