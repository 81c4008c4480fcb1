"""End to end against the real control plane: the example ElasticJob runs to completion, and the job
survives a killed worker, an eviction, a lost master Pod and a restarted operator."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.cluster import METRICS_TOKEN, Cluster
from k8s_harness.controlplane import ControlPlane
from k8s_harness.coscheduling import PERMIT_WAIT_S
from k8s_harness.kubelet import IMAGE_USER
from kubernetes import config as k8s_config

from phalanx.operator.discovery import Discovery, unguarded_pods
from phalanx.operator.gang import GangApi

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elasticjob.yaml"


def _apply_example(cluster: Cluster, namespace: str, *, steps: int = 30, step_s: float = 0.2) -> None:
    cluster.cp.kubectl("create", "namespace", namespace)
    text = EXAMPLE.read_text().replace('value: "30"', f'value: "{steps}"')
    text = text.replace(
        "- name: TINY_STEPS",
        f'- name: TINY_STEP_S\n              value: "{step_s}"\n            - name: TINY_STEPS',
    )
    cluster.cp.kubectl("apply", "-n", namespace, "-f", "-", input_text=text)


def _job(cluster: Cluster, namespace: str, name: str = "tiny") -> dict[str, Any]:
    return cluster.get_json("ej", name, "-n", namespace)


def _phase(cluster: Cluster, namespace: str, name: str = "tiny") -> str:
    return str(_job(cluster, namespace, name).get("status", {}).get("phase", ""))


def _pods(cluster: Cluster, namespace: str, role: str = "worker") -> list[dict[str, Any]]:
    items = cluster.get_json("pods", "-n", namespace, "-l", f"phalanx.dev/role={role}")["items"]
    return list(items)


def _live(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        p for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and p["status"].get("phase") in (None, "Pending", "Running")
    ]  # fmt: skip


def _running_workers(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [p for p in _live(_pods(cluster, namespace)) if p["status"].get("phase") == "Running"]


def _events(cluster: Cluster, namespace: str) -> list[str]:
    items = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.kind=ElasticJob")[
        "items"
    ]
    return [e["reason"] for e in items]


def _read(url: str, token: str) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return str(resp.read().decode())


def _get(url: str, token: str) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_example_runs_to_success(cluster: Cluster) -> None:
    ns = "example"
    _apply_example(cluster, ns, steps=40, step_s=0.1)
    # Beside it, a job another controller manages (spec.managedBy): left alone.
    container = {"name": "t", "image": "x", "command": ["python", "t.py"]}
    foreign = {
        "apiVersion": "phalanx.dev/v1alpha1", "kind": "ElasticJob",
        "metadata": {"name": "foreign", "namespace": ns},
        "spec": {
            "managedBy": "example.com/another-controller", "nodes": {"min": 1, "max": 1},
            "template": {"spec": {"containers": [container]}},
        },
    }  # fmt: skip
    cluster.cp.kubectl("create", "-f", "-", input_text=json.dumps(foreign))
    cluster.wait_for("job Running", lambda: _phase(cluster, ns) in ("Running", "Succeeded"), timeout=90)
    # One Prometheus credential for every job: the operator's metrics token opens the master's /metrics
    # and nothing else.
    (master,) = _pods(cluster, ns, "master")
    http = f"http://{master['status']['podIP']}:8080"
    assert _get(f"{http}/metrics", METRICS_TOKEN) == 200
    assert _get(f"{http}/v1/job", METRICS_TOKEN) == 401
    assert _get(f"{http}/metrics", "not-the-token") == 401
    cluster.wait_for("job Succeeded", lambda: _phase(cluster, ns) == "Succeeded", timeout=120)
    job = _job(cluster, ns)
    status = job["status"]
    assert status["step"] >= 19
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Succeeded"]["status"] == "True"
    assert conditions["Created"]["status"] == "True"
    assert all(c["observedGeneration"] == job["metadata"]["generation"] for c in status["conditions"])
    table = cluster.cp.kubectl("get", "ej", "tiny", "-n", ns)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "NODES", "WORLD", "STEP", "AGE"]
    assert row.split()[:2] == ["tiny", "Succeeded"]
    assert row.split()[3] == "4", table  # world size: 2 nodes x 2 processes
    reasons = _events(cluster, ns)
    for reason in ("Created", "MasterCreated", "WorkerCreated", "Running", "Succeeded"):
        assert reason in reasons, f"missing Event {reason}: {reasons}"
    # Its nodes finish a heartbeat apart: the first one done is a finished node, not a lost one.
    assert "Restarting" not in reasons, reasons
    assert not [c for c in status["conditions"] if c["type"] == "Restarting" and c["status"] == "True"]
    # cleanPodPolicy Running: Pods still running when the job finished are deleted, finished ones stay.
    cluster.wait_for(
        "running Pods cleaned up",
        lambda: not _live(_pods(cluster, ns, "worker") + _pods(cluster, ns, "master")),
        timeout=30,
    )
    assert any(p["status"]["phase"] == "Succeeded" for p in _pods(cluster, ns))
    # The operator's own health and metrics (the chart probes /healthz and scrapes /metrics with the token).
    operator = f"http://{cluster.operator_http}"
    assert _get(f"{operator}/healthz", "") == 200
    assert _get(f"{operator}/metrics", "not-the-token") == 401
    metrics = _read(f"{operator}/metrics", METRICS_TOKEN)
    assert re.search(r'^phalanx_operator_reconcile_passes_total\{result="ok"\} [1-9]', metrics, re.M), metrics
    assert re.search(r'^phalanx_operator_actions_total\{action="Create"\} [1-9]', metrics, re.M), metrics
    assert re.search(r'^phalanx_operator_jobs\{phase="Succeeded"\} [1-9]', metrics, re.M), metrics

    # Many passes later, the other controller's job has no status and not one object from this operator,
    # and its controller cannot be changed.
    assert not _job(cluster, ns, "foreign").get("status")
    made = cluster.cp.kubectl(
        "get", "pods,secrets,services,configmaps", "-n", ns, "-l", "phalanx.dev/job=foreign", "-o", "name"
    )  # fmt: skip
    assert not made.strip(), made
    out = cluster.cp.kubectl(
        "patch", "ej", "foreign", "-n", ns, "--type=merge",
        "-p", '{"spec": {"managedBy": "phalanx.dev/operator"}}', check=False,
    )  # fmt: skip
    assert "managedBy cannot be changed" in out, out

    # Everything the operator made is owned by the job: deleting it garbage-collects the lot.
    cluster.cp.kubectl("delete", "ej", "tiny", "-n", ns, "--wait=false")
    cluster.wait_for(
        "garbage collection of the job's objects",
        lambda: not cluster.cp.kubectl(
            "get", "pods,secrets,services,configmaps,serviceaccounts,roles,rolebindings", "-n", ns,
            "-l", "phalanx.dev/job=tiny", "-o", "name",
        ).strip(),
        timeout=60,
    )  # fmt: skip


def _step(cluster: Cluster, namespace: str) -> int:
    return int(_job(cluster, namespace).get("status", {}).get("step", -1))


def _evict(cluster: Cluster, namespace: str, name: str) -> None:
    """What `kubectl drain` does to each Pod of the node: a POST to the Pod's eviction subresource. The API
    server marks the Pod (DisruptionTarget, EvictionByEvictionAPI) and deletes it with its grace period."""
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    path = f"/api/v1/namespaces/{namespace}/pods/{name}/eviction"
    cluster.cp.kubectl("create", "--raw", path, "-f", "-", input_text=json.dumps(eviction))


def test_killed_worker_is_replaced_and_lost_master_resumes(cluster: Cluster) -> None:
    """A killed worker is a replacement charged to restart.maxEvictions; a drained one (the eviction API) is
    replaced without touching it; a lost master Pod resumes the job from its state."""
    ns = "faults"
    _apply_example(cluster, ns, steps=100, step_s=0.25)
    cluster.wait_for(
        "training progress", lambda: _phase(cluster, ns) == "Running" and _step(cluster, ns) >= 3, timeout=120
    )

    # A worker process dies (SIGKILL of the Pod's process): its Pod fails and is replaced.
    victim = sorted(p["metadata"]["name"] for p in _running_workers(cluster, ns))[0]
    os.kill(cluster.pod_pid(ns, victim), signal.SIGKILL)
    slot = victim.split("-")[-2]
    replacement = f"tiny-worker-{slot}-1"
    cluster.wait_for(
        "replacement Running",
        lambda: any(p["metadata"]["name"] == replacement for p in _running_workers(cluster, ns)),
        timeout=60,
    )
    # The operator patches the status at the end of the pass that created the Pod; under load the kubelet can
    # start the Pod first, so the count is awaited, as any eventually consistent status is.
    cluster.wait_for(
        "replacement counted", lambda: _job(cluster, ns)["status"].get("replacements") == 1, timeout=30
    )
    job = _job(cluster, ns)
    assert job["status"]["replacements"] == 1
    assert "WorkerReplaced" in _events(cluster, ns)
    failed = [p for p in _pods(cluster, ns) if p["metadata"]["name"] == victim]
    assert not failed or failed[0]["status"]["phase"] == "Failed"
    cluster.wait_for(
        "a new rendezvous round with the replacement",
        lambda: int(_job(cluster, ns)["status"].get("round", 0)) >= 2 and _phase(cluster, ns) == "Running",
        timeout=90,
    )

    # The other worker's node is drained: the cluster, not the job, ends that Pod. Its replacement costs the
    # job's eviction budget nothing.
    drained = next(
        p for p in sorted(p["metadata"]["name"] for p in _running_workers(cluster, ns)) if p != replacement
    )
    round_before = int(_job(cluster, ns)["status"]["round"])
    _evict(cluster, ns, drained)
    drained_slot = drained.split("-")[-2]
    cluster.wait_for(
        "the drained worker's replacement Running",
        lambda: any(
            p["metadata"]["name"] == f"tiny-worker-{drained_slot}-1" for p in _running_workers(cluster, ns)
        ),
        timeout=60,
    )
    cluster.wait_for(
        "disruption counted", lambda: _job(cluster, ns)["status"].get("disruptions") == 1, timeout=30
    )
    assert _job(cluster, ns)["status"]["replacements"] == 1, (
        "the drain is not charged to restart.maxEvictions"
    )
    assert "WorkerDisrupted" in _events(cluster, ns)
    cluster.wait_for(
        "a new rendezvous round after the drain",
        lambda: (
            int(_job(cluster, ns)["status"].get("round", 0)) > round_before
            and _phase(cluster, ns) == "Running"
        ),
        timeout=90,
    )

    # The master Pod is deleted: a new master Pod (same name, state from the ConfigMap) resumes the job.
    old_uid = _pods(cluster, ns, "master")[0]["metadata"]["uid"]
    round_before = int(_job(cluster, ns)["status"].get("round", 0))
    cluster.cp.kubectl("delete", "pod", "tiny-master", "-n", ns, "--wait=false")
    cluster.wait_for(
        "a new master Pod",
        lambda: any(
            p["metadata"]["uid"] != old_uid and p["status"].get("phase") == "Running"
            for p in _pods(cluster, ns, "master")
        ),
        timeout=60,
    )
    assert "MasterRecreated" in _events(cluster, ns)
    state = cluster.get_json("configmap", "tiny-master-state", "-n", ns)["data"]["state.json"]
    assert json.loads(state)["job_id"] == "tiny", "the master keeps its durable state in the job's ConfigMap"
    cluster.wait_for(
        "job Succeeded after the master restart", lambda: _phase(cluster, ns) == "Succeeded", timeout=150
    )
    assert int(_job(cluster, ns)["status"]["round"]) >= round_before, (
        "the new master resumed, not restarted, the job"
    )


def test_eviction_requested_by_master_moves_the_node(cluster: Cluster) -> None:
    ns = "evict"
    _apply_example(cluster, ns, steps=400, step_s=0.1)
    cluster.wait_for(
        "training progress", lambda: _phase(cluster, ns) == "Running" and _step(cluster, ns) >= 2, timeout=120
    )
    victim = sorted(_running_workers(cluster, ns), key=lambda p: p["metadata"]["name"])[0]
    name, machine = victim["metadata"]["name"], victim["spec"]["nodeName"]
    # The node hangs (SIGSTOP): the master misses its heartbeats and writes an eviction into the status.
    pid = cluster.pod_pid(ns, name)
    os.kill(pid, signal.SIGSTOP)
    try:
        evictions = cluster.wait_for(
            "the master's eviction request", lambda: _job(cluster, ns)["status"].get("evictions"), timeout=60
        )
        assert evictions[0]["nodeId"] == name
        assert evictions[0]["machine"] == machine
        slot = name.split("-")[-2]
        replacement = cluster.wait_for(
            "replacement scheduled",
            lambda: [
                p for p in _live(_pods(cluster, ns))
                if p["metadata"]["name"].startswith(f"tiny-worker-{slot}-") and p["metadata"]["name"] != name
                and p["spec"].get("nodeName")
            ],
            timeout=60,
        )  # fmt: skip
        assert replacement[0]["spec"]["nodeName"] != machine, "the replacement must avoid the evicted machine"
        terms = replacement[0]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [machine]} in terms[
            "nodeSelectorTerms"
        ][0]["matchExpressions"]
        cluster.wait_for(
            "evicted Pod deleted",
            lambda: name not in [p["metadata"]["name"] for p in _pods(cluster, ns)],
            timeout=60,
        )
        assert "Evicted" in _events(cluster, ns)
        cluster.wait_for(
            "training resumed",
            lambda: _phase(cluster, ns) == "Running" and len(_running_workers(cluster, ns)) == 2,
            timeout=90,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def test_operator_restart_creates_no_duplicates(cluster: Cluster) -> None:
    ns = "restart"
    _apply_example(cluster, ns, steps=50, step_s=0.2)
    cluster.wait_for("workers created", lambda: len(_pods(cluster, ns)) == 2, timeout=60)
    cluster.kill_operator()  # SIGKILL mid-job: no chance to clean up
    cluster.wait_for("training progress", lambda: _step(cluster, ns) >= 2, timeout=120)
    cluster.start_operator()
    seen: set[str] = set()

    def succeeded() -> bool:
        """Whether the job succeeded; meanwhile collects every Pod it ever had, one master at a time."""
        seen.update(p["metadata"]["name"] for p in _pods(cluster, ns))
        assert len(_pods(cluster, ns, "master")) == 1
        return _phase(cluster, ns) == "Succeeded"

    cluster.wait_for("the job succeeding after the operator's restart", succeeded, timeout=150, interval=1)
    assert seen == {"tiny-worker-0-0", "tiny-worker-1-0"}, f"the restarted operator created Pods: {seen}"
    assert int(_job(cluster, ns)["status"].get("replacements", 0)) == 0


def test_200_workers_on_simulated_nodes(cluster: Cluster) -> None:
    ns = "scale"
    cluster.cp.kubectl("create", "namespace", ns)
    job = {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "big", "namespace": ns},
        "spec": {
            "nodes": {"min": 1, "max": 200},
            "template": {
                "spec": {
                    "nodeSelector": {"phalanx.dev/test-kubelet": "simulated"},
                    "tolerations": [
                        {"key": "phalanx.dev/simulated", "operator": "Exists", "effect": "NoSchedule"}
                    ],
                    "containers": [{"name": "trainer", "image": "x", "command": ["python", "train.py"]}],
                }
            },
        },
    }
    start = time.monotonic()
    cluster.cp.kubectl("create", "-f", "-", input_text=json.dumps(job))
    cluster.wait_for("200 worker Pods", lambda: len(_pods(cluster, ns)) >= 200, timeout=60, interval=1)
    created_s = time.monotonic() - start
    cluster.wait_for(
        "200 worker Pods Running on simulated nodes",
        lambda: sum(p["status"].get("phase") == "Running" for p in _pods(cluster, ns)) >= 200,
        timeout=120,
        interval=2,
    )
    running_s = time.monotonic() - start
    print(f"\nscale: 200 worker Pods created in {created_s:.1f}s, all Running in {running_s:.1f}s")
    (Path(cluster.cp.state_dir).parent / "phalanx-k8s-scale.json").write_text(
        json.dumps({"workers": 200, "created_s": round(created_s, 1), "running_s": round(running_s, 1)})
    )
    names = {p["metadata"]["name"] for p in _pods(cluster, ns)}
    assert names == {f"big-worker-{i}-0" for i in range(200)}
    assert created_s < 60
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


FAILING = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: failing
data:
  train.py: |
    import sys
    print("loading data", flush=True)
    raise ValueError("bad batch at step 3")
---
apiVersion: phalanx.dev/v1alpha1
kind: ElasticJob
metadata:
  name: failing
spec:
  nodes: {min: 1, max: 1}
  restart: {maxRestarts: 1}
  ttlAfterFinished: 10s
  template:
    spec:
      containers:
        - name: trainer
          image: x
          command: [python, /opt/failing/train.py]
          volumeMounts: [{name: script, mountPath: /opt/failing}]
      volumes: [{name: script, configMap: {name: failing}}]
"""


