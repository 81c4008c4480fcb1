"""What the operator refuses from a job's templates while its admission policy is missing
(phalanx.operator.privileged): pure logic over template dicts."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.operator.privileged import refusal, requests


def spec(pod: dict[str, Any], master: dict[str, Any] | None = None) -> dict[str, Any]:
    pod = {"containers": [{"name": "t", "image": "i"}], **pod}
    out: dict[str, Any] = {"template": {"spec": pod}}
    if master is not None:
        out["master"] = {"template": {"spec": master}}
    return out


def test_an_ordinary_template_asks_for_nothing() -> None:
    ordinary = spec(
        {
            "serviceAccountName": "default",
            "volumes": [
                {"name": "d", "emptyDir": {}},
                {"name": "c", "configMap": {"name": "cfg"}},
                {"name": "s", "secret": {"secretName": "hf-token"}},
                {"name": "p", "persistentVolumeClaim": {"claimName": "data"}},
            ],
            "containers": [
                {
                    "name": "t",
                    "ports": [{"containerPort": 29400}],
                    "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}},
                }
            ],
        }
    )
    assert requests(ordinary) == []
    assert requests({}) == []
    assert requests({"template": "nonsense", "master": 3}) == []


@pytest.mark.parametrize(
    ("pod", "path"),
    [
        ({"hostNetwork": True}, "spec.template.spec.hostNetwork"),
        ({"hostPID": True}, "spec.template.spec.hostPID"),
        ({"hostIPC": True}, "spec.template.spec.hostIPC"),
        ({"serviceAccountName": "cluster-admin"}, "spec.template.spec.serviceAccountName"),
        ({"serviceAccount": "builder"}, "spec.template.spec.serviceAccount"),
        ({"nodeName": "db-node-1"}, "spec.template.spec.nodeName"),
        ({"volumes": [{"name": "v", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/"}}]},
         "spec.template.spec.volumes[1].hostPath"),
        ({"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]},
         "spec.template.spec.volumes[0].nfs"),
        ({"containers": [{"name": "t", "securityContext": {"privileged": True}}]},
         "spec.template.spec.containers[0].securityContext.privileged"),
        ({"initContainers": [{"name": "i", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
         "spec.template.spec.initContainers[0].securityContext.capabilities.add"),
        ({"containers": [{"name": "t", "ports": [{"containerPort": 80, "hostPort": 80}]}]},
         "spec.template.spec.containers[0].ports[0].hostPort"),
        ({"containers": [{"name": "t", "securityContext": {"windowsOptions": {"hostProcess": True}}}]},
         "spec.template.spec.containers[0].securityContext.windowsOptions.hostProcess"),
        ({"runtimeClassName": "unsandboxed"}, "spec.template.spec.runtimeClassName"),
        ({"priorityClassName": "system-node-critical"}, "spec.template.spec.priorityClassName"),
        ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
         "spec.template.spec.securityContext.seccompProfile"),
        ({"containers": [{"name": "t", "securityContext": {"appArmorProfile": {"type": "Unconfined"}}}]},
         "spec.template.spec.containers[0].securityContext.appArmorProfile"),
    ],
)  # fmt: skip
def test_each_privileged_field_is_named_by_its_path(pod: dict[str, Any], path: str) -> None:
    assert requests(spec(pod)) == [path]


def test_the_master_template_is_read_too_and_the_message_says_what_to_install() -> None:
    found = requests(spec({}, master={"hostNetwork": True}))
    assert found == ["spec.master.template.spec.hostNetwork"]
    message = refusal(found * 7, policy="phalanx-elasticjob-templates")
    assert "and 2 more" in message
    assert "phalanx-elasticjob-templates" in message
    assert "deploy/elasticjob-admission.yaml" in message


@pytest.mark.parametrize(
    ("annotations", "refused"),
    [
        ({"container.apparmor.security.beta.kubernetes.io/t": "unconfined"}, True),
        ({"container.apparmor.security.beta.kubernetes.io/t": "runtime/default"}, False),
        ({"container.apparmor.security.beta.kubernetes.io/t": "localhost/train"}, False),
        ({"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}, True),
        ({"container.seccomp.security.alpha.kubernetes.io/t": "unconfined"}, True),
        ({"seccomp.security.alpha.kubernetes.io/pod": "runtime/default"}, False),
        ({"prometheus.io/scrape": "true"}, False),
    ],
)
def test_an_unconfined_profile_by_annotation_is_named_and_others_are_not(
    annotations: dict[str, str], refused: bool
) -> None:
    job = spec({})
    job["template"]["metadata"] = {"annotations": annotations}
    (key,) = annotations
    assert requests(job) == ([f"spec.template.metadata.annotations[{key}]"] if refused else [])


def test_a_priority_class_of_ones_own_is_ordinary() -> None:
    assert requests(spec({"priorityClassName": "team-a-high"}, master={"priorityClassName": "team-a"})) == []
    assert requests(spec({}, master={"priorityClassName": "system-cluster-critical"})) == [
        "spec.master.template.spec.priorityClassName"
    ]
