"""ElasticJobs under Kueue on real containers: a ClusterQueue with quota for one job at a time, a second job
that waits saying why and runs when the first is done, a higher priority that preempts a running job, which
suspends with its progress kept and resumes from its step, and the ClusterQueue's usage right throughout.
Then MultiKueue: a job queued in a manager cluster of its own (a second control plane, its own Kueue and
operator, no node) runs in this cluster as the worker, and its manager shows the worker's status."""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.eventually import eventually

from e2e.conftest import ROOT, Target
from e2e.kube import Kube
from e2e.test_elasticjob import LOADED, example_documents
from phalanx.operator import kueue as kueue_module
from phalanx.operator import multikueue

sys.path.insert(0, str(ROOT / "tests" / "k8s"))
from k8s_harness import kueue as kueue_harness
from k8s_harness.cluster import Cluster
from k8s_harness.controlplane import ControlPlane, find_binaries

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


Documents = list[dict[str, Any]]


def _job(name: str, *, priority: str, steps: int, claim: str = "") -> tuple[Documents, dict[str, Any]]:
    """The example's ConfigMaps and its ElasticJob as ``name`` in the LocalQueue: 2 nodes x 1 process, a
    quarter CPU for each Pod; with ``claim``, it persists only when its Pods are deleted (and at step 0) to
    that shared volume."""
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
    return [d for d in docs if d["kind"] == "ConfigMap"], job


def _submit(t: Target, ns: str, name: str, *, priority: str, steps: int, claim: str = "") -> None:
    config_maps, job = _job(name, priority=priority, steps=steps, claim=claim)
    t.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all([*config_maps, job]))


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


def _usage(t: Target | Kube) -> tuple[float, int]:
    """The ClusterQueue's reserved CPUs and pending Workloads, as Kueue reports them."""
    kube = t if isinstance(t, Kube) else t.kube
    status = kube.get("clusterqueue", QUEUE).get("status") or {}
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


# ------------------------------------------------------------------------------------------------------
# MultiKueue: this cluster is the worker of a manager cluster started here

WORKER = "phalanx-e2e-worker"
WORKLOADS = "workloads.kueue.x-k8s.io"
"""Kueue's Workloads by their full name: ``workloads`` alone is Kubernetes' own (scheduling.k8s.io) here."""
IDENTITY_NS = "phalanx-multikueue"
KUEUE_WORKER_RULES = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"],
     "verbs": ["create", "delete", "get", "list", "watch", "update", "patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "delete", "get", "list", "watch"]},
    {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get"]},
]  # fmt: skip
"""Kueue's part of the worker identity's rights, from its MultiKueue setup guide's role: Workloads, and the
kinds of the frameworks the manager's Kueue has on (it watches them in every worker; here batch Jobs)."""


@contextlib.contextmanager
def _multikueue_identity(t: Target) -> Iterator[str]:
    """The kubeconfig MultiKueue uses in this cluster: a ServiceAccount's token, bound to the chart's role for
    ElasticJobs and to Kueue's for Workloads, as docs/queues.md sets it up. No admin certificate: a missing
    right fails the scenario."""
    chart_role = next(n.rsplit("/", 1)[1] for n in t.kube("get", "clusterrole", "-o", "name").split()
                      if n.endswith("-multikueue"))  # fmt: skip
    subject = [{"kind": "ServiceAccount", "name": "multikueue", "namespace": IDENTITY_NS}]
    rbac = "rbac.authorization.k8s.io/v1"
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": IDENTITY_NS}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "multikueue", "namespace": IDENTITY_NS}},
        {"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": "phalanx-e2e-kueue-worker"},
         "rules": KUEUE_WORKER_RULES},
        *({"apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": f"phalanx-e2e-{role}"},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
           "subjects": subject} for role in (chart_role, "phalanx-e2e-kueue-worker")),
    ]  # fmt: skip
    listed = yaml.safe_dump_all(objects)
    t.kube("apply", "-f", "-", input_text=listed)
    try:
        token = t.kube("create", "token", "multikueue", "-n", IDENTITY_NS, "--duration=2h").strip()
        raw = yaml.safe_load(t.kube("config", "view", "--raw", "--flatten", "--minify"))
        cluster = raw["clusters"][0]["cluster"]
        yield yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "worker",
            "clusters": [{"name": "worker", "cluster": {
                "server": cluster["server"],
                "certificate-authority-data": cluster["certificate-authority-data"],
            }}],
            "users": [{"name": "multikueue", "user": {"token": token}}],
            "contexts": [{"name": "worker", "context": {"cluster": "worker", "user": "multikueue"}}],
        })  # fmt: skip
    finally:
        t.kube("delete", "-f", "-", "--ignore-not-found", "--wait=false", input_text=listed, check=False)


