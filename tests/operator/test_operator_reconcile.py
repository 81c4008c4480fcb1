"""Reconciliation decisions, tested as a pure function against a small fake cluster that behaves
(created Pods appear, deleted Pods vanish, status patches merge)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.settings import OperatorSettings
from phalanx.operator import workers as workers_module
from phalanx.operator.actions import (
    Action,
    CordonNode,
    Create,
    DeleteJob,
    DeletePod,
    Event,
    Observed,
    PatchPodGroup,
    PatchStatus,
    PodView,
)
from phalanx.operator.reconcile import reconcile
from phalanx.operator.supporting import supporting_objects

SETTINGS = OperatorSettings()


def job_obj(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "nodes": {"min": 2, "max": 2},
        "template": {"spec": {"containers": [{"name": "t", "image": "i", "command": ["python", "t.py"]}]}},
    }
    base.update(spec)
    return {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": base,
        "status": {},
    }


@dataclass
class FakeCluster:
    job: dict[str, Any]
    pods: dict[str, PodView] = field(default_factory=dict)
    objects: set[tuple[str, str]] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)
    deletes: list[DeletePod] = field(default_factory=list)
    deleted_job: list[DeleteJob] = field(default_factory=list)
    pod_group: dict[str, Any] | None = None
    pod_group_api: bool = True
    admission_policy: bool = True
    settings: OperatorSettings = SETTINGS
    """The operator's settings, its trust switches (cordon_nodes, network_policy) included."""
    foreign: set[tuple[str, str]] = field(default_factory=set)
    graceful: bool = False
    """Pods deleted with a grace period stay, terminating, until :meth:`gone` (as their agents persist)."""
    now: float = 1000.0

    def step(self, *, dies_before_closing_patch: bool = False) -> list[Action]:
        """One pass, its actions carried out; ``dies_before_closing_patch``: the operator died after every
        other action of the pass, before the status patch that ends it."""
        actions = reconcile(self.observed(), now=self.now, settings=self.settings, new_token="tok")
        carried_out = actions
        if dies_before_closing_patch and actions and isinstance(actions[-1], PatchStatus):
            carried_out = actions[:-1]
        for a in carried_out:
            if self.carry_out(a):
                continue
            if isinstance(a, Create):
                kind, name = a.obj["kind"], a.obj["metadata"]["name"]
                if kind == "Pod":
                    assert name not in self.pods, f"duplicate Pod {name}"
                    role = a.obj["metadata"]["labels"]["phalanx.dev/role"]
                    nodes = a.obj["metadata"].get("annotations", {}).get("phalanx.dev/nodes", "")
                    self.pods[name] = PodView(name=name, role=role, phase="Pending", nodes=nodes)
                elif kind == "PodGroup":
                    assert self.pod_group is None, "a second PodGroup"
                    self.pod_group = copy.deepcopy(a.obj)
                else:
                    self.objects.add((kind, name))
            elif isinstance(a, DeletePod):
                self.deletes.append(a)
                pod = self.pods.get(a.name)
                if pod and self.graceful and a.grace_period_s != 0:
                    self.pods[a.name] = dataclasses.replace(pod, terminating=True)
                else:
                    self.pods.pop(a.name, None)
            elif isinstance(a, PatchStatus):
                self.job["status"].update(a.status)
            elif isinstance(a, PatchPodGroup):
                assert self.pod_group is not None
                assert a.name == self.pod_group["metadata"]["name"]
                if a.scheduler == "coscheduling":
                    self.pod_group["spec"]["minMember"] = a.min_count
                else:
                    self.pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"] = a.min_count
            elif isinstance(a, Event):
                self.events.append(a)
            elif isinstance(a, CordonNode):
                self.cordoned.append(a.node)
            elif isinstance(a, DeleteJob):
                self.deleted_job.append(a)
        self.now += 1
        return actions

    def observed(self) -> Observed:
        return Observed(
            job=copy.deepcopy(self.job),
            pods=list(self.pods.values()),
            existing=frozenset(self.objects),
            pod_group=copy.deepcopy(self.pod_group),
            pod_group_api=self.pod_group_api,
            admission_policy=self.admission_policy,
            foreign=frozenset(self.foreign),
        )

    def carry_out(self, action: Action) -> bool:
        """Carries out an action this fake handles beyond the ones below; True if it did."""
        return False

    def run_all(self, *, node: str = "m1") -> None:
        for name, pod in list(self.pods.items()):
            if pod.phase == "Pending":
                self.pods[name] = PodView(
                    name=name, role=pod.role, phase="Running", node_name=node, nodes=pod.nodes
                )

    def gone(self) -> None:
        """The terminating Pods' processes exited: the Pods vanish."""
        self.pods = {n: pod for n, pod in self.pods.items() if not pod.terminating}

    def master_says(self, **status: Any) -> None:
        """The master publishes its view; by default of the spec as it is now (its generation)."""
        generation = self.job["metadata"]["generation"]
        self.job["status"]["master"] = {"phase": "Running", "observedGeneration": generation, **status}

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def condition(self, kind: str) -> dict[str, Any]:
        return next(x for x in self.job["status"]["conditions"] if x["type"] == kind)

    def workers(self) -> list[str]:
        return sorted(n for n, pod in self.pods.items() if pod.role == "worker")

    def suspend(self, value: bool) -> None:
        self.job["spec"]["suspend"] = value
        self.job["metadata"]["generation"] += 1  # as the API server does for every spec change


def started(**spec: Any) -> FakeCluster:
    c = FakeCluster(job_obj(**spec))
    c.step()
    c.run_all()
    c.master_says()
    c.step()
    return c


def test_new_job_gets_everything_once() -> None:
    c = FakeCluster(job_obj())
    actions = c.step()
    kinds = [a.obj["kind"] for a in actions if isinstance(a, Create)]
    assert kinds == [
        "Secret",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "NetworkPolicy",
        "NetworkPolicy",
        "Pod",
        "Pod",
        "Pod",
    ]
    assert set(c.pods) == {"j-master", "j-worker-0-0", "j-worker-1-0"}
    assert c.job["status"]["phase"] == "Created"
    assert {"Created", "MasterCreated", "WorkerCreated"} <= set(c.reasons())
    again = c.step()
    assert not [a for a in again if isinstance(a, Create)], "a second pass creates nothing"


def test_job_runs_when_master_and_min_nodes_are_up() -> None:
    c = started()
    assert c.job["status"]["phase"] == "Running"
    assert c.job["status"]["nodes"] == 2
    conds = {x["type"]: x["status"] for x in c.job["status"]["conditions"]}
    assert conds["MasterReady"] == "True"
    assert conds["Running"] == "True"
    assert conds["Restarting"] == "False"
    assert "Running" in c.reasons()


def test_failed_worker_is_replaced_with_next_incarnation() -> None:
    c = started()
    c.pods["j-worker-1-0"] = PodView(
        name="j-worker-1-0", role="worker", phase="Failed", exit_code=137, reason="Error"
    )
    c.step()
    assert "j-worker-1-1" in c.pods
    assert c.job["status"]["replacements"] == 1
    assert c.job["status"]["phase"] == "Restarting"
    assert c.job["status"]["workerIncarnations"] == [0, 1]
    assert any("exit code 137" in e.message for e in c.events if e.reason == "WorkerReplaced")
    assert "j-worker-1-0" not in c.pods, "the failed Pod is garbage once its replacement exists"
    c.run_all()
    c.step()
    assert c.job["status"]["phase"] == "Running"


def test_vanished_worker_is_replaced_without_reusing_its_name() -> None:
    c = started()
    del c.pods["j-worker-0-0"]
    c.step()
    assert "j-worker-0-1" in c.pods
    assert c.job["status"]["replacements"] == 1


