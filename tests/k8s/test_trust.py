"""Who can do what, attacked on the real control plane: a user with only ElasticJob rights gets nothing
through the operator that they could not create themselves (the ValidatingAdmissionPolicy of
deploy/elasticjob-admission.yaml, with `kubectl --as`), a fake machine name is never cordoned, an oversized
or broken job fails alone, workers never hold the metrics token, and a foreign object named like the job's
own is left untouched."""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.cluster import Cluster
from k8s_harness.controlplane import ControlPlane
from kubernetes import config as k8s_config
from tests.eventually import eventually

from phalanx.api import elasticjob
from phalanx.api.settings import OperatorSettings
from phalanx.operator.admission import MAX_NODES
from phalanx.operator.crd import build_crd
from phalanx.operator.executor import Executor
from phalanx.operator.reconcile import reconcile

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
ADMISSION = ROOT / "deploy" / "elasticjob-admission.yaml"
CORDON_RBAC = ROOT / "deploy" / "operator-rbac-cordon.yaml"
AUTHOR = "alice"  # ElasticJob rights only
POWER_USER = "bob"  # may create Pods in the namespace too
CLAIM_MAKER = "carol"  # ElasticJob and the author's read rights, and may create PersistentVolumeClaims
SIMULATED = {
    "nodeSelector": {"phalanx.dev/test-kubelet": "simulated"},
    "tolerations": [{"key": "phalanx.dev/simulated", "operator": "Exists", "effect": "NoSchedule"}],
}
"""Worker Pods on the test kubelet's simulated nodes: Running, with no process."""


ADMISSION_NAMESPACE = "trust-admission"
ANOTHER_CONTROLLER = "example.com/another-controller"
"""The admission tests' jobs are only admitted, never run: another controller's (``spec.managedBy``), which
the admission policy checks like any other and the operator leaves alone, so none starts a master."""


def _job(name: str, namespace: str, **pod: Any) -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": "x",
        "command": ["python", "train.py"],
        **pod.pop("container", {}),
    }
    spec: dict[str, Any] = {
        "nodes": {"min": 1, "max": 1},
        "template": {"spec": {"containers": [container], **pod}},
    }
    if namespace == ADMISSION_NAMESPACE:
        spec["managedBy"] = ANOTHER_CONTROLLER
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def _create(cp: ControlPlane, obj: dict[str, Any], *, user: str = "") -> str:
    args = ["create", "-f", "-"] + (["--as", user] if user else [])
    return cp.kubectl(*args, input_text=json.dumps(obj), check=False)


# ------------------------------------------------------------------------------------------------------
# A job author gets no more than they could create


@pytest.fixture(scope="module")
def authors(control_plane: ControlPlane) -> Iterator[str]:
    """The admission policy installed, a namespace where alice may only manage ElasticJobs (and read the
    Secret `readable`) and bob may also create Pods."""
    cp = control_plane
    ns = ADMISSION_NAMESPACE
    cp.kubectl("apply", "-f", str(ADMISSION))
    cp.kubectl("create", "namespace", ns)
    rbac = f"""
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: elasticjob-author, namespace: {ns}}}
rules:
  - apiGroups: [phalanx.dev]
    resources: [elasticjobs]
    verbs: [get, list, watch, create, update, patch, delete]
  - {{apiGroups: [""], resources: [secrets], resourceNames: [readable], verbs: [get]}}
  - {{apiGroups: [""], resources: [persistentvolumeclaims], resourceNames: [shared], verbs: [get]}}
  - {{apiGroups: [""], resources: [persistentvolumeclaims], resourceNames: [own], verbs: [get, update]}}
  - apiGroups: [resource.k8s.io]
    resources: [resourceclaimtemplates]
    resourceNames: [one-gpu]
    verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: elasticjob-authors, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: elasticjob-author}}
subjects:
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {AUTHOR}}}
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {POWER_USER}}}
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {CLAIM_MAKER}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: claim-maker, namespace: {ns}}}
rules:
  - {{apiGroups: [""], resources: [persistentvolumeclaims], verbs: [create]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: claim-makers, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: claim-maker}}
subjects:
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {CLAIM_MAKER}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: pod-creator, namespace: {ns}}}
rules:
  - {{apiGroups: [""], resources: [pods], verbs: [create, get, patch]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: pod-creators, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-creator}}
subjects:
  - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: {POWER_USER}}}
"""
    cp.kubectl("apply", "-f", "-", input_text=rbac)
    # The policy's binding takes a moment to reach the API server's admission plugin.
    probe = _job("probe", ns, hostPID=True)

    def refused() -> bool:
        if "hostPID" in _create(cp, probe, user=AUTHOR):
            return True
        cp.kubectl("delete", "ej", "probe", "-n", ns, "--ignore-not-found", "--wait=false")
        return False

    eventually(refused, timeout=30, interval=0.5, what="the ValidatingAdmissionPolicy taking effect")
    yield ns
    cp.kubectl("delete", "namespace", ns, "--wait=false")


