"""The decision's view of a Pod, read from the Kubernetes client's own objects."""

from __future__ import annotations

from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from phalanx.operator.observe import pod_phase, pod_view


def _pod(
    *, phase: str = "Running", reason: str | None = None, conditions: list[V1PodCondition] | None = None
) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name="j-worker-0-0", labels={"phalanx.dev/role": "worker"}),
        spec=V1PodSpec(containers=[], node_name="n1"),
        status=V1PodStatus(phase=phase, reason=reason, conditions=conditions),
    )


def test_the_clusters_reason_for_ending_a_pod_is_read_from_its_disruption_target() -> None:
    drained = _pod(conditions=[
        V1PodCondition(type="Ready", status="True"),
        V1PodCondition(type="DisruptionTarget", status="True", reason="EvictionByEvictionAPI"),
    ])  # fmt: skip
    assert pod_view(drained).disruption == "EvictionByEvictionAPI"
    no_reason = _pod(conditions=[V1PodCondition(type="DisruptionTarget", status="True")])
    assert pod_view(no_reason).disruption == "DisruptionTarget"


def test_a_kubelets_node_pressure_eviction_without_the_condition_is_a_disruption_too() -> None:
    assert pod_view(_pod(phase="Failed", reason="Evicted")).disruption == "Evicted"


def test_a_pod_that_failed_on_its_own_or_whose_condition_is_false_was_not_disrupted() -> None:
    assert pod_view(_pod(phase="Failed", reason="Error")).disruption == ""
    withdrawn = _pod(conditions=[V1PodCondition(type="DisruptionTarget", status="False", reason="x")])
    assert pod_view(withdrawn).disruption == ""
    assert pod_view(V1Pod(metadata=V1ObjectMeta(name="p"), spec=V1PodSpec(containers=[]))).disruption == ""


def _waiting(reason: str, message: str, *, init: bool = False) -> V1Pod:
    status = V1ContainerStatus(
        name="trainer", image="nope:1", image_id="", ready=False, restart_count=0,
        state=V1ContainerState(waiting=V1ContainerStateWaiting(reason=reason, message=message)),
    )  # fmt: skip
    pod = _pod(phase="Pending")
    if init:
        pod.status.init_container_statuses = [status]
    else:
        pod.status.container_statuses = [status]
    return pod


def test_a_pod_that_cannot_start_says_why_in_the_kubelets_or_the_schedulers_words() -> None:
    pulled = pod_view(_waiting("ImagePullBackOff", 'Back-off pulling image "nope:1"'))
    assert pulled.stuck == ("ImagePullBackOff", 'container trainer: Back-off pulling image "nope:1"')
    secret = pod_view(_waiting("CreateContainerConfigError", 'secret "creds" not found', init=True))
    assert secret.stuck == ("CreateContainerConfigError", 'container trainer: secret "creds" not found')
    unplaced = _pod(phase="Pending", conditions=[
        V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                       message="0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
    ])  # fmt: skip
    assert pod_view(unplaced).stuck == (
        "Unschedulable",
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
    )


def test_a_root_image_refused_by_run_as_non_root_says_what_to_set() -> None:
    """The kubelet's words for a vendor image that runs as root (or names its user) under phalanx's
    restricted default, and the fix beside them: the template's runAsUser, or runAsNonRoot: false."""
    root = pod_view(_waiting(
        "CreateContainerConfigError",
        "container has runAsNonRoot and image will run as root "
        '(pod: "j-worker-0-0_ml(u1)", container: trainer)',
    ))  # fmt: skip
    reason, message = root.stuck
    assert reason == "CreateContainerConfigError"
    assert message.startswith("container trainer: container has runAsNonRoot and image will run as root")
    assert "set spec.template.spec.securityContext.runAsUser" in message
    assert "runAsNonRoot: false" in message
    named = pod_view(_waiting(
        "CreateContainerConfigError",
        "container has runAsNonRoot and image has non-numeric user (trainer), cannot verify user is non-root",
    ))  # fmt: skip
    assert "set spec.template.spec.securityContext.runAsUser to that user's uid" in named.stuck[1]
    secret = pod_view(_waiting("CreateContainerConfigError", 'secret "creds" not found'))
    assert secret.stuck[1] == 'container trainer: secret "creds" not found', "no fix where none is known"


def test_a_pod_that_starts_normally_or_has_ended_is_not_stuck() -> None:
    assert pod_view(_waiting("ContainerCreating", "")).stuck == ("", "")
    assert pod_view(_pod()).stuck == ("", "")
    ended = _waiting("CrashLoopBackOff", "back-off")
    ended.status.phase = "Failed"
    assert pod_view(ended).stuck == ("", "")


def test_a_running_pod_whose_node_went_silent_is_unready_and_evicted_for_its_taint() -> None:
    silent = _pod(conditions=[V1PodCondition(type="Ready", status="False", reason="NodeNotReady")])
    assert pod_view(silent).unready
    assert not pod_view(_pod(conditions=[V1PodCondition(type="Ready", status="True")])).unready
    starting = _pod(phase="Pending", conditions=[V1PodCondition(type="Ready", status="False")])
    assert not pod_view(starting).unready, "not started yet: not a silent node"
    evicted = _pod(conditions=[
        V1PodCondition(type="DisruptionTarget", status="True", reason="DeletionByTaintManager"),
    ])  # fmt: skip
    evicted.metadata.deletion_timestamp = "2026-11-30T10:00:00Z"
    assert pod_view(evicted).node_lost
    assert not pod_view(_pod()).node_lost


def test_a_pods_phase_is_one_the_operator_knows() -> None:
    assert pod_phase(None) == "Pending"  # no status yet
    assert pod_phase("") == "Pending"
    assert pod_phase("Running") == "Running"
    assert pod_phase("Succeeded") == "Succeeded"
    assert pod_phase("Evicted") == "Unknown"  # not a phase: a newer or broken API server's word