def test_pods_named_like_workers_the_operator_never_makes_are_not_its_workers() -> None:
    """Anyone who may create Pods can name one after the job (and give it the job's ownerReference): a slot
    of 80 million would size the pass's lists by it (about 640 MB), and an incarnation that makes the name
    longer than a DNS label would name every later replacement beyond one. Neither counts as a worker."""
    c = started()
    for name in ("j-worker-80000000-0", "j-worker-1-" + "9" * 60):
        c.pods[name] = PodView(name=name, role="worker", phase="Running", node_name="m1")
    actions = c.step()
    assert c.job["status"]["workerIncarnations"] == [0, 0]
    assert not [a for a in actions if isinstance(a, (Create, DeletePod))], "nothing made, nothing touched"
    del c.pods["j-worker-1-0"]
    c.step()
    assert "j-worker-1-1" in c.pods, "the real slot 1 is replaced under the name that follows its own"


def test_replacement_budget_exhausted_fails_the_job() -> None:
    c = FakeCluster(job_obj(restart={"maxEvictions": 1}))
    c.step()
    c.run_all()
    c.master_says()
    c.step()
    for _ in range(2):
        name = next(n for n, p in c.pods.items() if p.role == "worker" and p.phase == "Running")
        c.pods[name] = PodView(name=name, role="worker", phase="Failed", exit_code=1)
        c.step()
        c.run_all()
    assert c.job["status"]["phase"] == "Failed"
    failed = next(x for x in c.job["status"]["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "ReplacementBudgetExhausted"
    assert "restart.maxEvictions=1" in failed["message"]


def _disrupt(
    c: FakeCluster, name: str, reason: str, *, phase: str = "Running", terminating: bool = True
) -> None:
    """What the cluster does to a Pod it takes: the condition, then a deletion (or, for node pressure, the
    kubelet fails the Pod)."""
    pod = c.pods[name]
    c.pods[name] = dataclasses.replace(pod, phase=phase, terminating=terminating, disruption=reason)


def test_pods_the_cluster_takes_are_replaced_without_touching_the_eviction_budget() -> None:
    """A drain's eviction, a preemption and a kubelet's node-pressure eviction, with maxEvictions 0: each
    worker is replaced, counted in status.disruptions, said in an Event, and the job never fails."""
    c = started(restart={"maxEvictions": 0})
    for reason, phase, terminating in [
        ("EvictionByEvictionAPI", "Running", True),
        ("PreemptionByScheduler", "Running", True),
        ("Evicted", "Failed", False),
    ]:
        name = next(n for n, p in c.pods.items() if p.role == "worker" and p.live)
        _disrupt(c, name, reason, phase=phase, terminating=terminating)
        c.step()
        assert c.job["status"]["phase"] == "Restarting", reason
        assert "not charged" in c.condition("Restarting")["message"]
        c.gone()
        c.run_all()
        c.step()
        assert c.job["status"]["phase"] == "Running", reason
    assert (c.job["status"]["replacements"], c.job["status"]["disruptions"]) == (0, 3)
    said = [e.message for e in c.events if e.reason == "WorkerDisrupted"]
    assert len(said) == 3, said
    assert all("not charged to restart.maxEvictions" in m for m in said), said
    assert "(PreemptionByScheduler)" in said[1]
    assert "WorkerReplaced" not in c.reasons()


def test_a_cluster_that_takes_pods_without_end_fails_the_job_on_its_own_budget() -> None:
    c = started(restart={"maxDisruptions": 1})
    for _ in range(2):
        name = next(n for n, p in c.pods.items() if p.role == "worker" and p.live)
        _disrupt(c, name, "PreemptionByScheduler")
        c.step()
        c.gone()
        c.run_all()
    assert c.job["status"]["phase"] == "Failed"
    failed = c.condition("Failed")
    assert failed["reason"] == "DisruptionBudgetExhausted"
    assert "restart.maxDisruptions=1" in failed["message"]
    assert c.job["status"]["replacements"] == 0


def test_a_pod_deleted_by_hand_is_still_charged() -> None:
    """Only the cluster's own DisruptionTarget is no failure: a Pod someone deleted, with no condition, is
    lost like any other."""
    c = started()
    c.pods["j-worker-0-0"] = dataclasses.replace(c.pods["j-worker-0-0"], terminating=True)
    c.step()
    assert (c.job["status"]["replacements"], c.job["status"].get("disruptions", 0)) == (1, 0)


def test_eviction_replaces_off_the_machine_and_cordons() -> None:
    c = FakeCluster(job_obj(cordonBadNodes=True), settings=OperatorSettings(cordon_nodes=True))
    c.step()
    c.run_all(node="bad")
    c.master_says()
    c.step()
    c.job["status"]["evictions"] = [{"nodeId": "j-worker-0-0", "machine": "bad", "reason": "no heartbeat"}]
    actions = c.step()
    creates = [a.obj for a in actions if isinstance(a, Create)]
    assert [o["metadata"]["name"] for o in creates] == ["j-worker-0-1"]
    terms = creates[0]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][-1]["values"] == ["bad"]
    order = [type(a).__name__ for a in actions if isinstance(a, Create | DeletePod)]
    assert order == ["Create", "DeletePod"], "the replacement exists before the evicted Pod goes"
    assert c.cordoned == ["bad"]
    assert c.job["status"]["excludedMachines"] == ["bad"]
    assert {"Evicted", "NodeCordoned", "WorkerReplaced"} <= set(c.reasons())
    c.run_all(node="good")
    c.step()
    assert c.cordoned == ["bad"], "a machine is cordoned once"
    assert [a for a in c.step() if isinstance(a, Create)] == []


def kept_off(pod: dict[str, Any]) -> list[str]:
    """The machines a Pod's required node affinity keeps it off ([] when it has none)."""
    affinity = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    return sorted(
        {
            value
            for term in terms
            for expr in term.get("matchExpressions", [])
            if expr["key"] == "kubernetes.io/hostname" and expr["operator"] == "NotIn"
            for value in expr["values"]
        }
    )


def evicted_on_bad() -> FakeCluster:
    """A running job whose workers run on machine "bad"; the master evicts j-worker-0-0 now."""
    c = FakeCluster(job_obj(), graceful=True)
    c.step()
    c.run_all(node="bad")
    c.master_says()
    c.step()
    c.job["status"]["evictions"] = [{"nodeId": "j-worker-0-0", "machine": "x", "reason": "hardware"}]
    return c


def test_an_evicted_pod_that_stopped_before_any_pass_saw_the_eviction_still_marks_its_machine() -> None:
    """The decision must not depend on which the operator saw first, the eviction or the evicted Pod's end:
    its agent exits on the master's word (the Pod Failed), or the Pod was deleted while no operator led (it
    is terminating). Its node is the same: the replacement keeps off it and the status records it."""
    failed = evicted_on_bad()
    failed.pods["j-worker-0-0"] = PodView(
        name="j-worker-0-0", role="worker", phase="Failed", node_name="bad", exit_code=1
    )
    stopping = evicted_on_bad()
    stopping.pods["j-worker-0-0"] = dataclasses.replace(stopping.pods["j-worker-0-0"], terminating=True)
    for c in (failed, stopping):
        actions = c.step()
        (replacement,) = [a.obj for a in actions if isinstance(a, Create)]
        assert replacement["metadata"]["name"] == "j-worker-0-1"
        assert kept_off(replacement) == ["bad"]
        assert c.job["status"]["excludedMachines"] == ["bad"]


def test_the_machine_is_recorded_before_any_pod_is_touched_so_any_later_leader_keeps_off_it() -> None:
    """The operator dies after carrying out the eviction (replacement created, evicted Pod deleted) but
    before its pass's closing status patch; the evicted Pod is gone when the next leader looks. The machine
    was written first: the next replacement of the slot still keeps off it."""
    c = evicted_on_bad()
    c.graceful = False  # the deleted Pod vanishes at once: no later pass sees it
    actions = c.step(dies_before_closing_patch=True)
    assert "j-worker-0-0" not in c.pods
    c.run_all(node="good")
    c.pods["j-worker-0-1"] = PodView(name="j-worker-0-1", role="worker", phase="Failed", node_name="good")
    (replacement,) = [a.obj for a in c.step() if isinstance(a, Create)]
    assert replacement["metadata"]["name"] == "j-worker-0-2"
    assert kept_off(replacement) == ["bad"]
    assert c.job["status"].get("excludedMachines") == ["bad"]
    first_pod_action = next(i for i, a in enumerate(actions) if isinstance(a, Create | DeletePod))
    records = (
        i for i, a in enumerate(actions) if isinstance(a, PatchStatus) and "excludedMachines" in a.status
    )
    assert next(records, len(actions)) < first_pod_action, [type(a).__name__ for a in actions]


def test_the_machine_an_agent_reports_is_never_cordoned_nor_excluded() -> None:
    """A training script can read the job token and register a node named after any cluster node: the
    operator cordons and excludes the spec.nodeName of the evicted Pod as it observed it, nothing else."""
    c = FakeCluster(job_obj(cordonBadNodes=True), settings=OperatorSettings(cordon_nodes=True))
    c.step()
    c.run_all(node="bad")
    c.master_says()
    c.step()
    c.job["status"]["evictions"] = [
        {"nodeId": "j-worker-0-0", "machine": "control-plane-1", "reason": "no heartbeat"},
        {"nodeId": "fake-node", "machine": "ingress-1", "reason": "a node no Pod of the job is"},
    ]
    c.step()
    assert c.cordoned == ["bad"]
    assert c.job["status"]["excludedMachines"] == ["bad"]


def test_cordoning_needs_the_operators_switch_as_well_as_the_jobs() -> None:
    c = FakeCluster(job_obj(cordonBadNodes=True))  # the operator's cordon_nodes is off, as shipped
    c.step()
    c.run_all(node="bad")
    c.master_says()
    c.step()
    c.job["status"]["evictions"] = [{"nodeId": "j-worker-0-0", "machine": "bad", "reason": "no heartbeat"}]
    c.step()
    assert c.cordoned == []
    assert c.job["status"]["excludedMachines"] == ["bad"], "the job's own replacements still avoid it"
    (event,) = [e for e in c.events if e.reason == "NodeNotCordoned"]
    assert "its cordon_nodes setting is off" in event.message
    off = FakeCluster(job_obj(), settings=OperatorSettings(cordon_nodes=True))  # nor without the job's field
    off.step()
    off.run_all(node="bad")
    off.master_says()
    off.step()
    off.job["status"]["evictions"] = [{"nodeId": "j-worker-0-0", "reason": "no heartbeat"}]
    off.step()
    assert off.cordoned == []


def test_a_foreign_object_of_the_jobs_name_blocks_the_job_and_is_never_touched() -> None:
    c = FakeCluster(job_obj(), foreign={("Secret", "j-token")})
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)], "nothing created, nothing deleted"
    created = next(x for x in c.job["status"]["conditions"] if x["type"] == "Created")
    assert (created["status"], created["reason"]) == ("False", "ForeignObject")
    assert "Secret ns/j-token already exists and is not this job's" in created["message"]
    assert "Delete or rename it" in created["message"]
    assert c.reasons().count("ForeignObject") == 1
    c.step()
    assert c.reasons().count("ForeignObject") == 1, "one Event, not one per pass"
    c.foreign.clear()  # the owner deleted it
    c.step()
    created = next(x for x in c.job["status"]["conditions"] if x["type"] == "Created")
    assert created["status"] == "True"
    assert ("Secret", "j-token") in c.objects
    assert "j-master" in c.pods