REFUSED = [
    (
        "privileged",
        {"container": {"securityContext": {"privileged": True}}},
        "securityContext.privileged of container trainer: a privileged container owns its node; remove it",
    ),
    (
        "host-path",
        {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
        "spec.template.spec.volumes root: allowed are emptyDir",
    ),
    (
        "foreign-service-account",
        {"serviceAccountName": "ci-deployer"},
        "spec.template.spec.serviceAccountName ci-deployer: you may not create tokens for that service "
        "account in trust-admission",
    ),
    ("host-network", {"hostNetwork": True}, "spec.template.spec: hostNetwork would share the node"),
    (
        "capability",
        {"container": {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}},
        "only NET_BIND_SERVICE may be added",
    ),
    (
        "unconfined-seccomp",
        {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        "an Unconfined seccomp or AppArmor profile",
    ),
    (
        "unreadable-secret-env",
        {"container": {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "db", "key": "k"}}}]}},
        "env/envFrom of container trainer names a Secret or ConfigMap you may not read",
    ),
    (
        "unreadable-secret-volume",
        {"volumes": [{"name": "creds", "secret": {"secretName": "db"}}]},
        "spec.template.spec.volumes creds: one of them mounts a ConfigMap, Secret or PersistentVolumeClaim "
        "you may not read",
    ),
    (
        "unreadable-secret-env-from",
        {"container": {"envFrom": [{"secretRef": {"name": "db"}}]}},
        "env/envFrom of container trainer names a Secret or ConfigMap you may not read",
    ),
    (
        "unreadable-configmap-env",
        {
            "container": {
                "env": [{"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}}]
            }
        },
        "env/envFrom of container trainer names a Secret or ConfigMap you may not read",
    ),
    (
        "unreadable-projected-secret",
        {
            "volumes": [
                {
                    "name": "bundle",
                    "projected": {"sources": [{"downwardAPI": {"items": []}}, {"secret": {"name": "db"}}]},
                }
            ]
        },
        "spec.template.spec.volumes bundle: one of them mounts a ConfigMap, Secret or PersistentVolumeClaim "
        "you may not read",
    ),
    (
        "ephemeral-claim",  # alice may not create PersistentVolumeClaims, which an ephemeral volume does
        {
            "volumes": [
                {
                    "name": "scratch",
                    "ephemeral": {
                        "volumeClaimTemplate": {
                            "spec": {
                                "accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": "1Gi"}},
                            }
                        }
                    },
                }
            ]
        },
        "spec.template.spec.volumes scratch: one of them mounts a ConfigMap, Secret or PersistentVolumeClaim "
        "you may not read",
    ),
]


REFUSED += [
    (
        "read-write-claim",  # alice may read the claim `shared`, not change it
        {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}]},
        "spec.template.spec.volumes: a read-write mount of claim shared needs the right to update it in "
        "trust-admission",
    ),
    (
        "node-by-name",
        {"nodeName": "db-node-1"},
        "spec.template.spec.nodeName: a node by name skips the scheduler",
    ),
    (
        "system-priority",
        {"priorityClassName": "system-node-critical"},
        "priorityClassName system-node-critical",
    ),
    ("runtime-class", {"runtimeClassName": "unsandboxed"}, "runtimeClassName unsandboxed: a node by name"),
    (
        "someone-elses-device",
        {"resourceClaims": [{"name": "gpu", "resourceClaimName": "bobs-gpu"}]},
        "spec.template.spec.resourceClaims bobs-gpu: using a ResourceClaim needs the right to update it",
    ),
]