def test_failed_job_reports_the_root_cause(cluster: Cluster) -> None:
    ns = "failing"
    cluster.cp.kubectl("create", "namespace", ns)
    cluster.cp.kubectl("apply", "-n", ns, "-f", "-", input_text=FAILING)
    cluster.wait_for("job Failed", lambda: _phase(cluster, ns, "failing") == "Failed", timeout=90)
    job = _job(cluster, ns, "failing")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True"
    assert failed["reason"] == "MasterReportedFailure"
    assert "ValueError" in failed["message"], failed["message"]
    assert "Failed" in _events(cluster, ns)
    # ttlAfterFinished: the operator deletes the finished job, and with it everything it owns.
    cluster.wait_for(
        "the finished job deleted after its TTL",
        lambda: not cluster.cp.kubectl(
            "get", "ej,pods,secrets,configmaps", "-n", ns, "-l", "phalanx.dev/job=failing", "-o", "name"
        ).strip() and "failing" not in cluster.cp.kubectl("get", "ej", "-n", ns, "-o", "name"),
        timeout=60,
    )  # fmt: skip
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def test_kubectl_scale_scales_the_job(cluster: Cluster) -> None:
    ns = "scaling"
    cluster.cp.kubectl("create", "namespace", ns)
    text = EXAMPLE.read_text().replace('value: "30"', 'value: "2000"')
    text = text.replace("min: 2\n    max: 2", "min: 1\n    max: 2").replace(
        "nprocPerNode: 2", "nprocPerNode: 1"
    )
    cluster.cp.kubectl("apply", "-n", ns, "-f", "-", input_text=text)
    cluster.wait_for(
        "2 nodes training",
        lambda: (
            _job(cluster, ns).get("status", {}).get("worldSize") == 2 and _phase(cluster, ns) == "Running"
        ),
        timeout=120,
    )
    master_uid = _pods(cluster, ns, "master")[0]["metadata"]["uid"]
    # The scale subresource (kubectl scale, autoscalers): replicas are nodes.max, the running worker Pods.
    scale = cluster.get_json("ej", "tiny", "-n", ns, "--subresource=scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (2, 2)
    assert scale["status"]["selector"] == "phalanx.dev/job=tiny,phalanx.dev/role=worker"
    out = cluster.cp.kubectl("scale", "ej", "tiny", "-n", ns, "--replicas=0", check=False)
    assert "nodes.min must not be greater than nodes.max" in out, out
    cluster.cp.kubectl("scale", "ej", "tiny", "-n", ns, "--replicas=1")
    cluster.wait_for("slot 1 removed", lambda: len(_live(_pods(cluster, ns))) == 1, timeout=60)
    # A pass records its Events after its actions: a loaded machine shows the Pod gone before the Event.
    cluster.wait_for(
        "the ScaledDown and MasterReconfigured Events",
        lambda: {"ScaledDown", "MasterReconfigured"} <= set(_events(cluster, ns)),
        timeout=30,
    )
    cluster.wait_for(
        "the master restarted with the new range",
        lambda: [
            p for p in _pods(cluster, ns, "master")
            if p["metadata"]["uid"] != master_uid
            and p["metadata"]["annotations"]["phalanx.dev/nodes"] == "1:1"
        ],
        timeout=60,
    )  # fmt: skip
    cluster.wait_for(
        "training on 1 node",
        lambda: _job(cluster, ns)["status"].get("worldSize") == 1 and _phase(cluster, ns) == "Running",
        timeout=90,
    )
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


SHARED = "/var/run/phalanx-test/shared"
"""Where a job's Pods mount the test's shared directory (a hostPath volume, as a real job mounts a volume)."""


def _suspendable_job(shared: Path, *, storage: str, s3: dict[str, str]) -> dict[str, Any]:
    """2 nodes x 1 process of examples/ddp_mlp.py saving every step to shared memory, persisting only at
    step 0 on its own: whatever newer step is on storage after a suspension, the agents persisted. The step
    log is in ``shared``, a host directory the image's user may write, mounted at SHARED; checkpoints go to
    ``storage`` (an S3 URL), with ``s3``'s AWS_* variables (the credentials from the Secret ``s3``)."""
    shared.mkdir()
    os.chown(shared, *IMAGE_USER)
    secret = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    env = [{"name": k, "value": v} for k, v in s3.items() if k not in secret] + [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": "s3", "key": k}}} for k in sorted(secret)
    ]
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "pausable"},
        "spec": {
            "nodes": {"min": 2, "max": 2},
            "heartbeat": {"interval": "1s", "timeout": "6s"},
            "restart": {"gracePeriod": "3s", "maxEvictions": 0},
            "checkpoint": {"storagePath": storage},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "x",
                            "command": [
                                "python", str(ROOT / "examples" / "ddp_mlp.py"), "--flash",
                                "--persist-every", "100000", "--steps", "90", "--step-time", "0.1",
                                "--step-log", f"{SHARED}/steps.jsonl",
                            ],
                            "env": env,
                            "volumeMounts": [{"name": "shared", "mountPath": SHARED}],
                        }
                    ],
                    "volumes": [{"name": "shared", "hostPath": {"path": str(shared)}}],
                }
            },
        },
    }  # fmt: skip