def test_a_foreign_pod_group_of_the_jobs_name_blocks_a_gang_job() -> None:
    """A PodGroup named like the job's but not its own (the executor reads its ownerReferences) would take
    the job's Pods into someone else's gang: the job waits, creating nothing, until it is gone."""
    group = ("PodGroup", elasticjob.pod_group("j"))
    c = FakeCluster(job_obj(gangScheduling={"enabled": True}), foreign={group})
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod | PatchPodGroup)]
    assert f"PodGroup ns/{group[1]} already exists and is not this job's" in c.condition("Created")["message"]
    c.foreign.clear()
    c.step()
    assert c.pod_group is not None
    plain = FakeCluster(job_obj(), foreign={group})  # no gang: the name is nothing of the job's
    plain.step()
    assert "j-master" in plain.pods


def test_a_recorded_pass_error_is_cleared_by_the_next_pass_that_succeeds() -> None:
    c = FakeCluster(job_obj())
    c.job["status"]["conditions"] = [
        {"type": "ReconcileError", "status": "True", "reason": "TypeError", "message": "boom",
         "lastTransitionTime": "2024-01-01T00:00:00Z"},
    ]  # fmt: skip
    c.step()
    error = next(x for x in c.job["status"]["conditions"] if x["type"] == "ReconcileError")
    assert (error["status"], error["reason"]) == ("False", "Reconciled")


def test_the_network_policy_and_the_metrics_secret_are_supporting_objects_when_switched_on() -> None:
    job = job_obj()
    names = [
        (o["kind"], o["metadata"]["name"])
        for o in supporting_objects(
            job, settings=OperatorSettings(network_policy=True), token="t", metrics_token="m" * 20
        )
    ]  # fmt: skip
    assert ("Secret", "j-metrics") in names
    assert ("NetworkPolicy", "j-master") in names
    assert ("NetworkPolicy", "j-workers") in names
    assert OperatorSettings().network_policy, "on by default"
    plain = [
        (o["kind"], o["metadata"]["name"])
        for o in supporting_objects(job, settings=OperatorSettings(network_policy=False), token="t")
    ]
    assert ("Secret", "j-metrics") not in plain
    assert not [name for kind, name in plain if kind == "NetworkPolicy"]


def test_worker_pods_are_created_in_batches_that_double_up_to_a_cap() -> None:
    """Kubernetes' slow start: a pass holds at most MAX_CREATES_PER_PASS Pods built from the template, and a
    refused template costs a batch of requests, not nodes.max of them."""
    c = FakeCluster(job_obj(nodes={"min": 1, "max": 200}))
    batches = []
    while len(c.workers()) < 200:
        c.step()
        batches.append(len(c.workers()))
        assert len(batches) < 10, batches
    assert batches == [16, 32, 64, 128, 192, 200]
    assert c.job["status"]["workerIncarnations"] == [0] * 200
    assert not [a for a in c.step() if isinstance(a, Create)]


def test_an_evicted_pod_waits_with_its_slot_for_a_pass_that_may_create_its_replacement() -> None:
    c = FakeCluster(job_obj(nodes={"min": 1, "max": 40}, restart={"maxEvictions": 50}))
    for _ in range(3):
        c.step()
    c.run_all()
    assert len(c.workers()) == 40
    # 30 Pods vanished (10 are left: this pass may create 16) and the last slot's Pod is evicted.
    for slot in range(30):
        del c.pods[f"j-worker-{slot}-0"]
    c.job["status"]["evictions"] = [{"nodeId": "j-worker-39-0", "reason": "slow"}]
    actions = c.step()
    assert len([a for a in actions if isinstance(a, Create)]) == 16
    assert "j-worker-39-0" in c.workers(), "kept until its replacement exists"
    assert not c.deletes
    actions = c.step()
    assert [type(a).__name__ for a in actions if isinstance(a, Create | DeletePod)][-2:] == [
        "Create",
        "DeletePod",
    ]
    assert [d.name for d in c.deletes] == ["j-worker-39-0"]
    assert len(c.workers()) == 40
    assert "j-worker-39-1" in c.workers()


def test_refused_creates_hold_a_pass_to_the_first_batch() -> None:
    assert workers_module.create_budget(existing=500, refused=True) == workers_module.SLOW_START_CREATES
    assert workers_module.create_budget(existing=0, refused=False) == workers_module.SLOW_START_CREATES
    assert workers_module.create_budget(existing=40, refused=False) == 40
    assert workers_module.create_budget(existing=5000, refused=False) == workers_module.MAX_CREATES_PER_PASS