def _clone(source: dict[str, Any]) -> dict[str, Any]:
    """A template whose ephemeral volume's claim is filled from ``source`` (dataSourceRef)."""
    claim = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, **source}
    return {"volumes": [{"name": "copy", "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}]}


@pytest.mark.parametrize(
    ("case", "source"),
    [
        ("claim", {"dataSource": {"kind": "PersistentVolumeClaim", "name": "db"}}),
        ("claim-elsewhere",
         {"dataSourceRef": {"kind": "PersistentVolumeClaim", "name": "shared", "namespace": "db"}}),
        ("snapshot",
         {"dataSourceRef": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "s"}}),
        ("populator", {"dataSourceRef": {"apiGroup": "example.com", "kind": "Copier", "name": "c"}}),
    ],
)  # fmt: skip
def test_an_ephemeral_claim_filled_from_what_its_author_may_not_read_is_refused(
    control_plane: ControlPlane, authors: str, case: str, source: dict[str, Any]
) -> None:
    """carol may create claims (so an ephemeral volume is hers to make) but not read the claim `db`, any
    snapshot, or a claim of another namespace; a populator of another kind is refused outright."""
    out = _create(control_plane, _job(f"clone-{case}", authors, **_clone(source)), user=CLAIM_MAKER)
    assert "created" not in out, f"{case}: carol got a copy of {source}"
    assert (
        "spec.template.spec.volumes copy: an ephemeral claim filled from a claim or VolumeSnapshot" in out
    ), out


@pytest.mark.parametrize(
    ("case", "annotation"),
    [
        ("apparmor", ("container.apparmor.security.beta.kubernetes.io/trainer", "unconfined")),
        ("seccomp", ("seccomp.security.alpha.kubernetes.io/pod", "unconfined")),
    ],
)
def test_an_unconfined_profile_by_annotation_is_refused_on_either_template(
    control_plane: ControlPlane, authors: str, case: str, annotation: tuple[str, str]
) -> None:
    key, value = annotation
    job = _job(f"annotated-{case}", authors)
    job["spec"]["template"]["metadata"] = {"annotations": {key: value}}
    out = _create(control_plane, job, user=AUTHOR)
    assert "metadata.annotations: an AppArmor annotation other than runtime/default" in out, out
    job = _job(f"master-annotated-{case}", authors)
    job["spec"]["master"] = {"template": {"metadata": {"annotations": {key: value}}}}
    out = _create(control_plane, job, user=AUTHOR)
    assert "metadata.annotations: an AppArmor annotation other than runtime/default" in out, out


@pytest.mark.parametrize(("case", "pod", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_template_beyond_the_authors_rights_is_refused_with_what_to_fix(
    control_plane: ControlPlane, authors: str, case: str, pod: dict[str, Any], message: str
) -> None:
    out = _create(control_plane, _job(case, authors, **copy.deepcopy(pod)), user=AUTHOR)
    assert "created" not in out, f"{case}: an ElasticJob author got {pod} through the operator"
    assert "ValidatingAdmissionPolicy 'phalanx-elasticjob-templates'" in out, out
    assert message in out, out


def test_the_master_template_is_held_to_the_same_rules(control_plane: ControlPlane, authors: str) -> None:
    job = _job("master-privileged", authors)
    job["spec"]["master"] = {
        "template": {"spec": {"containers": [{"name": "master", "securityContext": {"privileged": True}}]}}
    }
    out = _create(control_plane, job, user=AUTHOR)
    assert "securityContext.privileged of container master" in out, out
    job["spec"]["master"] = {"template": {"spec": {"imagePullSecrets": [{"name": "registry"}]}}}
    out = _create(control_plane, job, user=AUTHOR)
    assert "imagePullSecrets registry: one of them is a Secret you may not read yourself" in out, out


def test_what_the_author_may_use_or_could_create_is_admitted(
    control_plane: ControlPlane, authors: str
) -> None:
    cp = control_plane
    plain = _job("plain", authors, volumes=[{"name": "scratch", "emptyDir": {}}])
    assert "created" in _create(cp, plain, user=AUTHOR)
    readable = _job("readable", authors, volumes=[{"name": "creds", "secret": {"secretName": "readable"}}])
    assert "created" in _create(cp, readable, user=AUTHOR), "a Secret alice may read herself"
    projected = _job(
        "projected", authors,
        volumes=[{"name": "bundle", "projected": {"sources": [
            {"secret": {"name": "readable"}},
            {"downwardAPI": {"items": [{"path": "n", "fieldRef": {"fieldPath": "metadata.name"}}]}},
        ]}}],
        container={"envFrom": [{"secretRef": {"name": "readable"}}]},
    )  # fmt: skip
    assert "created" in _create(cp, projected, user=AUTHOR), (
        "a projected and an envFrom Secret alice may read"
    )
    # What the template may carry with alice's own rights: a claim she may read mounted read-only, one she
    # may change mounted read-write, a device from a claim template she may read, a priority class of the
    # team's, the default AppArmor profile by annotation; carol copies a claim she may read.
    ordinary = _job(
        "ordinary", authors,
        volumes=[
            {"name": "ro", "persistentVolumeClaim": {"claimName": "shared", "readOnly": True}},
            {"name": "rw", "persistentVolumeClaim": {"claimName": "own"}},
        ],
        resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        priorityClassName="team-a-high",
    )  # fmt: skip
    ordinary["spec"]["template"]["metadata"] = {
        "annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "runtime/default"}
    }
    assert "created" in _create(cp, ordinary, user=AUTHOR)
    copy_of_shared = _job(
        "copy", authors, **_clone({"dataSource": {"kind": "PersistentVolumeClaim", "name": "shared"}})
    )
    assert "created" in _create(cp, copy_of_shared, user=CLAIM_MAKER)
    # bob may create Pods here: he could create a privileged, hostPath or other-account Pod himself.
    mighty = _job(
        "mighty", authors, serviceAccountName="ci-deployer", hostNetwork=True,
        volumes=[{"name": "root", "hostPath": {"path": "/"}}],
        container={"securityContext": {"privileged": True}},
    )  # fmt: skip
    assert "created" in _create(cp, mighty, user=POWER_USER)
    # An update that leaves the templates alone is not checked again (the operator's annotations,
    # kubectl scale).
    out = cp.kubectl(
        "patch", "ej", "mighty", "-n", authors, "--as", AUTHOR, "--type=merge",
        "-p", '{"metadata": {"annotations": {"note": "x"}}}', check=False,
    )  # fmt: skip
    assert "patched" in out, out
    out = cp.kubectl(
        "patch", "ej", "plain", "-n", authors, "--as", AUTHOR, "--type=json",
        "-p", '[{"op": "add", "path": "/spec/template/spec/hostPID", "value": true}]', check=False,
    )  # fmt: skip
    assert "hostPID would share the node" in out, "an edited template is checked again"


def test_a_job_that_will_be_suspended_with_nowhere_to_keep_its_progress_is_warned_not_refused(
    control_plane: ControlPlane, authors: str
) -> None:
    """The advice policy: kubectl prints a Warning for a job created suspended or queued by Kueue without
    spec.checkpoint.storagePath, and the job is created all the same; nothing for one that keeps its progress
    or that nothing suspends."""
    # kubectl: "Warning: Validation failed for ValidatingAdmissionPolicy 'phalanx-elasticjob-advice' with
    # binding 'phalanx-elasticjob-advice': spec.checkpoint.storagePath is empty: ..."
    cp, warning = control_plane, "'phalanx-elasticjob-advice': spec.checkpoint.storagePath is empty: this job"
    suspended = _job("queued-suspended", authors)
    suspended["spec"]["suspend"] = True
    queued = _job("queued-kueue", authors)
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}

    def warned() -> str:
        """kubectl's output when the job was created with the warning; "" (the job deleted) without."""
        out = _create(cp, suspended, user=AUTHOR)
        if warning in out:
            return out
        cp.kubectl("delete", "ej", "queued-suspended", "-n", authors, "--wait=false", check=False)
        return ""

    # The advice's binding takes a moment to reach the API server's admission plugin, as the policy's did.
    out = eventually(warned, timeout=30, what="the advice taking effect")
    assert "created" in out, out
    out = _create(cp, queued, user=AUTHOR)
    assert warning in out, out
    assert "created" in out, out
    keeps = _job("queued-keeps", authors)
    keeps["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    keeps["spec"]["checkpoint"] = {"storagePath": "s3://bucket/queued"}
    out = _create(cp, keeps, user=AUTHOR)
    assert "created" in out, out
    assert "Warning" not in out, out
    out = _create(cp, _job("never-suspended", authors), user=AUTHOR)
    assert "created" in out, out
    assert "Warning" not in out, out


OPERATOR = "system:serviceaccount:phalanx-system:phalanx-operator"


def _pod(
    name: str, namespace: str, *, labels: dict[str, str], owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"], "controller": True}
        ]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "t", "image": "x"}]},
    }


