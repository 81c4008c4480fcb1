"""What an ElasticJob needs on a real cluster, as pure functions: /dev/shm for the flash checkpoint, the
restricted Pod Security defaults, the master's template, ``nprocPerNode: auto``, host networking, the
termination grace period, a finishing job that is never Restarting, and creates the API server refuses."""

from __future__ import annotations

import copy
import json
from decimal import Decimal
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from phalanx.agent import checkpointing
from phalanx.api.errors import ConfigError
from phalanx.api.settings import JobPodSettings, OperatorSettings
from phalanx.checkpoint import shm, slots
from phalanx.operator import builders, refusals, resources
from phalanx.operator.actions import Create, DeletePod, Event, Observed, PatchStatus, PodView
from phalanx.operator.conditions import rfc3339
from phalanx.operator.events import Aggregator
from phalanx.operator.executor import Executor
from phalanx.operator.reconcile import reconcile
from phalanx.operator.spec import parse_spec

SETTINGS = OperatorSettings()
MIB, GIB = 1 << 20, 1 << 30


def job(**spec: Any) -> dict[str, Any]:
    container = spec.pop("container", {})
    base: dict[str, Any] = {
        "nodes": {"min": 2, "max": 2},
        "template": {
            "spec": {"containers": [{"name": "t", "image": "i", "command": ["python", "t.py"], **container}]}
        },
    }
    base.update(spec)
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": base,
        "status": {},
    }


def gpus(n: Any, **limits: Any) -> dict[str, Any]:
    return {"resources": {"limits": {"nvidia.com/gpu": n, **limits}}}


def worker(j: dict[str, Any]) -> dict[str, Any]:
    return builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)


def master(j: dict[str, Any]) -> dict[str, Any]:
    return builders.master_pod(j, parse_spec(j["spec"]), settings=SETTINGS)


# ------------------------------------------------------------------------------------------------------
# The operator's numbers are the checkpoint's and the agent's (it may not import them)


def test_the_shared_memory_arithmetic_follows_the_flash_checkpoint() -> None:
    assert resources.SLOTS_PER_RANK == shm.SLOTS == 2
    assert resources.SLOT_GROWTH == slots.GROWTH


def test_the_default_grace_covers_the_agents_persist_on_exit() -> None:
    """An agent SIGTERMed waits up to PERSIST_NOW_LIMIT_S for the breakpoint save: the default grace beyond
    restart.gracePeriod covers it, and a little more for the checkpoint host to stop."""
    extra = JobPodSettings().persist_on_exit_s
    assert checkpointing.PERSIST_NOW_LIMIT_S < extra <= checkpointing.PERSIST_NOW_LIMIT_S + 30


# ------------------------------------------------------------------------------------------------------
# Quantities, GPUs, nprocPerNode


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (8, Decimal(8)), ("8", Decimal(8)), ("16Gi", Decimal(16 * GIB)), ("64Mi", Decimal(64 * MIB)),
        ("1.5G", Decimal(1_500_000_000)), ("500m", Decimal("0.5")), ("1e3", Decimal(1000)), ("2k", 2000),
    ],
)  # fmt: skip
def test_parse_quantity(text: Any, value: Decimal) -> None:
    assert resources.parse_quantity(text, field="f") == value


@pytest.mark.parametrize("text", ["lots", "", "16 Gi", "-1Gi", True, None, "1Qi"])
def test_parse_quantity_refuses_what_is_none(text: Any) -> None:
    with pytest.raises(ConfigError, match="expected a quantity such as 16Gi"):
        resources.parse_quantity(text, field="f")


def test_format_mib() -> None:
    assert [resources.format_mib(x) for x in (16 * GIB, 64 * MIB, 1_000_000_000, 1)] == [
        "16Gi", "64Mi", "954Mi", "1Mi",
    ]  # fmt: skip


def test_nproc_auto_is_the_gpu_limit_else_one() -> None:
    assert parse_spec(job(nprocPerNode="auto", container=gpus(8))["spec"]).nproc_per_node == 8
    assert parse_spec(job(nprocPerNode="auto", container=gpus("4"))["spec"]).nproc_per_node == 4
    assert parse_spec(job(nprocPerNode="auto")["spec"]).nproc_per_node == 1
    pod = worker(job(nprocPerNode="auto", container=gpus(8)))
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--nproc-per-node") + 1] == "8"