def test_without_its_admission_policy_the_operator_refuses_privileged_templates() -> None:
    host = {"spec": {"hostNetwork": True, "containers": [{"name": "t", "image": "i", "command": ["t"]}]}}
    c = FakeCluster(job_obj(template=host), admission_policy=False)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create)], "nothing is made from the template"
    assert c.job["status"]["phase"] == "Failed"
    failed = c.condition("Failed")
    assert failed["reason"] == "AdmissionPolicyMissing"
    assert "spec.template.spec.hostNetwork" in failed["message"]
    assert "phalanx-elasticjob-templates" in failed["message"]
    # An ordinary template runs without the policy; a privileged one runs with it.
    plain = FakeCluster(job_obj(), admission_policy=False)
    plain.step()
    assert len(plain.workers()) == 2
    trusted = FakeCluster(job_obj(template=host))
    trusted.step()
    assert len(trusted.workers()) == 2


def test_scaling_down_deletes_the_highest_slots() -> None:
    c = FakeCluster(job_obj(nodes={"min": 1, "max": 3}))
    c.step()
    c.run_all()
    c.job["spec"]["nodes"] = {"min": 1, "max": 1}
    c.step()
    assert sorted(p for p in c.pods if "worker" in p) == ["j-worker-0-0"]
    assert "ScaledDown" in c.reasons()
    assert "MasterReconfigured" in c.reasons()
    assert "j-master" not in c.pods, "the master restarts with the new range"
    c.step()
    assert c.pods["j-master"].nodes == "1:1"
    c.run_all()
    c.job["spec"]["nodes"] = {"min": 1, "max": 2}
    c.step()
    assert "j-worker-1-1" in c.pods, "a slot that existed before gets a new incarnation"


def test_master_success_ends_the_job_and_cleans_up_running_pods() -> None:
    c = started()
    c.pods["j-worker-0-0"] = PodView(name="j-worker-0-0", role="worker", phase="Succeeded", exit_code=0)
    c.master_says(phase="Succeeded")
    c.step()
    assert c.job["status"]["phase"] == "Succeeded"
    assert set(c.pods) == {"j-worker-0-0", "j-worker-1-0", "j-master"}, "running Pods get a grace to exit"
    c.pods["j-worker-1-0"] = PodView(name="j-worker-1-0", role="worker", phase="Succeeded", exit_code=0)
    c.now += SETTINGS.finish_grace_s
    assert [a for a in c.step() if isinstance(a, Create)] == []
    assert set(c.pods) == {"j-worker-0-0", "j-worker-1-0"}, "cleanPodPolicy Running deletes what still runs"


def test_master_failure_carries_the_root_cause() -> None:
    c = started()
    c.master_says(phase="Failed", reason="rank 3 raised ValueError: bad batch")
    c.step()
    failed = next(x for x in c.job["status"]["conditions"] if x["type"] == "Failed")
    assert failed["status"] == "True"
    assert failed["message"] == "rank 3 raised ValueError: bad batch"
    assert c.job["status"]["phase"] == "Failed"


def test_lost_master_is_recreated() -> None:
    c = started()
    c.pods["j-master"] = PodView(name="j-master", role="master", phase="Failed", exit_code=137)
    c.step()
    assert "j-master" not in c.pods
    assert "MasterLost" in c.reasons()
    c.step()
    assert "j-master" in c.pods
    assert "MasterRecreated" in c.reasons()


def test_a_master_whose_node_stopped_answering_is_replaced_at_once() -> None:
    """Not ready while its node is silent; once Kubernetes evicts it for the node's taint (after the master's
    tolerationSeconds), the operator removes it at once (no kubelet will confirm) and starts a new one; the
    workers stay."""
    c = started()
    workers = c.workers()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], unready=True)
    c.step()
    assert (c.condition("MasterReady")["status"], c.condition("MasterReady")["reason"]) == (
        "False",
        "MasterStarting",
    )
    c.pods["j-master"] = dataclasses.replace(
        c.pods["j-master"], terminating=True, disruption="DeletionByTaintManager"
    )
    actions = c.step()
    assert DeletePod("j-master", grace_period_s=0) in actions, "forced: its kubelet is gone"
    assert "MasterNodeLost" in c.reasons()
    c.step()
    assert not c.pods["j-master"].terminating, "a new master"
    assert c.workers() == workers
    assert c.job["status"]["replacements"] == 0


def test_a_terminating_master_on_a_live_node_is_waited_for() -> None:
    c = started()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], terminating=True)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, DeletePod) and a.name == "j-master"]
    assert c.condition("MasterReady")["status"] == "False"


def test_terminating_pods_are_waited_for() -> None:
    c = started()
    c.pods["j-master"] = PodView(name="j-master", role="master", phase="Running", terminating=True)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)]


def test_invalid_spec_fails_with_the_settings_message() -> None:
    c = FakeCluster(job_obj(heartbeat={"interval": "5s", "timeout": "3s"}))
    c.step()
    failed = next(x for x in c.job["status"]["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "timeout_s" in failed["message"]
    assert not c.pods


def test_no_status_patch_when_nothing_changed() -> None:
    c = started()
    c.step()
    assert not [a for a in c.step() if isinstance(a, PatchStatus)]


# ------------------------------------------------------------------------------------------------------
# spec.suspend


def suspended(c: FakeCluster) -> None:
    """Suspends a running job through the master's acknowledgement until its worker Pods are gone."""
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    c.step()
    c.gone()
    c.step()
    assert c.job["status"]["phase"] == "Suspended"


def test_suspend_waits_for_the_master_to_acknowledge() -> None:
    c = started()
    c.suspend(True)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)]
    cond = c.condition("Suspended")
    assert (cond["status"], cond["reason"]) == ("False", "Suspending")
    assert "master to acknowledge" in cond["message"]
    assert c.job["status"]["phase"] == "Running", "the phase stays until the workers are gone"
    # A worker failing now is not replaced: the job is about to stop anyway.
    c.pods["j-worker-1-0"] = PodView(name="j-worker-1-0", role="worker", phase="Failed", exit_code=1)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)]
    assert c.job["status"]["replacements"] == 0
    assert "WorkerReplaced" not in c.reasons()


def test_suspend_deletes_workers_gracefully_once_acknowledged_and_keeps_the_master() -> None:
    c = started()
    c.graceful = True
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    actions = c.step()
    deletes = [a for a in actions if isinstance(a, DeletePod)]
    assert deletes == [DeletePod("j-worker-0-0"), DeletePod("j-worker-1-0")], "graceful: the Pod's own grace"
    assert [e.message for e in c.events if e.reason == "Suspending"] == [
        "deleting 2 worker Pods; each persists its newest checkpoint first"
    ]
    assert c.condition("Suspended")["message"] == "waiting for 2 worker Pods to stop"
    assert c.job["status"]["phase"] == "Running"
    # Terminating Pods are still persisting their checkpoint: waited for, not deleted again.
    assert not [a for a in c.step() if isinstance(a, Create | DeletePod | Event)]
    assert c.condition("Suspended")["status"] == "False"
    c.gone()
    c.step()
    status = c.job["status"]
    assert status["phase"] == "Suspended"
    assert status["nodes"] == 0
    assert status["replacements"] == 0
    assert status["workerIncarnations"] == [0, 0], "kept: resumed Pods get new names"
    assert (c.condition("Suspended")["status"], c.condition("Suspended")["reason"]) == (
        "True",
        "JobSuspended",
    )
    assert (c.condition("Running")["status"], c.condition("Running")["reason"]) == ("False", "Suspended")
    assert c.condition("Restarting")["status"] == "False"
    assert set(c.pods) == {"j-master"}, "the master Pod stays: it holds the job's state"
    assert c.reasons().count("Suspended") == 1
    assert not [a for a in c.step() if not isinstance(a, PatchStatus)], "a suspended job is left alone"
    assert not [a for a in c.step() if isinstance(a, PatchStatus)]
    assert c.reasons().count("Suspended") == 1, "the Event comes with the transition only"
    assert c.reasons().count("Suspending") == 1