def test_only_the_operator_gives_a_pod_a_jobs_label_or_ownership(
    control_plane: ControlPlane, authors: str
) -> None:
    """The job Pods' policy: bob may create and patch Pods in the namespace, and still may not make one a
    member of a job (its label, which the job's NetworkPolicies let in, or the job as its owner, which the
    operator takes for its own), on create or by a patch; the operator's service account, with the rights
    deploy/operator-rbac.yaml gives it, may. Plain Pods and taking a mark off are never checked."""
    cp, ns = control_plane, authors
    cp.kubectl("apply", "-f", str(ROOT / "deploy" / "operator-rbac.yaml"))
    assert "created" in _create(cp, _job("members", ns))
    job = json.loads(cp.kubectl("get", "elasticjob", "members", "-n", ns, "-o", "json"))
    refusal = "is one of that job's own Pods, which only the phalanx operator creates"

    def refused_labelled() -> str:
        out = _create(cp, _pod("posing", ns, labels={"phalanx.dev/job": "members"}), user=POWER_USER)
        if refusal in out:
            return out
        cp.kubectl("delete", "pod", "posing", "-n", ns, "--wait=false", check=False)
        return ""

    # The binding takes a moment to reach the API server's admission plugin.
    out = eventually(refused_labelled, timeout=30, what="the job Pods' policy taking effect")
    assert f"{POWER_USER} may not update elasticjobs/status in {ns}" in out, out
    owned = _pod("adopting", ns, labels={"team": "a"}, owner=job)
    assert refusal in _create(cp, owned, user=POWER_USER)
    # A plain Pod is admitted; giving it the label or the job as owner afterwards is refused.
    assert "created" in _create(cp, _pod("plain", ns, labels={"team": "a"}), user=POWER_USER)
    patch = json.dumps({"metadata": {"labels": {"phalanx.dev/job": "members"}}})
    assert refusal in cp.kubectl(
        "patch", "pod", "plain", "-n", ns, "--as", POWER_USER, "-p", patch, check=False
    )
    refs = json.dumps({"metadata": {"ownerReferences": owned["metadata"]["ownerReferences"]}})
    assert refusal in cp.kubectl(
        "patch", "pod", "plain", "-n", ns, "--as", POWER_USER, "-p", refs, check=False
    )
    # The operator may do both; anyone may take the marks off again, and change what is not a mark.
    member = _pod("member", ns, labels={"phalanx.dev/job": "members", "team": "a"}, owner=job)
    assert "created" in _create(cp, member, user=OPERATOR)
    untouched = json.dumps({"metadata": {"labels": {"team": "b"}}})
    assert "patched" in cp.kubectl("patch", "pod", "member", "-n", ns, "--as", POWER_USER, "-p", untouched)
    off = json.dumps({"metadata": {"labels": {"phalanx.dev/job": None}, "ownerReferences": []}})
    assert "patched" in cp.kubectl("patch", "pod", "member", "-n", ns, "--as", POWER_USER, "-p", off)
    assert refusal in cp.kubectl(
        "patch", "pod", "member", "-n", ns, "--as", POWER_USER, "-p", patch, check=False
    )
    cp.kubectl("delete", "pod", "plain", "member", "-n", ns, "--wait=false")
    cp.kubectl("delete", "ej", "members", "-n", ns, "--wait=false")