def _manager_queue(kubeconfig: str) -> list[dict[str, Any]]:
    """MultiKueue in the manager: the worker's kubeconfig, the cluster, the admission check and a ClusterQueue
    with the same quota as the worker's."""
    kueue = "kueue.x-k8s.io/v1beta2"
    queue = _cluster_queue()[:2]
    queue[1]["spec"]["admissionChecksStrategy"] = {"admissionChecks": [{"name": WORKER}]}
    return [
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": WORKER, "namespace": kueue_harness.NAMESPACE},
         "data": {"kubeconfig": base64.b64encode(kubeconfig.encode()).decode()}},
        {"apiVersion": kueue, "kind": "MultiKueueCluster", "metadata": {"name": WORKER},
         "spec": {"clusterSource": {"kubeConfig": {"locationType": "Secret", "location": WORKER}}}},
        {"apiVersion": kueue, "kind": "MultiKueueConfig", "metadata": {"name": WORKER},
         "spec": {"clusters": [WORKER]}},
        {"apiVersion": kueue, "kind": "AdmissionCheck", "metadata": {"name": WORKER},
         "spec": {"controllerName": multikueue.MANAGED_BY, "parameters": {
             "apiGroup": "kueue.x-k8s.io", "kind": "MultiKueueConfig", "name": WORKER}}},
        *queue,
    ]  # fmt: skip


def _true(kube: Kube, condition: str, *get: str) -> bool:
    """Whether the object ``kubectl get GET`` names has ``condition`` True."""
    found = kube.get(*get).get("status") or {}
    return any(c["type"] == condition and c["status"] == "True" for c in found.get("conditions") or [])


@contextlib.contextmanager
def _manager_cluster(worker_kubeconfig: str) -> Iterator[tuple[Kube, Path]]:
    """A second control plane with no node, its own Kueue (MultiKueue on, for ElasticJobs) and its own phalanx
    operator, dispatching to this cluster."""
    bin_dir = find_binaries()
    assert bin_dir is not None, "scripts/go-tools builds the control plane"
    assert (bin_dir / "kueue").exists(), "scripts/go-tools builds Kueue"
    state = Path(tempfile.mkdtemp(prefix="phalanx-e2e-manager-"))
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    with contextlib.ExitStack() as stack:
        if os.environ.get("PHALANX_K8S_KEEP") != "1":
            stack.callback(cp.remove)
        stack.callback(cp.stop)
        cp.start()
        kube = Kube(str(bin_dir / "kubectl"), cp.kubeconfig)
        kube("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        kube.wait_for("the ElasticJob CRD established", lambda: _true(
            kube, "Established", "crd", "elasticjobs.phalanx.dev"), timeout=60)  # fmt: skip
        multikueue_config = {"multiKueue": {
            "externalFrameworks": [{"name": kueue_harness.EXTERNAL_FRAMEWORK}], "origin": "phalanx-e2e",
        }}  # fmt: skip
        stack.enter_context(kueue_harness.running(
            binary=bin_dir / "kueue", kubeconfig=cp.kubeconfig, kubectl=bin_dir / "kubectl", state=state,
            settings=multikueue_config,
        ))  # fmt: skip
        kube("apply", "-f", "-", input_text=yaml.safe_dump_all(_manager_queue(worker_kubeconfig)))
        operator = Cluster(cp)
        operator.install_operator_rbac()
        operator.start_operator()
        stack.callback(operator.stop)
        eventually(lambda: _true(kube, "Active", "multikueuecluster", WORKER), timeout=60,
                   what="the worker cluster connected", interval=1.0,
                   diagnose=lambda: kube("get", "multikueuecluster", WORKER, "-o", "yaml", check=False)
                   + _errors(state / "kueue" / "kueue.log"))  # fmt: skip
        yield kube, state / "kueue" / "kueue.log"