def test_suspend_removes_finished_worker_pods_without_replacing_them() -> None:
    c = started()
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    c.pods["j-worker-1-0"] = PodView(name="j-worker-1-0", role="worker", phase="Failed", exit_code=1)
    actions = c.step()
    assert [a for a in actions if isinstance(a, DeletePod)] == [
        DeletePod("j-worker-0-0"),
        DeletePod("j-worker-1-0", grace_period_s=0),
    ]
    assert not [a for a in actions if isinstance(a, Create)]
    assert "(and 1 finished ones)" in next(e.message for e in c.events if e.reason == "Suspending")
    c.step()
    assert c.job["status"]["phase"] == "Suspended"
    assert c.job["status"]["replacements"] == 0


def test_resume_creates_the_next_incarnations_and_counts_no_replacement() -> None:
    c = started()
    c.pods["j-worker-1-0"] = PodView(name="j-worker-1-0", role="worker", phase="Failed", exit_code=1)
    c.step()  # one real replacement before, to see the count stay where it was
    c.run_all()
    c.step()
    assert c.job["status"]["replacements"] == 1
    assert c.job["status"]["workerIncarnations"] == [0, 1]
    suspended(c)
    c.suspend(False)  # the master still says Suspended until it sees the change
    actions = c.step()
    created = [a.obj["metadata"]["name"] for a in actions if isinstance(a, Create)]
    assert created == ["j-worker-0-1", "j-worker-1-2"], "a resumed slot never reuses a Pod name"
    status = c.job["status"]
    assert status["replacements"] == 1
    assert status["phase"] == "Created", "starting again, not Restarting"
    assert (c.condition("Suspended")["status"], c.condition("Suspended")["reason"]) == ("False", "Resumed")
    assert c.condition("Restarting")["status"] == "False"
    c.master_says(phase="Running")
    c.step()
    c.run_all()
    c.step()
    assert c.job["status"]["phase"] == "Running"
    assert c.job["status"]["replacements"] == 1
    assert c.reasons().count("Resumed") == 1
    assert c.reasons().count("WorkerReplaced") == 1, "only the failure before the suspension"
    assert "Restarting" not in c.reasons()[c.reasons().index("Suspending") :]
    c.step()
    assert c.reasons().count("Resumed") == 1, "once"


def test_a_second_suspension_uses_the_incarnation_after_the_first() -> None:
    c = started()
    suspended(c)
    c.suspend(False)
    c.master_says(phase="Running")
    c.step()
    c.run_all()
    c.step()
    suspended(c)
    c.suspend(False)
    c.step()
    assert c.workers() == ["j-worker-0-2", "j-worker-1-2"]
    assert c.job["status"]["replacements"] == 0


def test_a_stale_acknowledgement_deletes_nothing() -> None:
    """Suspended, resumed, suspended again within seconds: the master's Suspended still in the status is
    of the first suspension (it may not know of the second yet), so no Pod is deleted until it follows the
    current spec."""
    c = started()
    suspended(c)
    c.suspend(False)
    c.step()
    c.run_all()
    c.suspend(True)  # the master has not published since the first suspension
    actions = c.step()
    assert not [a for a in actions if isinstance(a, DeletePod)]
    assert c.condition("Suspended")["reason"] == "Suspending"
    c.master_says(phase="Suspended")  # now of the current generation
    actions = c.step()
    assert len([a for a in actions if isinstance(a, DeletePod)]) == 2


def test_resume_waits_for_pods_still_persisting_their_checkpoint() -> None:
    c = started()
    c.graceful = True
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    c.step()  # deletes issued, the Pods terminate
    c.suspend(False)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)], "a new Pod would start from older"
    cond = c.condition("Suspended")
    assert (cond["reason"], cond["message"]) == (
        "Resuming",
        "waiting for 2 worker Pods to stop before creating new ones",
    )
    c.gone()
    actions = c.step()
    assert [a.obj["metadata"]["name"] for a in actions if isinstance(a, Create)] == [
        "j-worker-0-1",
        "j-worker-1-1",
    ]
    assert c.job["status"]["replacements"] == 0
    assert c.job["status"]["phase"] == "Created"
    assert "Restarting" not in c.reasons()
    assert [e.message for e in c.events if e.reason == "Resumed"] == [
        "suspension cancelled before it completed"
    ]


def test_suspend_cancelled_before_the_ack_keeps_the_workers() -> None:
    c = started()
    c.suspend(True)
    c.step()
    c.suspend(False)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create | DeletePod)]
    assert c.job["status"]["phase"] == "Running"
    assert c.condition("Suspended")["reason"] == "Resumed"
    assert c.reasons().count("Resumed") == 1
    assert c.reasons().count("Running") == 1, "no phase change"


def test_a_job_created_suspended_gets_no_pod_until_it_is_resumed() -> None:
    """Kueue's pattern: a job is created suspended and waits in its queue. It holds nothing meanwhile, not
    even a master Pod, and is Suspended at once (there is no master to acknowledge anything); resumed, it
    starts as any new job, its Pods no replacements."""
    c = FakeCluster(job_obj(suspend=True))
    actions = c.step()
    kinds = [a.obj["kind"] for a in actions if isinstance(a, Create)]
    assert kinds == [
        "Secret", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Service",
        "NetworkPolicy", "NetworkPolicy",
    ]  # fmt: skip
    assert c.pods == {}
    assert c.job["status"]["phase"] == "Suspended"
    assert (c.condition("Suspended")["status"], c.condition("Suspended")["reason"]) == (
        "True",
        "CreatedSuspended",
    )
    c.now += 3600  # an hour in the queue: nothing changes, no suspension timeout applies
    assert not [a for a in c.step() if isinstance(a, Create | DeletePod | Event)]
    assert "startTime" not in c.job["status"], "time in the queue is no active time"
    c.suspend(False)
    c.step()
    assert set(c.pods) == {"j-master", "j-worker-0-0", "j-worker-1-0"}
    assert c.reasons().count("WorkerCreated") == 2
    assert "MasterCreated" in c.reasons()
    assert "MasterRecreated" not in c.reasons()
    assert c.job["status"]["replacements"] == 0
    assert "startTime" in c.job["status"]
    c.run_all()
    c.master_says()
    c.step()
    assert c.job["status"]["phase"] == "Running"


def test_a_suspension_the_master_never_acknowledges_completes_after_the_operators_bound() -> None:
    """The master is gone (its node died, its new Pod cannot be placed): the suspension waits for its
    acknowledgement suspend_ack_timeout_s, then deletes the worker Pods without it and completes."""
    c = started()
    c.graceful = True
    c.suspend(True)
    c.step()
    del c.pods["j-master"]
    limit = SETTINGS.suspend_ack_timeout_s
    c.now += limit - 2
    actions = c.step()
    assert not [a for a in actions if isinstance(a, DeletePod) and "worker" in a.name], "not yet"
    c.now += 2
    actions = c.step()
    deleted = sorted(a.name for a in actions if isinstance(a, DeletePod))
    assert deleted == ["j-worker-0-0", "j-worker-1-0"]
    warned = [e.message for e in c.events if e.reason == "SuspendedWithoutMaster"]
    assert len(warned) == 1, warned
    assert f"within {limit:g}s" in warned[0]
    c.step()
    assert len([e for e in c.events if e.reason == "SuspendedWithoutMaster"]) == 1, "said once"
    c.gone()
    c.step()
    assert c.job["status"]["phase"] == "Suspended"
    assert c.job["status"].get("suspendingSince") is None