def test_an_oversized_job_is_refused_at_admission(control_plane: ControlPlane) -> None:
    job = _job("huge", "default")
    job["spec"]["nodes"] = {"min": 1, "max": 2147483647}
    out = _create(control_plane, job)
    assert "created" not in out
    assert (
        "spec.nodes.max: Invalid value: 2147483647: spec.nodes.max in body should be less than or equal "
        f"to {MAX_NODES}" in out
    ), out


# ------------------------------------------------------------------------------------------------------
# The cluster: cordoning, bounds, Secrets, foreign objects (the test kubelet's simulated nodes: Pods run
# there without a process, so these jobs cost the machine nothing)


def _sim_job(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    job = _job(name, namespace, **copy.deepcopy(SIMULATED))
    job["spec"]["master"] = {"template": {"spec": copy.deepcopy(SIMULATED)}}
    job["spec"].update(spec)
    return job


@pytest.fixture(scope="module")
def trust_ns(cluster: Cluster) -> Iterator[str]:
    ns = "trust"
    cluster.cp.kubectl("create", "namespace", ns)
    yield ns
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def _pods(cluster: Cluster, ns: str, job: str, role: str = "") -> list[dict[str, Any]]:
    selector = f"phalanx.dev/job={job}" + (f",phalanx.dev/role={role}" if role else "")
    return list(cluster.get_json("pods", "-n", ns, "-l", selector)["items"])


def _running(cluster: Cluster, ns: str, job: str) -> list[dict[str, Any]]:
    return [p for p in _pods(cluster, ns, job, "worker") if p["status"].get("phase") == "Running"]


def _node(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(cluster.get_json("node", name))


def _cordoned(node: dict[str, Any]) -> bool:
    taints = node["spec"].get("taints") or []
    return bool(node["spec"].get("unschedulable")) or any(t["key"] == "phalanx.dev/bad-node" for t in taints)


def test_a_fake_machine_name_is_never_cordoned(cluster: Cluster, trust_ns: str) -> None:
    """A training script holds the job token and can register a node under any name, so the master's
    eviction request may name any cluster node as its machine. The operator (with both switches on: the
    operator's cordon_nodes and the job's cordonBadNodes, and the RBAC of deploy/operator-rbac-cordon.yaml)
    cordons the spec.nodeName of the evicted Pod it owns, never the machine the request names.

    The eviction request is handed to the pass as the master writes it; written into the API it would be
    carried out first by the cluster's own operator, whose cordon_nodes is off."""
    cp, ns = cluster.cp, trust_ns
    cp.kubectl("apply", "-f", str(CORDON_RBAC))
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("cordon", ns, cordonBadNodes=True)))
    victim, decoy = "sim-1", "sim-2"
    try:
        cluster.wait_for(
            "the worker Pod on a simulated node",
            lambda: _running(cluster, ns, "cordon"),
            timeout=60,
        )  # fmt: skip
        (worker,) = _pods(cluster, ns, "cordon", "worker")
        victim = worker["spec"]["nodeName"]
        decoy = next(n for n in ("node-a", "sim-0", "sim-1", "sim-2", "sim-3") if n != victim)
        api = k8s_config.new_client_from_config(str(cluster.operator_kubeconfig))
        executor = Executor(api=api, settings=OperatorSettings(cordon_nodes=True))
        observed = executor.observe(namespace=ns, name="cordon")
        assert observed is not None
        status = observed.job.setdefault("status", {})
        status["evictions"] = [
            {"nodeId": worker["metadata"]["name"], "machine": decoy, "reason": "no heartbeat for 10s"}
        ]
        actions = reconcile(observed, now=time.time(), settings=executor.settings, new_token="t" * 32)
        executor.apply(observed.job, actions)
        assert not _cordoned(_node(cluster, decoy)), f"{decoy}, named by the job, was cordoned"
        assert _cordoned(_node(cluster, victim)), "the evicted Pod's own node is cordoned (the switch works)"
        assert _node(cluster, victim)["spec"]["unschedulable"] is True
    finally:
        for node in {victim, decoy}:
            cp.kubectl("uncordon", node, check=False)
            cp.kubectl("taint", "nodes", node, "phalanx.dev/bad-node-", check=False)


