"""ElasticJobs under MultiKueue, as pure decisions: the manager cluster's passes
(:mod:`phalanx.operator.multikueue`) and the worker's copy that runs with its prebuilt Workload
(:mod:`phalanx.operator.kueue`). The real two-cluster run is e2e/test_kueue.py's."""

from __future__ import annotations

import copy
from typing import Any

from tests.operator.test_operator_kueue import QueuedCluster, admitted, condition, queued_job, running

from phalanx.operator import kueue, multikueue
from phalanx.operator.actions import AdoptWorkload, Create, PatchStatus, PatchWorkloadStatus, SetSuspend


def dispatched_job(**spec: Any) -> dict[str, Any]:
    return queued_job(managedBy=multikueue.MANAGED_BY, **spec)


def dispatched_to(c: QueuedCluster, worker: str = "worker-1", *evicted: dict[str, Any]) -> None:
    """Kueue in the manager: a worker admitted the copy, so the Workload is admitted here and names it."""
    c.kueue_says(
        admission={"clusterQueue": "cq", "podSetAssignments": []},
        clusterName=worker,
        conditions=[condition("QuotaReserved", True), condition("Admitted", True), *evicted],
        admissionChecks=[{"name": "mk", "state": "Ready", "message": f'reservation on "{worker}"'}],
    )


def the_worker_reports(c: QueuedCluster, **status: Any) -> None:
    """Kueue's adapter copies the worker's whole status over the manager's job."""
    c.job["status"] = copy.deepcopy(status)


def test_a_dispatched_job_is_queued_here_and_runs_nowhere_here() -> None:
    c = QueuedCluster(dispatched_job())
    actions = c.step()
    assert c.workload is not None
    assert c.workload["spec"]["queueName"] == "team-a"
    assert c.job["spec"]["suspend"] is True
    assert not c.pods, "no Pod in a manager cluster"
    assert not c.objects, "no Service or Secret either"
    assert not [a for a in actions if isinstance(a, Create) and a.obj["kind"] != "Workload"]
    c.kueue_says(
        conditions=[condition("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue cq")],
        admissionChecks=[{"name": "mk", "state": "Pending", "message": "no worker has admitted it yet"}],
    )
    c.step()
    waiting = c.condition("Admitted")
    assert (waiting["status"], waiting["reason"]) == ("False", "Queued")
    assert "no worker has admitted it yet" in waiting["message"], "the admission check's words"
    assert c.condition("Suspended")["reason"] == "Queued"

    dispatched_to(c)
    actions = c.step()
    assert SetSuspend(False) in actions, "admitted, as Kueue's framework unsuspends its own jobs"
    assert not [a for a in actions if isinstance(a, PatchStatus)], "the status is now the worker's"
    assert not c.pods
    the_worker_reports(c, phase="Running", step=40, conditions=[condition("Running", True)])
    for _ in range(3):
        assert c.step() == [], "nothing to do while the worker runs it"
    assert c.job["status"] == {"phase": "Running", "step": 40, "conditions": [condition("Running", True)]}


def test_a_dispatched_job_that_finished_is_deleted_after_its_ttl() -> None:
    c = QueuedCluster(dispatched_job(ttlAfterFinished="10s"))
    c.step()
    dispatched_to(c)
    c.step()
    c.workload["status"]["conditions"].append(condition("Finished", True, "Succeeded"))  # type: ignore[index]
    succeeded = condition("Succeeded", True) | {"lastTransitionTime": "1970-01-01T00:16:40Z"}  # at 1000 s
    the_worker_reports(c, phase="Succeeded", conditions=[succeeded])
    assert c.step() == []
    c.now += 20
    c.step()
    assert c.deleted_job, "the TTL read from the worker's status"
    assert not c.pods


def test_a_dispatched_job_evicted_here_gives_its_quota_back_once_the_worker_stopped() -> None:
    c = QueuedCluster(dispatched_job())
    c.step()
    dispatched_to(c)
    c.step()
    the_worker_reports(c, phase="Running")
    dispatched_to(c, "worker-1", condition("Evicted", True, "Preempted", "preempted in the manager"))
    actions = c.step()
    assert SetSuspend(True) in actions
    assert not [a for a in actions if isinstance(a, PatchWorkloadStatus)], "the worker's copy still runs"
    the_worker_reports(c, phase="Suspended")
    c.step()
    assert c.workload is not None
    assert c.workload["status"]["admission"] is None, "requeued: Kueue then deletes the worker's copy"


def test_a_dispatched_job_without_a_queue_fails_saying_so() -> None:
    job = dispatched_job()
    job["metadata"]["labels"] = {}
    c = QueuedCluster(job)
    c.step()
    assert c.condition("Failed")["reason"] == "NotQueued"
    assert kueue.QUEUE_LABEL in c.condition("Failed")["message"]
    assert c.workload is None


def test_a_dispatched_job_kueue_finished_before_any_worker_ran_it_fails_with_kueues_words() -> None:
    c = QueuedCluster(dispatched_job())
    c.step()
    c.kueue_says(conditions=[condition("Finished", True, "AdmissionCheckRejected", "no worker fits")])
    c.step()
    assert c.condition("Failed")["reason"] == "WorkloadFinished"
    assert "no worker fits" in c.condition("Failed")["message"]


def worker_copy() -> dict[str, Any]:
    """The job as Kueue's adapter creates it in a worker: no managedBy, the prebuilt Workload's label."""
    job = queued_job(suspend=True)
    job["metadata"]["labels"][kueue.PREBUILT_LABEL] = "elasticjob-j-abcde"
    job["metadata"]["labels"]["kueue.x-k8s.io/multikueue-origin"] = "manager"
    return job


def prebuilt(c: QueuedCluster, nodes: int = 2) -> None:
    """MultiKueue's copy of the manager's Workload: same name, labels, spec; no owner here."""
    c.workload = {
        "metadata": {"name": "elasticjob-j-abcde", "namespace": "ns", "resourceVersion": "1",
                     "generation": 1},
        "spec": {"queueName": "team-a", "podSets": [
            {"name": "master", "count": 1}, {"name": "workers", "count": nodes},
        ]},
        "status": {},
    }  # fmt: skip


def test_a_worker_copy_runs_with_its_prebuilt_workload_and_adopts_it() -> None:
    c = QueuedCluster(worker_copy())
    c.step()
    assert c.workload is None, "a prebuilt Workload is never created by the job"
    assert "prebuilt Workload elasticjob-j-abcde" in c.condition("Admitted")["message"]
    prebuilt(c)
    admitted(c)
    actions = c.step()
    assert [a for a in actions if isinstance(a, AdoptWorkload)]
    assert c.workload is not None
    (owner,) = c.workload["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == ("u", True)
    running(c)
    assert not [a for a in c.step() if isinstance(a, AdoptWorkload)], "adopted once"
    c.master_says(phase="Succeeded")
    c.step()
    c.step()
    finished = [x for x in c.workload["status"]["conditions"] if x["type"] == "Finished"]
    assert [x["status"] for x in finished] == ["True"], "MultiKueue then finishes the manager's Workload"


def test_a_prebuilt_workload_for_other_node_counts_fails_the_job() -> None:
    c = QueuedCluster(worker_copy())
    prebuilt(c, nodes=4)
    c.step()
    assert c.condition("Failed")["reason"] == "WorkloadOutOfSync"
    assert not c.pods