def test_a_cancelled_suspension_does_not_shorten_the_next_ones_wait() -> None:
    c = started()
    c.suspend(True)
    c.step()
    c.now += SETTINGS.suspend_ack_timeout_s - 5
    c.step()
    c.suspend(False)
    c.step()
    c.now += 100
    c.suspend(True)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, DeletePod)], "a new suspension waits its own full bound"


def test_a_finished_job_ignores_suspend() -> None:
    c = started()
    c.master_says(phase="Succeeded")
    c.step()
    c.suspend(True)
    c.master_says(phase="Suspended")
    c.step()
    assert c.job["status"]["phase"] == "Succeeded"
    assert "Suspended" not in {x["type"] for x in c.job["status"]["conditions"]}
    assert not [d for d in c.deletes if d.grace_period_s is None and "worker" in d.name]


def test_a_suspended_job_the_master_fails_is_no_longer_suspended() -> None:
    c = started()
    suspended(c)
    c.master_says(phase="Failed", reason="the state could not be restored")
    c.step()
    assert c.job["status"]["phase"] == "Failed"
    cond = c.condition("Suspended")
    assert (cond["status"], cond["reason"]) == ("False", "MasterReportedFailure")


# ------------------------------------------------------------------------------------------------------
# spec.activeDeadline


def failed_condition(c: FakeCluster) -> dict[str, Any] | None:
    return next((x for x in c.job["status"]["conditions"] if x["type"] == "Failed"), None)


def test_a_job_records_when_it_started() -> None:
    c = FakeCluster(job_obj())
    c.step()
    assert c.job["status"]["startTime"] == "1970-01-01T00:16:40Z"  # now=1000 at the first pass
    c.run_all()
    c.master_says()
    c.step()
    assert c.job["status"]["startTime"] == "1970-01-01T00:16:40Z", "set once"


def test_deadline_not_reached_changes_nothing() -> None:
    c = started(activeDeadline="1h")
    c.now = 1000 + 3599
    actions = c.step()
    assert c.job["status"]["phase"] == "Running"
    assert failed_condition(c) is None
    assert not [a for a in actions if isinstance(a, Create | DeletePod | Event | PatchStatus)]


def test_deadline_reached_fails_the_job_and_cleans_up() -> None:
    c = started(activeDeadline="1h")
    c.now = 1000 + 3600
    c.step()
    assert c.job["status"]["phase"] == "Failed"
    failed = failed_condition(c)
    assert failed is not None
    assert (failed["status"], failed["reason"]) == ("True", "DeadlineExceeded")
    assert (
        "active for longer than spec.activeDeadline (1h), counted from 1970-01-01T00:16:40Z"
        in (failed["message"])
    )
    assert "a larger spec.activeDeadline or none" in failed["message"]
    assert c.condition("Running")["status"] == "False"
    assert [e.type for e in c.events if e.reason == "Failed"] == ["Warning"]
    assert {"j-worker-0-0", "j-worker-1-0", "j-master"} <= set(c.pods), "running Pods get a grace to exit"
    c.now += SETTINGS.finish_grace_s
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create)]
    assert c.pods == {}, "cleanPodPolicy Running deletes what still runs"
    assert not c.deleted_job, "no ttlAfterFinished: the job is kept"


def test_deadline_respects_clean_pod_policy_none() -> None:
    c = started(activeDeadline="10m", cleanPodPolicy="None")
    c.now += 600
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"
    c.now += SETTINGS.finish_grace_s
    c.step()
    assert set(c.pods) == {"j-master", "j-worker-0-0", "j-worker-1-0"}


def test_deadline_counts_from_the_start_not_from_running() -> None:
    c = FakeCluster(job_obj(activeDeadline="30s"))
    c.step()  # now 1000: created; the Pods never become Running
    c.now = 1030
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"


def test_a_compound_deadline_and_an_empty_one() -> None:
    c = started(activeDeadline="1h30m")
    c.now = 1000 + 5399
    c.step()
    assert failed_condition(c) is None
    c.now = 1000 + 5400
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"
    assert "(1h30m)" in c.condition("Failed")["message"]
    c = started(activeDeadline="")
    c.now += 10 * 365 * 86400
    c.step()
    assert c.job["status"]["phase"] == "Running", "empty: no deadline"


def test_raising_the_deadline_of_a_running_job_extends_it() -> None:
    c = started(activeDeadline="10m")
    c.now = 1000 + 500
    c.step()
    c.job["spec"]["activeDeadline"] = "1h"
    c.now = 1000 + 3000
    c.step()
    assert c.job["status"]["phase"] == "Running"
    del c.job["spec"]["activeDeadline"]
    c.now = 1000 + 86400
    c.step()
    assert c.job["status"]["phase"] == "Running"


def test_a_suspended_job_is_never_failed_by_the_deadline() -> None:
    c = started(activeDeadline="1h")
    suspended(c)
    c.now += 86400
    c.step()
    assert c.job["status"]["phase"] == "Suspended"
    assert failed_condition(c) is None


def test_a_job_being_suspended_is_not_failed_by_the_deadline() -> None:
    c = started(activeDeadline="1h")
    c.suspend(True)
    c.step()  # waiting for the master to acknowledge
    c.now += 7200
    c.step()
    assert failed_condition(c) is None
    assert c.condition("Suspended")["reason"] == "Suspending"


def test_the_deadline_clock_restarts_at_the_resume() -> None:
    c = started(activeDeadline="1h")
    c.now = 1000 + 3000  # 50 minutes of the hour spent
    suspended(c)
    c.now = 20000
    c.suspend(False)
    c.step()  # resumes: the new worker Pods are created
    assert c.condition("Suspended")["reason"] == "Resumed"
    assert c.job["status"]["startTime"] == "1970-01-01T05:33:20Z"  # 20000
    c.master_says(phase="Running")
    c.run_all()
    c.now = 20000 + 3599
    c.step()
    assert c.job["status"]["phase"] == "Running", "the time before the suspension no longer counts"
    c.now = 20000 + 3600
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"
    assert "counted from 1970-01-01T05:33:20Z (its start or last resume)" in c.condition("Failed")["message"]


def test_a_resume_that_waits_for_stopping_pods_is_not_failed_meanwhile() -> None:
    c = started(activeDeadline="1h")
    c.graceful = True
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    c.step()  # the worker Pods terminate, persisting their checkpoint
    c.suspend(False)
    c.now = 1000 + 7200
    c.step()
    assert c.condition("Suspended")["reason"] == "Resuming"
    assert failed_condition(c) is None
    c.gone()
    c.step()
    assert failed_condition(c) is None
    assert c.job["status"]["startTime"] == "1970-01-01T02:16:41Z"  # 8201: the pass that resumed


def test_a_job_from_before_start_time_counts_from_its_created_condition() -> None:
    c = started(activeDeadline="1h")
    del c.job["status"]["startTime"]
    c.now = 1000 + 1800
    c.step()
    assert c.job["status"]["startTime"] == "1970-01-01T00:16:40Z", "the Created condition's time"
    c.now = 1000 + 3600
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"


def test_the_masters_success_wins_over_the_deadline() -> None:
    c = started(activeDeadline="1h")
    c.master_says(phase="Succeeded")
    c.now = 1000 + 7200
    c.step()
    assert c.job["status"]["phase"] == "Succeeded"
    assert failed_condition(c) is None


# ------------------------------------------------------------------------------------------------------
# spec.ttlAfterFinished


def succeeded(**spec: Any) -> FakeCluster:
    """A job that succeeded at now=2000."""
    c = started(**spec)
    c.master_says(phase="Succeeded")
    c.now = 2000
    c.step()
    assert c.job["status"]["phase"] == "Succeeded"
    return c