def _condition(cluster: Cluster, ns: str, job: str, kind: str) -> dict[str, Any] | None:
    status = cluster.get_json("ej", job, "-n", ns).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), None)


def _stripped_of_bounds(node: Any) -> Any:
    """The CRD as it was before it had bounds: no `maximum`, no rule bounding a duration or a size."""
    if isinstance(node, dict):
        return {
            k: _stripped_of_bounds(v) for k, v in node.items()
            if k != "maximum" and not (k == "x-kubernetes-validations" and not v)
        }  # fmt: skip
    if isinstance(node, list):
        return [
            _stripped_of_bounds(v) for v in node
            if not (isinstance(v, dict) and "must be at most" in str(v.get("message", "")))
        ]  # fmt: skip
    return node


def _untyped_template(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD as it was before its Pod templates were typed: the worker template's spec kept unchecked."""
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["template"]["properties"]["spec"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True, "required": ["containers"],
        "properties": {"containers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "properties": {"resources": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                         "properties": {"limits": {"type": "object", "additionalProperties": {
                                             "x-kubernetes-int-or-string": True,
                                             "anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
        }}},
    }  # fmt: skip
    return crd


def test_a_job_past_the_bounds_or_breaking_a_pass_fails_alone(cluster: Cluster, trust_ns: str) -> None:
    """nodes.max 6000 slipped past admission and a template that breaks the pass building the worker Pod
    (volumeMounts: 5), both created under the CRD as it was before its bounds and its typed templates: each
    is refused or recorded on its own job, while a job created after them runs."""
    cp, ns = cluster.cp, trust_ns
    crd_file = Path(cp.state_dir) / "crd-without-bounds.yaml"
    crd_file.write_text(yaml.safe_dump(_untyped_template(_stripped_of_bounds(build_crd()))))
    current = ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_file))
    try:
        huge = _sim_job("huge", ns)
        huge["spec"]["nodes"] = {"min": 1, "max": MAX_NODES + 1000}
        # the API server takes the old schema in a moment
        eventually(lambda: "created" in _create(cp, huge), timeout=30, interval=0.5, what="the old schema")
        broken = _sim_job("broken", ns)
        broken["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = 5
        cp.kubectl("create", "-f", "-", input_text=json.dumps(broken))
    finally:
        cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(current))
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("fine", ns)))

    failed = cluster.wait_for(
        "the oversized job Failed", lambda: _condition(cluster, ns, "huge", "Failed"), timeout=60
    )
    assert failed["reason"] == "InvalidSpec"
    assert f"spec.nodes.max: must be at most {MAX_NODES}, got {MAX_NODES + 1000}" in failed["message"]
    error = cluster.wait_for(
        "the broken job's pass recorded",
        lambda: _condition(cluster, ns, "broken", "ReconcileError"),
        timeout=60,
    )
    assert error["status"] == "True"
    assert "reconciliation pass failed (TypeError)" in error["message"], error
    cluster.wait_for(
        "the fine job's worker Running",
        lambda: _running(cluster, ns, "fine"),
        timeout=60,
    )  # fmt: skip
    assert _pods(cluster, ns, "huge") == [], "nothing was created for the oversized job"


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM): what it needed at its worst, not only now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_huge_template_and_a_forged_pod_leave_the_operator_small_and_other_jobs_running(
    cluster: Cluster, trust_ns: str
) -> None:
    """The two OOM attacks of before: nodes.max 200 with a template of 30,000 tolerations (about 1.1 MB; the
    operator once built a copy per slot in one pass, 1.5 GB at 1.4 MB), and a Pod its author named
    <job>-worker-80000000-0 and gave the job's ownerReference (once a list of 640 MB). The operator's peak
    memory stays far under its 512Mi limit, and a job created after both runs."""
    cp, ns = cluster.cp, trust_ns
    assert cluster.operator is not None
    fat = _sim_job("fat", ns, nodes={"min": 1, "max": 200})
    fat["spec"]["template"]["spec"]["tolerations"] += [
        {"key": f"phalanx.dev/pad-{i}", "operator": "Exists"} for i in range(30_000)
    ]
    cp.kubectl("create", "-f", "-", input_text=json.dumps(fat))
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("forged", ns)))
    cluster.wait_for("the forged job's worker", lambda: _pods(cluster, ns, "forged", "worker"), timeout=60)
    uid = cluster.get_json("elasticjob", "forged", "-n", ns)["metadata"]["uid"]
    forged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "forged-worker-80000000-0",
            "namespace": ns,
            "labels": {"phalanx.dev/job": "forged", "phalanx.dev/role": "worker"},
            "ownerReferences": [
                {"apiVersion": "phalanx.dev/v1alpha1", "kind": "ElasticJob", "name": "forged", "uid": uid}
            ],
        },
        "spec": {**copy.deepcopy(SIMULATED), "containers": [{"name": "t", "image": "x"}]},
    }
    cp.kubectl("create", "-f", "-", input_text=json.dumps(forged))
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("after", ns)))

    failed = cluster.wait_for(
        "the fat job Failed", lambda: _condition(cluster, ns, "fat", "Failed"), timeout=60
    )
    assert failed["reason"] == "InvalidSpec"
    assert re.search(r"spec\.template: is \d+ KiB as JSON, at most 256 KiB", failed["message"]), failed
    cluster.wait_for("the later job's worker Running", lambda: _running(cluster, ns, "after"), timeout=90)
    assert _pods(cluster, ns, "fat", "worker") == [], "no Pod was built from the fat template"
    workers = {p["metadata"]["name"] for p in _pods(cluster, ns, "forged", "worker")}
    # The forged Pod is neither taken as a worker (no slot 80,000,000) nor touched.
    assert workers == {"forged-worker-0-0", "forged-worker-80000000-0"}, workers
    assert cluster.operator.poll() is None, "the operator died"
    peak = _peak_rss_mb(cluster.operator.pid)
    print(f"\noperator peak memory after both attacks: {peak:.0f} MB")
    assert peak < 300, f"the operator peaked at {peak:.0f} MB (limit 512Mi)"
    for job in ("fat", "forged", "after"):
        cp.kubectl("delete", "elasticjob", job, "-n", ns, "--wait=false")