def _unless_failed(cluster: Cluster, namespace: str, name: str) -> bool:
    """False while the job is not Failed; fails the test with the job's reason once it is."""
    status = _job(cluster, namespace, name).get("status", {})
    failed = [c for c in status.get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
    assert not failed, f"job {name} failed: {failed[0]['message']}"
    return False


def _logged_steps(step_log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(360)
def test_suspended_job_frees_its_workers_and_resumes_from_the_step_they_persisted(
    cluster: Cluster, tmp_path: Path, minio: str
) -> None:
    """The agents persist to an S3 bucket (MinIO) when their Pods are deleted, and the resumed Pods, on new
    nodes' memory, load from it."""
    from phalanx.checkpoint import storage as storage_lib

    ns, shared = "pausing", tmp_path / "shared"
    step_log, storage = shared / "steps.jsonl", "s3://pausing/ckpt"
    storage_lib.S3Storage("pausing").client.create_bucket(Bucket="pausing")
    s3 = {
        k: os.environ[k]
        for k in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    cluster.cp.kubectl("create", "namespace", ns)
    keys = [f"--from-literal={k}={s3[k]}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    cluster.cp.kubectl("create", "secret", "generic", "s3", "-n", ns, *keys)
    job = _suspendable_job(shared, storage=storage, s3=s3)
    cluster.cp.kubectl("create", "-n", ns, "-f", "-", input_text=json.dumps(job))
    cluster.wait_for(
        "training progress",
        lambda: _phase(cluster, ns, "pausable") == "Running" and step_log.exists() and
        _logged_steps(step_log)[-1]["step"] >= 8,
        timeout=120,
    )  # fmt: skip
    master_uid = _pods(cluster, ns, "master")[0]["metadata"]["uid"]

    asked = time.monotonic()
    cluster.cp.kubectl("patch", "ej", "pausable", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    cluster.wait_for("job Suspended", lambda: _phase(cluster, ns, "pausable") == "Suspended", timeout=90)
    suspend_s = time.monotonic() - asked
    assert _pods(cluster, ns) == [], "a suspended job keeps no worker Pod"
    (master,) = _pods(cluster, ns, "master")
    assert master["metadata"]["uid"] == master_uid, "the master Pod stays through a suspension"
    job = _job(cluster, ns, "pausable")
    assert job["status"]["master"]["phase"] == "Suspended"
    assert job["status"].get("replacements", 0) == 0
    assert job["status"].get("evictions", []) == [], "deleted Pods must not count as lost nodes"
    reached = _logged_steps(step_log)[-1]["step"]
    committed = storage_lib.committed_steps(storage_lib.open_storage(storage))
    # Every step was in shared memory; on SIGTERM the agents agreed on and persisted the newest.
    assert max(committed) >= reached - 1, (committed, reached)
    for reason in ("Suspending", "Suspended"):
        assert reason in _events(cluster, ns), _events(cluster, ns)

    resumed_at = time.time()
    cluster.cp.kubectl(
        "patch", "ej", "pausable", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    cluster.wait_for(
        "training resumed",
        lambda: (
            any(s["time"] > resumed_at for s in _logged_steps(step_log))
            or _unless_failed(cluster, ns, "pausable")
        ),
        timeout=120,
    )
    first = min(s["time"] for s in _logged_steps(step_log) if s["time"] > resumed_at)
    print(f"\nsuspend: asked to Suspended {suspend_s:.1f}s; resumed: first step {first - resumed_at:.1f}s")
    cluster.wait_for("job Succeeded", lambda: _phase(cluster, ns, "pausable") == "Succeeded", timeout=150)
    after = [s for s in _logged_steps(step_log) if s["time"] > resumed_at]
    assert after[0]["step"] == max(committed) + 1, "the resumed job starts after the step it persisted"
    assert after[-1]["step"] == 89
    job = _job(cluster, ns, "pausable")
    assert job["status"].get("replacements", 0) == 0
    assert job["status"].get("evictions", []) == []
    assert "Resumed" in _events(cluster, ns)
    names = {p["metadata"]["name"] for p in _pods(cluster, ns)}
    assert names <= {"pausable-worker-0-1", "pausable-worker-1-1"}, names
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def _condition(cluster: Cluster, namespace: str, kind: str, name: str = "tiny") -> dict[str, Any]:
    conditions = _job(cluster, namespace, name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheduler", ["kubernetes", "coscheduling"])
def test_a_gang_is_placed_all_at_once_or_not_at_all(
    cluster: Cluster, scheduler: str, request: pytest.FixtureRequest
) -> None:
    """spec.gangScheduling through a real scheduler (kube-scheduler's GangScheduling plugin, or scheduler-
    plugins' Coscheduling as a second scheduler): 3 worker Pods of 30 CPUs each, with a 40-CPU Pod on one of
    the two 64-CPU process nodes, do not all fit. Without a gang two would be bound and sit idle; with one,
    none is bound and the job says why. Once the blocker is gone the three are placed together and the job
    succeeds."""
    if scheduler == "coscheduling":
        request.getfixturevalue("coscheduling")
    ns = f"gang-{scheduler}"
    cluster.cp.kubectl("create", "namespace", ns)
    blocker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "blocker", "namespace": ns},
        "spec": {
            "nodeName": "node-a",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "c",
                    "image": "x",
                    "command": ["sleep", "600"],
                    "resources": {"requests": {"cpu": 40}},
                },
            ],
        },
    }
    cluster.cp.kubectl("apply", "-f", "-", input_text=json.dumps(blocker))
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    for doc in docs:
        if doc["kind"] == "ElasticJob":
            gang = {"enabled": True, "scheduler": scheduler}
            doc["spec"].update(nodes={"min": 3, "max": 3}, nprocPerNode=1, gangScheduling=gang)
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["resources"] = {"requests": {"cpu": "30"}}
            container["env"] = [
                {"name": "TINY_STEPS", "value": "20"},
                {"name": "TINY_STEP_S", "value": "0.1"},
            ]
    cluster.cp.kubectl("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all(docs))

    unschedulable = cluster.wait_for(
        "the gang judged unschedulable",
        lambda: (
            _condition(cluster, ns, "GangScheduled").get("status") == "False"
            and _condition(cluster, ns, "GangScheduled")
        ),
        timeout=90,
    )
    assert unschedulable["reason"] == "Unschedulable"
    message = unschedulable["message"]
    assert message.startswith("the scheduler cannot place 3 worker Pods at once"), message
    workers = _pods(cluster, ns)
    assert len(workers) == 3
    assert [w["spec"].get("nodeName") for w in workers] == [None] * 3, "no worker of a gang that does not fit"
    if scheduler == "kubernetes":
        assert all(w["spec"]["schedulingGroup"] == {"podGroupName": "tiny-workers"} for w in workers)
        group = cluster.get_json("podgroup", "tiny-workers", "-n", ns)
        assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}
    else:
        assert all(
            w["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-workers" for w in workers
        )
        assert {w["spec"]["schedulerName"] for w in workers} == {"scheduler-plugins-scheduler"}
        got = cluster.cp.kubectl(
            "get", "podgroups.scheduling.x-k8s.io", "tiny-workers", "-n", ns, "-o", "json"
        )
        group = json.loads(got)
        assert group["spec"]["minMember"] == 3
        time.sleep(2 * PERMIT_WAIT_S)  # past the plugin's hold of the Pods it placed: still none bound
        assert [w["spec"].get("nodeName") for w in _pods(cluster, ns)] == [None] * 3
    (master,) = _pods(cluster, ns, "master")
    assert master["status"]["phase"] == "Running", "the master is no member of the gang"
    assert "GangUnschedulable" in _events(cluster, ns)

    freed = time.monotonic()
    cluster.cp.kubectl("delete", "pod", "blocker", "-n", ns)
    cluster.wait_for(
        "all three placed", lambda: all(w["spec"].get("nodeName") for w in _pods(cluster, ns)), timeout=90
    )
    placed_s = time.monotonic() - freed
    cluster.wait_for(
        "job Succeeded",
        lambda: _phase(cluster, ns) == "Succeeded" or _unless_failed(cluster, ns, "tiny"),
        timeout=150,
    )
    print(f"\ngang ({scheduler}): blocker deleted -> all 3 workers bound in {placed_s:.1f}s")
    assert _condition(cluster, ns, "GangScheduled")["status"] == "True"
    assert "GangScheduled" in _events(cluster, ns)
    status = _job(cluster, ns)["status"]
    assert status.get("replacements", 0) == 0
    assert status["worldSize"] == 3
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def test_the_operator_finds_its_admission_policy_with_its_own_rights(cluster: Cluster) -> None:
    """With deploy/operator-rbac.yaml's rights alone, the operator reads its admission policies and their
    bindings (installed with the CRD); a policy of another name reads as missing (its rights name only its
    own), and the operator then refuses privileged templates (tests/operator: AdmissionPolicyMissing), or,
    for the job Pods' policy, says in its log what is open."""
    api = k8s_config.new_client_from_config(str(cluster.operator_kubeconfig))
    assert Discovery(api).admission_policy_found("phalanx-elasticjob-templates")
    assert Discovery(api).admission_policy_found("phalanx-elasticjob-pods")
    assert not Discovery(api).admission_policy_found("someone-elses-policy")
    assert Discovery(api).admission_policy_found(""), "no policy named: nothing to check"
    assert unguarded_pods(Discovery(api), "phalanx-elasticjob-pods") is None
    warning = unguarded_pods(Discovery(api), "someone-elses-policy")
    assert warning is not None
    assert "cannot find the admission policy someone-elses-policy" in warning
    assert "can give one the job's label and ownerReference" in warning
    log = (cluster.cp.state_dir / "operator.log").read_text()
    assert "phalanx-elasticjob-pods" not in log, (
        "the operator found the job Pods' policy when it began to lead"
    )


def test_the_operator_discovers_whether_the_cluster_serves_pod_groups(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API discovery against the real kube-apiserver: this one serves scheduling.k8s.io/v1beta1 PodGroups
    (GenericWorkload on); an API version it does not serve reads as absent, which fails a gang job with
    GangSchedulingUnavailable instead of placing its Pods one by one."""
    api = k8s_config.new_client_from_config(str(control_plane.kubeconfig))
    assert Discovery(api).serves_pod_groups()
    assert not Discovery(api).serves_pod_groups(GangApi("scheduling.k8s.io", "v1alpha9"))