def test_a_finished_job_is_deleted_only_after_its_ttl() -> None:
    c = succeeded(ttlAfterFinished="10m")
    assert not c.deleted_job
    c.now = 2000 + 599
    c.step()
    assert not c.deleted_job
    c.now = 2000 + 600
    actions = c.step()
    assert c.deleted_job == [
        DeleteJob(
            "deleting the job: Succeeded since 1970-01-01T00:33:20Z, longer than spec.ttlAfterFinished (10m)"
        )
    ]
    assert isinstance(actions[-1], DeleteJob), "last: nothing is done to a job being deleted"
    assert not any("ttlAfterFinished" in e.message for e in c.events), "logged by the executor, no Event"


def test_without_ttl_a_finished_job_is_kept_forever() -> None:
    c = succeeded()
    c.now += 10 * 365 * 86400
    c.step()
    assert not c.deleted_job
    c = succeeded(ttlAfterFinished="")
    c.now += 10 * 365 * 86400
    c.step()
    assert not c.deleted_job


def test_a_zero_ttl_deletes_at_the_next_pass() -> None:
    c = succeeded(ttlAfterFinished="0s")
    assert not c.deleted_job, "the pass that finishes the job only records it"
    c.step()
    assert len(c.deleted_job) == 1


def test_a_job_failed_by_its_deadline_is_deleted_after_its_ttl() -> None:
    c = started(activeDeadline="1h", ttlAfterFinished="1h")
    c.now = 1000 + 3600
    c.step()
    assert c.condition("Failed")["reason"] == "DeadlineExceeded"
    c.now = 1000 + 7199
    c.step()
    assert not c.deleted_job
    c.now = 1000 + 7200
    c.step()
    assert [d.message.split(",")[0] for d in c.deleted_job] == [
        "deleting the job: Failed since 1970-01-01T01:16:40Z"
    ]


def test_a_job_failed_for_an_invalid_spec_is_deleted_after_its_ttl_too() -> None:
    c = FakeCluster(job_obj(heartbeat={"interval": "5s", "timeout": "3s"}, ttlAfterFinished="1m"))
    c.step()
    assert c.condition("Failed")["reason"] == "InvalidSpec"
    c.now += 60
    c.step()
    assert len(c.deleted_job) == 1


def test_an_unreadable_ttl_keeps_the_job() -> None:
    c = FakeCluster(job_obj(ttlAfterFinished="soon"))
    c.step()
    failed = c.condition("Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "spec.ttlAfterFinished: expected a duration" in failed["message"]
    c.now += 86400
    c.step()
    assert not c.deleted_job


def _scheduler_says(c: FakeCluster, placed: bool, message: str = "") -> None:
    """The Kubernetes scheduler's verdict on the job's PodGroup."""
    assert c.pod_group is not None
    verdict = {
        "type": "PodGroupInitiallyScheduled",
        "status": "True" if placed else "False",
        "reason": "Scheduled" if placed else "Unschedulable",
        "message": message,
    }
    c.pod_group["status"] = {"conditions": [verdict]}


def test_gang_scheduling_creates_the_pod_group_before_the_worker_pods() -> None:
    c = FakeCluster(job_obj(gangScheduling={"enabled": True}))
    actions = c.step()
    creates = [a.obj for a in actions if isinstance(a, Create)]
    kinds = [(o["kind"], o["metadata"]["labels"].get("phalanx.dev/role")) for o in creates]
    first_worker = kinds.index(("Pod", "worker"))
    assert kinds.index(("PodGroup", "worker")) < first_worker
    workers = [o for o in creates if o["kind"] == "Pod" and "-worker-" in o["metadata"]["name"]]
    assert len(workers) == 2
    assert all(w["spec"]["schedulingGroup"] == {"podGroupName": "j-workers"} for w in workers)
    assert c.pod_group is not None
    assert c.pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    c.step()
    c.step()
    assert not [a for a in c.step() if isinstance(a, Create)], "one PodGroup, created once"


def test_a_job_without_gang_scheduling_has_no_pod_group() -> None:
    c = FakeCluster(job_obj())
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create) and a.obj["kind"] == "PodGroup"]
    assert all("schedulingGroup" not in a.obj["spec"] for a in actions if isinstance(a, Create)
               and a.obj["kind"] == "Pod")  # fmt: skip


def test_the_schedulers_verdict_on_the_gang_becomes_a_condition_and_one_event_per_change() -> None:
    c = FakeCluster(job_obj(gangScheduling={"enabled": True}))
    c.step()
    c.step()
    assert "GangScheduled" not in [x["type"] for x in c.job["status"]["conditions"]], "not looked at yet"
    _scheduler_says(c, False, "minCount (2) cannot be satisfied: 1 scheduled, 0 remaining")
    c.step()
    cond = c.condition("GangScheduled")
    assert cond["status"] == "False"
    assert cond["reason"] == "Unschedulable"
    assert cond["message"] == (
        "the scheduler cannot place 2 worker Pods at once: minCount (2) cannot be satisfied: 1 scheduled, "
        "0 remaining"
    )
    assert c.reasons().count("GangUnschedulable") == 1
    c.step()
    c.step()
    assert c.reasons().count("GangUnschedulable") == 1, "one Event per change, not per pass"
    _scheduler_says(c, True)
    c.run_all()
    c.master_says()
    c.step()
    assert c.condition("GangScheduled")["status"] == "True"
    assert c.reasons().count("GangScheduled") == 1
    assert c.job["status"]["phase"] == "Running"


def test_the_gangs_minimum_follows_nodes_min_unless_the_spec_fixes_it() -> None:
    c = FakeCluster(job_obj(nodes={"min": 2, "max": 4}, gangScheduling={"enabled": True}))
    c.step()
    assert c.pod_group is not None
    c.job["spec"]["nodes"] = {"min": 3, "max": 4}
    patches = [a for a in c.step() if isinstance(a, PatchPodGroup)]
    assert patches == [PatchPodGroup("j-workers", 3)]
    assert c.pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 3
    assert not [a for a in c.step() if isinstance(a, PatchPodGroup)], "patched once"
    c.job["spec"]["gangScheduling"] = {"enabled": True, "minNodes": 4}
    assert [a for a in c.step() if isinstance(a, PatchPodGroup)] == [PatchPodGroup("j-workers", 4)]


def test_gang_scheduling_on_a_cluster_without_the_pod_group_api_fails_the_job_at_once() -> None:
    c = FakeCluster(job_obj(gangScheduling={"enabled": True}), pod_group_api=False)
    actions = c.step()
    assert not [a for a in actions if isinstance(a, Create)], "no Pod is placed one by one unannounced"
    assert c.job["status"]["phase"] == "Failed"
    failed = c.condition("Failed")
    assert failed["reason"] == "GangSchedulingUnavailable"
    assert "GenericWorkload feature gate" in failed["message"]
    assert "without spec.gangScheduling" in failed["message"]


def test_coscheduling_places_the_gang_through_scheduler_plugins_and_reads_its_verdict_from_the_pods() -> None:
    gang = {"enabled": True, "scheduler": "coscheduling"}
    c = FakeCluster(job_obj(nodes={"min": 2, "max": 3}, gangScheduling=gang))
    actions = c.step()
    assert c.pod_group is not None
    assert (c.pod_group["apiVersion"], c.pod_group["spec"]) == (
        "scheduling.x-k8s.io/v1alpha1",
        {"minMember": 2},
    )
    workers = [
        a.obj
        for a in actions
        if isinstance(a, Create) and a.obj["kind"] == "Pod" and a.obj["metadata"]["name"].startswith("j-w")
    ]
    assert len(workers) == 3
    for pod in workers:
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "j-workers"
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert "schedulingGroup" not in pod["spec"]
    assert "GangScheduled" not in [x["type"] for x in c.job["status"]["conditions"]], "no word yet"
    waited = "0/6 nodes are available: rejected due to timeout after waiting 10s at plugin Coscheduling"
    for name in c.workers():
        c.pods[name] = dataclasses.replace(c.pods[name], stuck=("Unschedulable", waited))
    c.step()
    said = c.condition("GangScheduled")
    assert (said["status"], said["reason"]) == ("False", "Unschedulable")
    assert said["message"] == f"the scheduler cannot place 2 worker Pods at once: {waited}"
    assert c.reasons().count("GangUnschedulable") == 1
    c.run_all()
    c.step()
    assert c.condition("GangScheduled")["status"] == "True"
    c.job["spec"]["nodes"] = {"min": 3, "max": 3}
    assert [a for a in c.step() if isinstance(a, PatchPodGroup)] == [
        PatchPodGroup("j-workers", 3, "coscheduling")
    ]
    assert c.pod_group["spec"]["minMember"] == 3