def test_workers_never_hold_the_metrics_token(cluster: Cluster, trust_ns: str) -> None:
    """The cluster's operator has a metrics token (the PodMonitor's credential, good for every master's
    /metrics): it is in <job>-metrics, mounted by the master Pod only; a worker mounts the job token alone."""
    cp, ns = cluster.cp, trust_ns
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("scraped", ns)))

    def by_role() -> dict[str, dict[str, Any]]:
        return {p["metadata"]["labels"]["phalanx.dev/role"]: p for p in _pods(cluster, ns, "scraped")}

    cluster.wait_for("master and worker Pods", lambda: by_role().keys() == {"master", "worker"}, timeout=60)
    pods = by_role()

    def secrets(pod: dict[str, Any]) -> set[str]:
        spec = pod["spec"]
        found = {v["secret"]["secretName"] for v in spec.get("volumes") or [] if "secret" in v}
        for c in spec["containers"]:
            found |= {
                e["valueFrom"]["secretKeyRef"]["name"]
                for e in c.get("env") or []
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            found |= {e["secretRef"]["name"] for e in c.get("envFrom") or [] if "secretRef" in e}
        return found

    assert secrets(pods["worker"]) == {elasticjob.token_secret("scraped")}
    assert secrets(pods["master"]) == {
        elasticjob.token_secret("scraped"),
        elasticjob.metrics_secret("scraped"),
    }
    token = cluster.get_json("secret", elasticjob.token_secret("scraped"), "-n", ns)
    assert set(token["data"]) == {"token"}, "the Secret every worker mounts holds the job token only"
    metrics = cluster.get_json("secret", elasticjob.metrics_secret("scraped"), "-n", ns)
    assert set(metrics["data"]) == {"token"}
    assert metrics["metadata"]["ownerReferences"][0]["kind"] == "ElasticJob"


def test_a_foreign_secret_named_like_the_jobs_token_is_left_untouched(
    cluster: Cluster, trust_ns: str
) -> None:
    """Someone created squat-token before the job squat: the operator neither adopts (its Pods would mount a
    token someone else chose), overwrites nor deletes it; the job says why and starts no Pod."""
    cp, ns = cluster.cp, trust_ns
    cp.kubectl(
        "create",
        "secret",
        "generic",
        elasticjob.token_secret("squat"),
        "-n",
        ns,
        "--from-literal=token=chosen-by-someone-else",
    )
    before = cluster.get_json("secret", elasticjob.token_secret("squat"), "-n", ns)
    cp.kubectl("create", "-f", "-", input_text=json.dumps(_sim_job("squat", ns)))
    created = cluster.wait_for(
        "the job's ForeignObject condition",
        lambda: (c := _condition(cluster, ns, "squat", "Created")) and c["reason"] == "ForeignObject" and c,
        timeout=60,
    )
    assert created["status"] == "False"
    assert f"Secret {ns}/squat-token already exists and is not this job's" in created["message"]
    assert "Delete or rename it" in created["message"]
    time.sleep(2)  # a negative check: a few more passes of the operator, none of which may touch the Secret
    after = cluster.get_json("secret", elasticjob.token_secret("squat"), "-n", ns)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], "overwritten"
    assert after["data"] == before["data"]
    assert "ownerReferences" not in after["metadata"], "adopted"
    assert _pods(cluster, ns, "squat") == []
    events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=squat")["items"]
    assert "ForeignObject" in [e["reason"] for e in events]