def test_nproc_above_the_gpu_limit_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_spec(job(nprocPerNode=9, container=gpus(8))["spec"])
    assert exc.value.field == "spec.nprocPerNode"
    assert "9 processes per node but the first container's nvidia.com/gpu limit is 8" in str(exc.value)
    assert "at most 8, or to auto" in str(exc.value)
    assert parse_spec(job(nprocPerNode=4, container=gpus(8))["spec"]).nproc_per_node == 4
    assert parse_spec(job(nprocPerNode=4)["spec"]).nproc_per_node == 4, "no GPU limit: any number"
    for bad in ("often", 0, True):
        with pytest.raises(ConfigError, match="whole number from 1, or auto"):
            parse_spec(job(nprocPerNode=bad)["spec"])
    with pytest.raises(ConfigError, match="whole number of GPUs"):
        parse_spec(job(nprocPerNode="auto", container=gpus("1.5"))["spec"])


def test_with_auto_the_operator_checks_the_parallelism() -> None:
    """Admission cannot divide by a number it does not know yet; the operator refuses it (InvalidSpec)."""
    with pytest.raises(ConfigError, match=r"\(3 x 1\) must divide nprocPerNode x nodes.unit \(8 x 1\)"):
        parse_spec(job(nprocPerNode="auto", parallelism={"tensor": 3}, container=gpus(8))["spec"])
    assert (
        parse_spec(job(nprocPerNode="auto", parallelism={"tensor": 4}, container=gpus(8))["spec"]).tensor == 4
    )


# ------------------------------------------------------------------------------------------------------
# /dev/shm


def _shm(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod["spec"]["volumes"] if v["name"] == builders.SHM_VOLUME), None)


def test_workers_get_a_memory_backed_dev_shm_sized_per_process() -> None:
    pod = worker(job(nprocPerNode=2))
    assert _shm(pod) == {"name": "phalanx-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}
    (c,) = pod["spec"]["containers"]
    assert {"name": "phalanx-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    per_rank = resources.state_fits(4 * GIB, 2)
    assert 0.9 * GIB < per_rank < GIB, "2Gi a process holds two slots of a ~0.9Gi state, with headroom"


def test_the_default_never_exceeds_the_memory_limit() -> None:
    pod = worker(job(nprocPerNode="auto", container=gpus(8, memory="12Gi")))
    assert _shm(pod)["emptyDir"]["sizeLimit"] == "12Gi"  # type: ignore[index]


def test_size_limit_is_taken_and_checked() -> None:
    pod = worker(job(sharedMemory={"sizeLimit": "256Gi"}, container=gpus(8, memory="1Ti")))
    assert _shm(pod)["emptyDir"]["sizeLimit"] == "256Gi"  # type: ignore[index]
    with pytest.raises(ConfigError, match="must be at least 64Mi") as exc:
        parse_spec(job(sharedMemory={"sizeLimit": "32Mi"})["spec"])
    assert exc.value.field == "spec.sharedMemory.sizeLimit"
    with pytest.raises(ConfigError, match="more than the first container's memory limit"):
        parse_spec(job(sharedMemory={"sizeLimit": "32Gi"}, container=gpus(1, memory="16Gi"))["spec"])
    with pytest.raises(ConfigError, match="expected a quantity"):
        parse_spec(job(sharedMemory={"sizeLimit": "lots"})["spec"])


def test_shared_memory_can_be_disabled_or_brought_along() -> None:
    assert _shm(worker(job(sharedMemory={"enabled": False}))) is None
    own = {
        "name": "t",
        "image": "i",
        "command": ["python", "t.py"],
        "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm/"}],
    }
    j = job()
    j["spec"]["template"]["spec"]["containers"] = [own, {"name": "sidecar", "image": "s"}]
    j["spec"]["template"]["spec"]["volumes"] = [{"name": "mine", "emptyDir": {"medium": "Memory"}}]
    pod = worker(j)
    trainer, sidecar = pod["spec"]["containers"]
    assert [m["name"] for m in trainer["volumeMounts"] if m["mountPath"].startswith("/dev/shm")] == ["mine"]
    assert {"name": "phalanx-shm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]


# ------------------------------------------------------------------------------------------------------
# Restricted Pod Security defaults, master template


RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_master_and_workers_get_the_restricted_defaults_and_no_fixed_ids() -> None:
    j = job()
    j["spec"]["template"]["spec"]["initContainers"] = [{"name": "init", "image": "i"}]
    for pod in (master(j), worker(j)):
        assert pod["spec"]["securityContext"] == RESTRICTED_POD
        for c in [*pod["spec"]["containers"], *pod["spec"].get("initContainers", [])]:
            assert c["securityContext"] == RESTRICTED_CONTAINER, c["name"]


def test_the_templates_security_settings_win() -> None:
    j = job(container={"securityContext": {"runAsUser": 0, "capabilities": {"add": ["SYS_ADMIN"]}}})
    j["spec"]["template"]["spec"]["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    pod = worker(j)
    assert "runAsNonRoot" not in pod["spec"]["securityContext"], "runAsUser 0 asked for: not refused here"
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"add": ["SYS_ADMIN"], "drop": ["ALL"]}
    assert "allowPrivilegeEscalation" not in sc, "the API server refuses it beside CAP_SYS_ADMIN"
    privileged = worker(job(container={"securityContext": {"privileged": True}}))
    assert "allowPrivilegeEscalation" not in privileged["spec"]["containers"][0]["securityContext"]
    windows = job()
    windows["spec"]["template"]["spec"]["os"] = {"name": "windows"}
    assert "seccompProfile" not in worker(windows)["spec"]["securityContext"]


def test_a_masters_own_bound_on_a_lost_node_is_kept() -> None:
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
           "tolerationSeconds": 600}  # fmt: skip
    pod = master(job(master={"template": {"spec": {"tolerations": [own]}}}))
    unreachable = [t for t in pod["spec"]["tolerations"] if t["key"] == own["key"]]
    assert unreachable == [own]
    not_ready = [t for t in pod["spec"]["tolerations"] if t["key"].endswith("not-ready")]
    assert [t["tolerationSeconds"] for t in not_ready] == [30]