def test_coscheduling_without_scheduler_plugins_fails_the_job_saying_so() -> None:
    gang = {"enabled": True, "scheduler": "coscheduling", "schedulerName": "gangs"}
    c = FakeCluster(job_obj(gangScheduling=gang), pod_group_api=False)
    c.step()
    assert c.condition("Failed")["reason"] == "GangSchedulingUnavailable"
    assert "install scheduler-plugins" in c.condition("Failed")["message"]


def test_a_suspended_job_stays_suspended_while_the_master_catches_up_with_a_spec_edit() -> None:
    c = started()
    c.suspend(True)
    c.step()
    c.master_says(phase="Suspended")
    c.step()
    c.step()
    assert c.job["status"]["phase"] == "Suspended"
    since = c.condition("Suspended")["lastTransitionTime"]
    c.job["spec"]["activeDeadline"] = "2h"  # any edit: a new generation the master has not read yet
    c.job["metadata"]["generation"] += 1
    c.now += 60
    c.step()
    suspended = c.condition("Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "JobSuspended")
    assert suspended["lastTransitionTime"] == since, "no flap to Suspending and back"
    assert c.job["status"]["phase"] == "Suspended"
    assert c.reasons().count("Suspended") == 1
    assert c.reasons().count("Suspending") == 1


def test_the_status_names_the_worker_pods_for_the_scale_subresource() -> None:
    c = started()
    assert c.job["status"]["selector"] == "phalanx.dev/job=j,phalanx.dev/role=worker"
    assert c.job["status"]["nodes"] == 2


def test_a_job_another_controller_manages_is_left_alone() -> None:
    from phalanx.operator.reconcile import managed_here

    assert managed_here(job_obj())
    assert managed_here(job_obj(managedBy="phalanx.dev/operator"))
    assert managed_here(job_obj(managedBy="kueue.x-k8s.io/multikueue")), "queued here, run in a worker"
    assert not managed_here(job_obj(managedBy="example.com/another"))


def test_pods_that_cannot_start_are_named_with_their_cause_once_each() -> None:
    """A worker whose image does not exist and one that cannot be placed: PodsReady False with the kubelet's
    and the scheduler's words, one Warning Event per cause (not one per pass), True once everything runs."""
    c = FakeCluster(job_obj())
    c.step()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], phase="Running", node_name="m1")
    c.pods["j-worker-0-0"] = dataclasses.replace(
        c.pods["j-worker-0-0"],
        stuck=("ImagePullBackOff", 'container trainer: Back-off pulling image "nope:1"'),
    )
    c.pods["j-worker-1-0"] = dataclasses.replace(
        c.pods["j-worker-1-0"],
        stuck=("Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
    )
    c.step()
    ready = c.condition("PodsReady")
    assert (ready["status"], ready["reason"]) == ("False", "ImagePullBackOff")
    assert (
        'j-worker-0-0: ImagePullBackOff: container trainer: Back-off pulling image "nope:1"'
        in ready["message"]
    )
    assert "j-worker-1-0: Unschedulable: 0/2 nodes are available" in ready["message"]
    assert [e.reason for e in c.events if e.type == "Warning"] == ["ImagePullBackOff", "Unschedulable"]
    c.step()
    assert len([e for e in c.events if e.type == "Warning"]) == 2, "the same causes are not said again"
    c.run_all()
    c.pods = {n: dataclasses.replace(p, stuck=("", "")) for n, p in c.pods.items()}
    c.master_says()
    c.step()
    ready = c.condition("PodsReady")
    assert (ready["status"], ready["reason"]) == ("True", "PodsRunning")


def _stuck(c: FakeCluster, name: str, reason: str, message: str) -> None:
    c.pods[name] = dataclasses.replace(c.pods[name], stuck=(reason, message))


def test_a_worker_image_that_does_not_exist_fails_the_job_with_its_cause_after_the_operators_bound() -> None:
    """Workers whose image cannot be pulled keep the job below nodes.min: the job fails with the kubelet's
    reason and words once stuck_pod_timeout_s has passed since the first pass that saw it, not after the
    min-nodes timeout; before that it only waits."""
    c = FakeCluster(job_obj())
    c.step()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], phase="Running", node_name="m1")
    for w in ("j-worker-0-0", "j-worker-1-0"):
        _stuck(c, w, "ImagePullBackOff", 'container trainer: Back-off pulling image "nope:1"')
    c.step()
    assert c.job["status"]["stuckSince"]
    c.now += SETTINGS.stuck_pod_timeout_s - 5  # each pass is a second later too
    c.step()
    assert c.job["status"]["phase"] != "Failed", "not yet"
    c.now += 5
    c.step()
    failed = c.condition("Failed")
    assert (c.job["status"]["phase"], failed["reason"]) == ("Failed", "ImagePullBackOff")
    pulled = 'j-worker-0-0 cannot start: container trainer: Back-off pulling image "nope:1"'
    assert pulled in failed["message"]
    assert "fewer than nodes.min=2 workers run" in failed["message"]


def test_a_missing_secret_of_the_master_fails_the_job_and_a_cause_that_heals_resets_the_clock() -> None:
    c = FakeCluster(job_obj())
    c.step()
    _stuck(c, "j-master", "CreateContainerConfigError", 'container master: secret "creds" not found')
    c.step()
    c.now += SETTINGS.stuck_pod_timeout_s - 10
    c.step()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], stuck=("", ""))  # the Secret was created
    c.step()
    assert c.job["status"].get("stuckSince") is None
    _stuck(c, "j-master", "CreateContainerConfigError", 'container master: secret "creds" not found')
    c.now += 20
    c.step()
    assert c.job["status"]["phase"] != "Failed", "the clock started again"
    c.now += SETTINGS.stuck_pod_timeout_s
    c.step()
    failed = c.condition("Failed")
    assert failed["reason"] == "CreateContainerConfigError"
    missing = 'j-master cannot start: container master: secret "creds" not found (the master;'
    assert missing in failed["message"]


def test_causes_that_may_heal_or_a_job_at_its_minimum_do_not_fail_the_job() -> None:
    """Unschedulable (an autoscaler may add the node) and a crash loop (the restart policy's business) are
    only reported; a worker that cannot pull while nodes.min others run does not hold the job back."""
    c = FakeCluster(job_obj(nodes={"min": 1, "max": 2}))
    c.step()
    c.pods["j-master"] = dataclasses.replace(c.pods["j-master"], phase="Running", node_name="m1")
    _stuck(c, "j-worker-0-0", "Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    _stuck(c, "j-worker-1-0", "CrashLoopBackOff", "container trainer: back-off 5m0s restarting")
    c.step()
    c.now += 10 * SETTINGS.stuck_pod_timeout_s
    c.step()
    assert c.job["status"]["phase"] != "Failed"
    assert c.job["status"].get("stuckSince") is None
    c.pods["j-worker-0-0"] = dataclasses.replace(
        c.pods["j-worker-0-0"], phase="Running", node_name="n1", stuck=("", "")
    )
    _stuck(c, "j-worker-1-0", "ErrImagePull", 'container trainer: pull "nope:1": not found')
    c.step()
    c.now += 10 * SETTINGS.stuck_pod_timeout_s
    c.step()
    assert c.job["status"]["phase"] != "Failed", "one worker runs: nodes.min=1 is met"
