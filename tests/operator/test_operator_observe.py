"""The decision's view of a Pod, read from the Kubernetes client's own objects."""

from __future__ import annotations

from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodSpec, V1PodStatus

from phalanx.operator.observe import pod_view


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