def test_the_master_template_places_and_dresses_the_master() -> None:
    template = {
        "metadata": {"labels": {"team": "ml", "phalanx.dev/role": "not-this"}, "annotations": {"a": "b"}},
        "spec": {
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "cpu"},
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            "priorityClassName": "training-high",
            "imagePullSecrets": [{"name": "registry"}],
            "securityContext": {"runAsUser": 1000780000, "fsGroup": 1000780000},
            "containers": [
                {
                    "name": "master",
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                    "securityContext": {"readOnlyRootFilesystem": True},
                }
            ],
        },
    }
    pod = master(job(master={"template": template}))
    spec = pod["spec"]
    for key in ("nodeSelector", "affinity", "priorityClassName", "imagePullSecrets"):
        assert spec[key] == template["spec"][key], key
    node_lost = [
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 30}
        for taint in ("unreachable", "not-ready")
    ]  # fmt: skip
    assert spec["tolerations"] == [*template["spec"]["tolerations"], *node_lost], "and a bound on a lost node"
    assert spec["securityContext"] == {**RESTRICTED_POD, "runAsUser": 1000780000, "fsGroup": 1000780000}
    (c,) = spec["containers"]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}
    assert c["securityContext"] == {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True}
    assert c["command"][:2] == ["phalanx", "master"], "the command stays the operator's"
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "ml"
    assert labels["phalanx.dev/role"] == "master", "the operator's labels win"
    assert pod["metadata"]["annotations"]["a"] == "b"
    assert pod["metadata"]["annotations"]["phalanx.dev/nodes"] == "2:2"
    old_style = master(job(master={"resources": {"limits": {"cpu": "1"}}}))
    assert old_style["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}}


# ------------------------------------------------------------------------------------------------------
# Host network, termination grace


def test_host_network_keeps_the_cluster_dns() -> None:
    j = job()
    j["spec"]["template"]["spec"]["hostNetwork"] = True
    assert worker(j)["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    j["spec"]["template"]["spec"]["dnsPolicy"] = "None"
    assert worker(j)["spec"]["dnsPolicy"] == "None", "the template's own wins"
    assert "dnsPolicy" not in worker(job())["spec"]


def test_an_evicted_worker_gets_only_the_time_to_stop_its_workers() -> None:
    """It persists nothing (the master refuses what a bad node holds): the long grace is not for it."""
    j = job(restart={"gracePeriod": "5s"})
    j["status"] = {
        "phase": "Running",
        "workerIncarnations": [0, 0],
        "master": {"phase": "Running"},
        "evictions": [{"nodeId": "j-worker-0-0", "machine": "m1", "reason": "hung"}],
    }
    pods = [
        PodView(name="j-master", role="master", phase="Running"),
        *(PodView(name=f"j-worker-{i}-0", role="worker", phase="Running", node_name="m1") for i in (0, 1)),
    ]
    actions = _pass(j, pods, 1000)
    assert DeletePod("j-worker-0-0", grace_period_s=15) in actions


def test_termination_grace_is_set_from_the_spec_and_must_leave_time_to_persist() -> None:
    assert worker(job())["spec"]["terminationGracePeriodSeconds"] == 5 + 130
    assert worker(job(terminationGracePeriod="15m"))["spec"]["terminationGracePeriodSeconds"] == 900
    with pytest.raises(ConfigError, match=r"longer than restart.gracePeriod \(30s\)"):
        parse_spec(job(restart={"gracePeriod": "30s"}, terminationGracePeriod="20s")["spec"])


# ------------------------------------------------------------------------------------------------------
# A finishing job is not Restarting


def _pass(j: dict[str, Any], pods: list[PodView], now: float) -> list[Any]:
    observed = Observed(
        job=copy.deepcopy(j),
        pods=pods,
        existing=frozenset(
            (k, n) for k, n in (("Secret", "j-token"), ("ConfigMap", "j-master-state"),
                                ("ServiceAccount", "j-master"), ("Role", "j-master"),
                                ("RoleBinding", "j-master"), ("Service", "j-master"),
                                ("NetworkPolicy", "j-master"), ("NetworkPolicy", "j-workers"))
        ),
    )  # fmt: skip
    actions = reconcile(observed, now=now, settings=SETTINGS, new_token="tok")
    for a in actions:
        if isinstance(a, PatchStatus):
            j["status"].update(a.status)
    return actions


def test_a_job_whose_nodes_finish_one_by_one_never_restarts() -> None:
    """The example's story: the first worker exits 0 a heartbeat before the other, then the master says
    Succeeded. Before, the operator called that Restarting ("Warning Restarting ... 1 of 2 nodes")."""
    j = job()
    up = [
        PodView(name="j-master", role="master", phase="Running"),
        PodView(name="j-worker-0-0", role="worker", phase="Running"),
        PodView(name="j-worker-1-0", role="worker", phase="Running"),
    ]
    j["status"] = {"phase": "Running", "workerIncarnations": [0, 0], "master": {"phase": "Running"}}
    _pass(j, up, 1000)
    assert j["status"]["phase"] == "Running"
    events: list[Event] = []
    first_done = [up[0], PodView(name="j-worker-0-0", role="worker", phase="Succeeded", exit_code=0), up[2]]
    events += [a for a in _pass(j, first_done, 1001) if isinstance(a, Event)]
    assert j["status"]["phase"] == "Running"
    restarting = next(c for c in j["status"]["conditions"] if c["type"] == "Restarting")
    assert restarting["status"] == "False"
    running = next(c for c in j["status"]["conditions"] if c["type"] == "Running")
    assert running["message"] == "1 of 2 worker Pods running, 1 finished (minimum 2)"
    both_done = [up[0], *(PodView(name=f"j-worker-{i}-0", role="worker", phase="Succeeded") for i in (0, 1))]
    actions = _pass(j, both_done, 1002)
    events += [a for a in actions if isinstance(a, Event)]
    assert not [a for a in actions if isinstance(a, Create)], "finished nodes are not replaced"
    j["status"]["master"] = {"phase": "Succeeded"}
    events += [a for a in _pass(j, both_done, 1003) if isinstance(a, Event)]
    assert j["status"]["phase"] == "Succeeded"
    assert [e.reason for e in events] == ["Succeeded"], events


def test_a_lost_node_still_restarts_the_job() -> None:
    j = job()
    j["status"] = {"phase": "Running", "workerIncarnations": [0, 0], "master": {"phase": "Running"}}
    pods = [
        PodView(name="j-master", role="master", phase="Running"),
        PodView(name="j-worker-0-0", role="worker", phase="Failed", exit_code=1),
        PodView(name="j-worker-1-0", role="worker", phase="Running"),
    ]
    actions = _pass(j, pods, 1000)
    assert j["status"]["phase"] == "Restarting"
    assert any(isinstance(a, Event) and a.reason == "Restarting" for a in actions)


# ------------------------------------------------------------------------------------------------------
# Creates the API server refuses


def _refuse(j: dict[str, Any], names: list[str], message: str, now: float) -> None:
    """What the executor does after a pass whose creates of ``names`` were refused."""
    refused = [refusals.Refusal("Pod", n, 403, message) for n in names]
    j["status"].update(refusals.refused_status(j["status"], refused, now=now, generation=1))


def test_a_refused_worker_is_asked_for_again_under_its_name_and_is_no_replacement() -> None:
    j = job()
    master_pod = PodView(name="j-master", role="master", phase="Running")
    first = _pass(j, [], 1000)
    names = [a.obj["metadata"]["name"] for a in first if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert names == ["j-master", "j-worker-0-0", "j-worker-1-0"]
    message = 'pods "j-worker-0-0" is forbidden: exceeded quota: q, requested: pods=1, limited: pods=2'
    _refuse(j, ["j-worker-0-0", "j-worker-1-0"], message, 1000)
    condition = next(c for c in j["status"]["conditions"] if c["type"] == "ReplicaFailure")
    assert (condition["status"], condition["reason"]) == ("True", "FailedCreate")
    assert f"cannot create Pod j-worker-0-0: {message}" in condition["message"]
    for now in (1001, 1002, 1003, 1004, 1005):  # more passes than restart.maxEvictions allows replacements
        actions = _pass(j, [master_pod], now)
        created = [a.obj["metadata"]["name"] for a in actions if isinstance(a, Create)]
        assert created == ["j-worker-0-0", "j-worker-1-0"]
        _refuse(j, created, message, now)
    assert j["status"].get("replacements", 0) == 0
    assert j["status"]["phase"] != "Failed"
    assert j["status"]["workerIncarnations"] == [0, 0]
    # The quota is raised: the Pods are created, and the next pass, with nothing left to create, says so.
    workers = [PodView(name=f"j-worker-{i}-0", role="worker", phase="Pending") for i in (0, 1)]
    _pass(j, [master_pod, *workers], 1006)
    condition = next(c for c in j["status"]["conditions"] if c["type"] == "ReplicaFailure")
    assert (condition["status"], condition["reason"]) == ("False", "Created")
    assert j["status"]["refusedPods"] == []


def test_a_refusal_longer_than_the_timeout_fails_the_job_with_the_apis_message() -> None:
    j = job(createRefusedTimeout="2m")
    _pass(j, [], 1000)
    message = 'pods "j-master" is forbidden: violates PodSecurity "restricted:latest": privileged'
    _refuse(j, ["j-master", "j-worker-0-0", "j-worker-1-0"], message, 1000)
    for now in (1030, 1060, 1119):
        actions = _pass(j, [], now)
        assert [a.obj["metadata"]["name"] for a in actions if isinstance(a, Create)] == [
            "j-master", "j-worker-0-0", "j-worker-1-0",
        ]  # fmt: skip
        _refuse(j, ["j-master", "j-worker-0-0", "j-worker-1-0"], message, now)
    actions = _pass(j, [], 1120)
    assert not [a for a in actions if isinstance(a, Create)]
    assert j["status"]["phase"] == "Failed"
    failed = next(c for c in j["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "FailedCreate"
    assert "longer than spec.createRefusedTimeout (2m)" in failed["message"]
    assert message in failed["message"]


def test_refused_status_keeps_the_first_refusals_time() -> None:
    status: dict[str, Any] = {}
    status.update(
        refusals.refused_status(status, [refusals.Refusal("Pod", "a", 403, "no")], now=10, generation=1)
    )
    status.update(
        refusals.refused_status(status, [refusals.Refusal("Pod", "a", 403, "still no")], now=99, generation=1)
    )
    (c,) = status["conditions"]
    assert c["lastTransitionTime"] == rfc3339(10)
    assert c["message"] == "cannot create Pod a: still no"
    assert status["refusedPods"] == ["a"]


def test_api_message_is_the_status_message() -> None:
    body = json.dumps(
        {"kind": "Status", "message": 'pods "x" is forbidden: exceeded quota', "reason": "Forbidden"}
    )
    assert refusals.api_message(body, fallback="Forbidden") == 'pods "x" is forbidden: exceeded quota'
    assert refusals.api_message(body.encode(), fallback="Forbidden").startswith('pods "x"')
    assert refusals.api_message(None, fallback="Forbidden") == "Forbidden"
    assert refusals.api_message("not json", fallback="Forbidden") == "not json"
    assert [refusals.is_refusal(c) for c in (400, 403, 422, 409, 429, 500, None)] == [
        True, True, True, False, False, False, False,
    ]  # fmt: skip


class FakeCore:
    """Pods are refused; Events are kept so that the test sees creates and count-ups."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def create_namespaced_pod(self, ns: str, obj: dict[str, Any]) -> None:
        body = json.dumps(
            {"kind": "Status", "message": f'pods "{obj["metadata"]["name"]}" is forbidden: exceeded quota'}
        )
        raise ApiException(status=403, reason="Forbidden", body=body)

    def create_namespaced_event(self, ns: str, body: dict[str, Any]) -> None:
        self.events[body["metadata"]["name"]] = body

    def patch_namespaced_event(self, name: str, ns: str, body: dict[str, Any]) -> None:
        self.patches.append((name, body))
        self.events[name].update(body)


class FakeCustom:
    def __init__(self) -> None:
        self.status_patches: list[dict[str, Any]] = []

    def patch_namespaced_custom_object_status(self, *args: Any) -> None:
        self.status_patches.append(args[-1]["status"])


def test_the_executor_records_a_refusal_and_counts_its_event_up() -> None:
    ex = Executor(api=client.ApiClient(), settings=SETTINGS)
    core, custom = FakeCore(), FakeCustom()
    ex.core, ex.custom = core, custom
    j = job()
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    actions = [
        Create(pod),
        Event("Normal", "WorkerCreated", "created worker Pod j-worker-0-0", about="j-worker-0-0"),
        PatchStatus({"workerIncarnations": [0, -1]}),
    ]
    for _ in range(3):
        ex.apply(j, actions)
    (event,) = core.events.values()
    assert (event["type"], event["reason"], event["count"]) == ("Warning", "FailedCreate", 3)
    assert (
        event["message"] == 'cannot create Pod j-worker-0-0: pods "j-worker-0-0" is forbidden: exceeded quota'
    )
    assert len(core.patches) == 2, "repeats count the Event up"
    refused = custom.status_patches[1]
    assert refused["refusedPods"] == ["j-worker-0-0"]
    (condition,) = refused["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "ReplicaFailure",
        "True",
        "FailedCreate",
    )
    assert "exceeded quota" in condition["message"]


def test_the_event_aggregator() -> None:
    agg = Aggregator(window_s=60, max_keys=2)
    first = agg.record(("a",), now=0, stamp="t0", new_name="e1")
    assert (first.name, first.count, first.new) == ("e1", 1, True)
    again = agg.record(("a",), now=30, stamp="t1", new_name="e2")
    assert (again.name, again.count, again.first, again.new) == ("e1", 2, "t0", False)
    assert agg.record(("a",), now=100, stamp="t2", new_name="e3").name == "e3", "past the window: a new one"
    agg.record(("b",), now=101, stamp="t", new_name="b1")
    agg.record(("c",), now=102, stamp="t", new_name="c1")
    assert agg.record(("a",), now=103, stamp="t", new_name="a2").new, "the oldest key was forgotten"
    agg.forget(("c",))
    assert agg.record(("c",), now=104, stamp="t", new_name="c2").name == "c2"


# ------------------------------------------------------------------------------------------------------
# A save that does not fit in /dev/shm


def test_a_save_that_does_not_fit_says_which_field_to_raise() -> None:
    j = job(nprocPerNode=2, sharedMemory={"sizeLimit": "1Gi"})
    j["status"] = {"phase": "Running", "master": {
        "phase": "Failed",
        "reason": "user error on every rank: CheckpointError: cannot allocate 734003200 bytes of "
        "shared memory in /dev/shm: [Errno 28] 1073741824 bytes free, two slots need 1468006400 more",
    }}  # fmt: skip
    _pass(j, [], 1000)
    failed = next(c for c in j["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "SharedMemoryExhausted"
    assert "CheckpointError: cannot allocate" in failed["message"]
    assert (
        "/dev/shm is 1Gi (spec.sharedMemory.sizeLimit): two slots for each of 2 ranks hold about 233Mi"
        in (failed["message"])
    )
    other = job()
    other["status"] = {"master": {"phase": "Failed", "reason": "ValueError: bad data"}}
    _pass(other, [], 1000)
    assert next(c for c in other["status"]["conditions"] if c["type"] == "Failed")["reason"] == (
        "MasterReportedFailure"
    )