def _errors(log: Path) -> str:
    """The last error lines of a Kueue log."""
    return "\n".join([line for line in log.read_text().splitlines() if '"level":"error"' in line][-5:])


def test_multikueue_runs_a_manager_clusters_job_here_and_reports_it_there(kueue: Target, ns: str) -> None:
    t = kueue
    local_queue = yaml.safe_dump({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team", "namespace": ns}, "spec": {"clusterQueue": QUEUE},
    })  # fmt: skip
    t.kube("apply", "-f", "-", input_text=local_queue)
    # 12 s of training: the copy is looked at while it runs (MultiKueue deletes it once it finished).
    config_maps, job = _job("dispatched", priority="", steps=60)
    del job["metadata"]["labels"][kueue_module.PRIORITY_LABEL]
    job["spec"]["managedBy"] = multikueue.MANAGED_BY
    t.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all(config_maps))  # the copy mounts them
    with (
        _multikueue_identity(t) as worker_kubeconfig,
        _manager_cluster(worker_kubeconfig) as (manager, manager_log),
    ):
        # The copy is created by MultiKueue's identity, so this cluster's admission policy holds it to that
        # identity's rights: it may read what the job mounts in the namespace (the example's ConfigMap).
        t.kube("create", "rolebinding", "multikueue-view", "--clusterrole=view", "-n", ns,
               f"--serviceaccount={IDENTITY_NS}:multikueue")  # fmt: skip
        manager("create", "namespace", ns)
        manager("apply", "-f", "-", input_text=local_queue)
        manager("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump(job))
        (workload,) = manager.wait_for("the manager's Workload", lambda: manager.get(
            "workloads.kueue.x-k8s.io", "-n", ns)["items"], timeout=60, namespace=ns)  # fmt: skip

        # Dispatched: the copy here runs with the manager's Workload, adopted; the manager runs nothing.
        def copies() -> list[dict[str, Any]]:
            return list(t.kube.get("ej", "-n", ns, "-l", kueue_module.PREBUILT_LABEL)["items"])

        (copy_here,) = eventually(copies, timeout=120, interval=1.0, what="the job's copy in the worker",
                                  diagnose=lambda: _errors(manager_log))  # fmt: skip
        assert copy_here["metadata"]["labels"][kueue_module.PREBUILT_LABEL] == workload["metadata"]["name"]
        assert "managedBy" not in copy_here["spec"], "Kueue's adapter hands the copy to this operator"
        t.kube.wait_for("the copy training", lambda: _status(t, ns, "dispatched").get("step", -1) >= 1,
                        timeout=240, namespace=ns)  # fmt: skip
        owners = t.kube.get(WORKLOADS, workload["metadata"]["name"], "-n", ns)["metadata"]["ownerReferences"]
        assert [o["uid"] for o in owners] == [copy_here["metadata"]["uid"]], "adopted by the copy"
        assert manager.get("pods", "-n", ns)["items"] == [], "a manager cluster runs no Pod"
        assert manager.get("ej", "dispatched", "-n", ns)["spec"]["suspend"] is False, "admitted there"

        # The worker's status, copied to the manager; finished, the copy is deleted and both queues empty.
        def manager_phase() -> str:
            status = manager.get("ej", "dispatched", "-n", ns).get("status") or {}
            failed = [c for c in status.get("conditions") or [] if c["type"] == "Failed"]
            assert not [c for c in failed if c["status"] == "True"], failed
            return str(status.get("phase"))

        manager.wait_for("the manager's job Succeeded", lambda: manager_phase() == "Succeeded",
                         timeout=300, namespace=ns)  # fmt: skip
        assert manager.get("ej", "dispatched", "-n", ns)["status"]["step"] >= 59, "the worker's steps"
        assert _true(manager, "Finished", WORKLOADS, workload["metadata"]["name"], "-n", ns)
        t.kube.wait_for("the worker's copy deleted by MultiKueue", lambda: not copies(), timeout=120,
                        namespace=ns)  # fmt: skip
        manager.wait_for("the manager's ClusterQueue empty", lambda: _usage(manager) == (0.0, 0), timeout=60)
        t.kube.wait_for("the worker's ClusterQueue empty", lambda: _usage(t) == (0.0, 0), timeout=60)
