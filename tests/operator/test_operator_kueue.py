"""A queued ElasticJob's passes (:mod:`phalanx.operator.kueue`), as pure decisions against the fake cluster of
test_operator_reconcile, with a Workload that Kueue's side of the test admits and evicts by hand. The real
Kueue runs in e2e/test_kueue.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from tests.operator.test_operator_reconcile import FakeCluster, job_obj

from phalanx.operator import kueue
from phalanx.operator.actions import (
    Action,
    AdoptWorkload,
    Create,
    DeletePod,
    DeleteWorkload,
    Observed,
    PatchStatus,
    PatchWorkloadStatus,
    QueueView,
    SetSuspend,
)

FLAVOR = {"nodeLabels": {"pool": "a100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}


@dataclass
class QueuedCluster(FakeCluster):
    workload: dict[str, Any] | None = None
    served: bool = True
    queue_actions: list[Action] = field(default_factory=list)

    def observed(self) -> Observed:
        return Observed(
            job=copy.deepcopy(self.job),
            pods=list(self.pods.values()),
            existing=frozenset(self.objects),
            queue=QueueView(
                served=self.served,
                workload=copy.deepcopy(self.workload),
                flavors={"a100": FLAVOR} if self.workload else {},
                priority={"priority": 7},
            ),
        )

    def carry_out(self, action: Action) -> bool:
        a = action
        if isinstance(a, Create) and a.obj["kind"] == "Workload":
            assert self.workload is None, "a second Workload"
            self.workload = copy.deepcopy(a.obj) | {"status": {}}
            self.workload["metadata"] |= {"resourceVersion": "1", "generation": 1}
        elif isinstance(a, SetSuspend):
            self.suspend(a.suspend)
        elif isinstance(a, DeleteWorkload):
            self.workload = None
        elif isinstance(a, PatchWorkloadStatus):
            assert self.workload is not None
            assert a.resource_version == self.workload["metadata"]["resourceVersion"]
            self.workload["status"].update(a.status)
        elif isinstance(a, AdoptWorkload):
            assert self.workload is not None
            assert a.resource_version == self.workload["metadata"]["resourceVersion"]
            self.workload["metadata"]["ownerReferences"] = [dict(o) for o in a.owners]
        else:
            return False
        self.queue_actions.append(a)
        return True

    def kueue_says(self, **status: Any) -> None:
        assert self.workload is not None
        self.workload["status"] = status
        meta = self.workload["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)


def queued_job(**spec: Any) -> dict[str, Any]:
    job = job_obj(**spec)
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
    return job


def condition(kind: str, value: bool, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": str(value), "reason": reason or kind, "message": message}


def admission(workers: int = 2) -> dict[str, Any]:
    return {
        "clusterQueue": "cq",
        "podSetAssignments": [
            {"name": "master", "flavors": {"cpu": "a100"}, "count": 1},
            {"name": "workers", "flavors": {"cpu": "a100", "nvidia.com/gpu": "a100"}, "count": workers},
        ],
    }


def admitted(c: QueuedCluster, workers: int = 2) -> None:
    c.kueue_says(
        admission=admission(workers),
        conditions=[condition("QuotaReserved", True), condition("Admitted", True)],
    )


def running(c: QueuedCluster) -> None:
    admitted(c)
    c.step()
    c.run_all()
    c.master_says()
    c.step()
    assert c.job["status"]["phase"] == "Running"


def test_a_queued_job_gets_a_workload_and_no_pod_until_kueue_admits_it() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    assert c.workload is not None
    assert c.workload["metadata"]["name"].startswith("elasticjob-j-")
    assert c.workload["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert c.workload["metadata"].get("finalizers") is None, "nothing holds a deleted job"
    spec = c.workload["spec"]
    assert (spec["queueName"], spec["priority"]) == ("team-a", 7)
    assert [(s["name"], s["count"], s.get("minCount")) for s in spec["podSets"]] == [
        ("master", 1, None),
        ("workers", 2, None),
    ]
    assert spec["podSets"][1]["template"]["spec"]["containers"] == [{"name": "t", "image": "i"}]
    assert c.job["spec"]["suspend"] is True, "Kueue's gate, set as its job framework does"
    assert not c.pods, "no Pod at all, not even the master"
    c.kueue_says(conditions=[condition("QuotaReserved", False, "Pending", "insufficient quota for cpu")])
    c.step()
    assert (c.condition("Suspended")["status"], c.condition("Suspended")["reason"]) == ("True", "Queued")
    waiting = c.condition("Admitted")
    assert (waiting["status"], waiting["reason"]) == ("False", "Queued")
    assert "queued in LocalQueue team-a" in waiting["message"]
    assert "insufficient quota for cpu" in waiting["message"]
    assert not c.pods


def test_an_admitted_job_runs_where_its_flavors_are() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    admitted(c)
    actions = c.step()
    assert SetSuspend(False) in actions
    assert c.condition("Admitted")["status"] == "True"
    pods = [a.obj for a in actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert sorted(p["metadata"]["name"] for p in pods) == ["j-master", "j-worker-0-0", "j-worker-1-0"]
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {"pool": "a100"}
        assert {"key": "gpu", "operator": "Exists"} in pod["spec"]["tolerations"]


def test_partial_admission_runs_the_slots_kueue_gave_quota_for() -> None:
    c = QueuedCluster(queued_job(nodes={"min": 1, "max": 3}))
    c.step()
    assert c.workload is not None
    assert c.workload["spec"]["podSets"][1] | {"template": None} == {
        "name": "workers",
        "count": 3,
        "minCount": 1,
        "template": None,
    }
    admitted(c, workers=2)
    c.step()
    assert c.workers() == ["j-worker-0-0", "j-worker-1-0"]
    assert c.pods["j-master"].nodes == "1:2", "the master runs with the admitted range"


def test_an_evicted_job_suspends_keeps_its_progress_and_gives_its_quota_back() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    running(c)
    c.graceful = True
    evicted = condition("Evicted", True, "Preempted", "Preempted to accommodate a higher priority Workload")
    c.kueue_says(
        admission=admission(),
        conditions=[condition("QuotaReserved", True), condition("Admitted", True), evicted],
    )
    actions = c.step()
    assert SetSuspend(True) in actions
    assert not [a for a in actions if isinstance(a, DeletePod)], "not before the master acknowledged"
    assert (c.condition("Admitted")["status"], c.condition("Admitted")["reason"]) == (
        "False",
        "EvictedPreempted",
    )
    c.master_says(phase="Suspended")
    actions = c.step()
    assert sorted(a.name for a in actions if isinstance(a, DeletePod)) == ["j-worker-0-0", "j-worker-1-0"]
    assert not any(isinstance(a, PatchWorkloadStatus) for a in actions), "its Pods still hold the quota"
    c.gone()
    c.step()
    assert c.job["status"]["phase"] == "Suspended"
    assert set(c.pods) == {"j-master"}, "the master keeps the job's state"
    assert c.workload is not None
    status = c.workload["status"]
    assert status["admission"] is None
    kinds = {x["type"]: (x["status"], x["reason"]) for x in status["conditions"]}
    assert kinds["QuotaReserved"] == ("False", "Pending")
    assert kinds["Requeued"] == ("True", "Preempted")
    assert c.job["status"]["replacements"] == 0
    # Readmitted: it resumes, its slots get new Pods that are no replacements.
    admitted(c)
    c.step()
    c.step()
    assert c.workers() == ["j-worker-0-1", "j-worker-1-1"]
    assert c.job["spec"]["suspend"] is False
    assert c.job["status"]["replacements"] == 0


def test_a_finished_job_finishes_its_workload() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    running(c)
    c.master_says(phase="Succeeded")
    c.step()
    c.step()
    assert c.workload is not None
    finished = [x for x in c.workload["status"]["conditions"] if x["type"] == "Finished"]
    assert [(x["status"], x["reason"]) for x in finished] == [("True", "Succeeded")]
    before = len(c.queue_actions)
    c.step()
    assert len(c.queue_actions) == before, "finished once"


def test_a_resized_queued_job_gets_a_new_workload() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    c.job["spec"]["nodes"] = {"min": 2, "max": 4}
    c.step()
    assert c.workload is None
    c.step()
    assert c.workload is not None
    assert c.workload["spec"]["podSets"][1]["count"] == 4


def test_a_queued_job_without_kueue_fails_saying_so() -> None:
    c = QueuedCluster(queued_job(), served=False)
    c.step()
    assert c.job["status"]["phase"] == "Failed"
    assert c.condition("Failed")["reason"] == "QueueUnavailable"
    assert "install Kueue" in c.condition("Failed")["message"]
    assert not c.pods


def test_a_job_kueue_finished_fails_with_kueues_words() -> None:
    c = QueuedCluster(queued_job())
    c.step()
    c.kueue_says(conditions=[condition("Finished", True, "FailedToStart", "no flavor fits")])
    c.step()
    assert c.condition("Failed")["reason"] == "WorkloadFinished"
    assert "no flavor fits" in c.condition("Failed")["message"]
    assert not [a for a in c.queue_actions if isinstance(a, PatchStatus)]


def test_the_crd_takes_the_admitted_condition() -> None:
    from phalanx.operator.crd import CONDITION_TYPES

    assert kueue.CONDITION in CONDITION_TYPES
