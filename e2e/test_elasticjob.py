"""The ElasticJob scenarios a user of any cluster relies on, through kubectl alone (and, for a lost node, the
cluster's own way of losing one), each in a namespace that enforces the ``restricted`` Pod Security level:

* the example, as written (its image included), trains to success;
* a worker process SIGKILLed inside its container is recovered from the node's memory with no step lost,
  with a flash checkpoint larger than a container's default 64 MiB ``/dev/shm``;
* a node lost (its kubelet, runtime and containers killed at once): the job goes on and the replacement
  Pod lands on a node that is still there;
* a worker Pod deleted mid-run is replaced and the job still succeeds;
* a suspended job frees its worker Pods, keeps its master and resumes from the step it persisted;
* workers that cannot start (no such image, a missing Secret, no node with the resource) are named with
  their cause in the job's PodsReady condition and Events;
* an invalid spec is refused at admission with the message that says what to fix.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import RELEASE_NAMESPACE, STUCK_POD_TIMEOUT_S, Target
from e2e.faults import KILL_ONE_RANK

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(480)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elasticjob.yaml"
LOADED = re.compile(r"flash: loaded step (\d+) from (\w+)")


def example_documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def _apply_example(
    t: Target,
    ns: str,
    *,
    steps: int,
    step_s: float,
    state_mb: int = 0,
    storage_claim: str = "",
    master_on: str = "",
    workers_on: str = "",
) -> None:
    """The example with its knobs turned through the container's environment (steps, step time, state size)
    and, for a job that persists, a shared volume for its checkpoint storage. ``master_on``: the master Pod
    is placed on that node and the workers one per node, as on a GPU cluster. ``workers_on``: every worker on
    that node."""
    docs = example_documents()
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    knobs = {"TINY_STEPS": steps, "TINY_STEP_S": step_s, "TINY_STATE_MB": state_mb}
    env = [e for e in container.get("env", []) if e["name"] not in knobs]
    container["env"] = env + [{"name": k, "value": str(v)} for k, v in knobs.items()]
    if storage_claim:
        spec = job["spec"]
        spec.setdefault("checkpoint", {})["storagePath"] = "/ckpt"
        container.setdefault("volumeMounts", []).append({"name": "ckpt", "mountPath": "/ckpt"})
        spec["template"]["spec"].setdefault("volumes", []).append(
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": storage_claim}}
        )
    if master_on:
        job["spec"]["master"] = {
            "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": master_on}}}
        }
        job["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"phalanx.dev/role": "worker"}},
                "nodeTaintsPolicy": "Honor",  # a lost node (tainted unreachable) is no place to spread to
            }
        ]
    if workers_on:
        job["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": workers_on}
    t.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all(docs))


def _status(t: Target, ns: str, name: str = "tiny") -> dict[str, Any]:
    return dict(t.kube.get("ej", name, "-n", ns).get("status", {}))


def _succeeded(t: Target, ns: str, *, timeout: float) -> dict[str, Any]:
    def done() -> bool:
        status = _status(t, ns)
        failed = [c for c in status.get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
        assert not failed, f"the job failed: {failed[0].get('message')}"
        return status.get("phase") == "Succeeded"

    t.kube.wait_for("job Succeeded", done, timeout=timeout, namespace=ns)
    return _status(t, ns)


def _pods(t: Target, ns: str, role: str) -> list[dict[str, Any]]:
    pods = t.kube.get("pods", "-n", ns, "-l", f"phalanx.dev/role={role}")["items"]
    return [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def _training(t: Target, ns: str, *, past: int = 3) -> None:
    """Waits until both workers run and the job has stepped past ``past``."""
    t.kube.wait_for(
        "training progress",
        lambda: _status(t, ns).get("step", -1) >= past and len(_pods(t, ns, "worker")) == 2,
        timeout=300,
        namespace=ns,
    )


def _logs(t: Target, ns: str, pod: str) -> str:
    return t.kube("logs", "-n", ns, pod, "--all-containers", check=False)


def _events(t: Target, ns: str) -> set[str]:
    events = t.kube.get("events", "-n", ns, "--field-selector", "involvedObject.kind=ElasticJob")
    return {e["reason"] for e in events["items"]}


def test_the_example_trains_to_success(phalanx: Target, ns: str) -> None:
    _apply_example(phalanx, ns, steps=20, step_s=0.1)
    status = _succeeded(phalanx, ns, timeout=300)
    assert status["step"] >= 19, status
    assert status["worldSize"] == 4, status
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Succeeded"] == "True", conditions
    reasons = _events(phalanx, ns)
    assert {"Created", "MasterCreated", "WorkerCreated", "Succeeded"} <= reasons, reasons
    assert "Restarting" not in reasons, "a job that succeeds never passes through Restarting"
    # It ran over TLS (the chart's operator.masterTLS, on for every scenario here): the master served only
    # its issued certificate, and the agents and flash-checkpoint hosts reached it through the CA alone.
    pods = phalanx.kube.get("pods", "-n", ns)["items"]
    (master,) = [p for p in pods if p["metadata"]["labels"].get("phalanx.dev/role") == "master"]
    assert "--tls-cert-file" in master["spec"]["containers"][0]["command"]
    for worker in (p for p in pods if p["metadata"]["labels"].get("phalanx.dev/role") == "worker"):
        env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
        assert env["PHALANX_TLS_CA_FILE"].endswith("/ca.crt")
        (volume,) = [v for v in worker["spec"]["volumes"] if v["name"] == "phalanx-tls"]
        assert [i["key"] for i in volume["secret"]["items"]] == ["ca.crt"], "a worker never holds the key"


def test_a_worker_killed_in_its_container_resumes_from_memory_with_no_step_lost(
    phalanx: Target, ns: str
) -> None:
    # 96 MiB of state per rank, two slots each: the flash checkpoint needs far more than the 64 MiB /dev/shm a
    # container gets by default, so this passes only because the operator mounts a larger one.
    _apply_example(phalanx, ns, steps=60, step_s=0.2, state_mb=96)
    _training(phalanx, ns, past=8)
    victim = sorted(_pods(phalanx, ns, "worker"), key=lambda p: p["metadata"]["name"])[0]
    name = victim["metadata"]["name"]
    before = phalanx.kube(
        "exec",
        "-n",
        ns,
        name,
        "--",
        "python",
        "-c",
        "import os; print(os.statvfs('/dev/shm').f_blocks * os.statvfs('/dev/shm').f_frsize)",
    )
    assert int(before.strip()) > 2 * 96 * 2**20 * 2, f"/dev/shm is {before.strip()} bytes"
    reached = int(_status(phalanx, ns)["step"])
    phalanx.kube("exec", "-n", ns, name, "--", "python", "-c", KILL_ONE_RANK)
    status = _succeeded(phalanx, ns, timeout=300)
    assert status["step"] >= 59, status
    loads = [
        (int(s), src) for p in _pods_any(phalanx, ns) for s, src in LOADED.findall(_logs(phalanx, ns, p))
    ]
    assert loads, "no rank reported a load after the kill"
    resumed = min(step for step, _ in loads)
    assert resumed >= reached, f"steps lost: reached {reached} before the kill, resumed after {resumed}"
    # memory: the node's own; peer: a rank whose node had not saved the newest step yet received it from one
    # that had. Never storage: there is none.
    assert {src for _, src in loads} <= {"memory", "peer"}, f"a restart in place loads from memory: {loads}"
    pods = {
        p["metadata"]["uid"]
        for p in phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
    }
    assert victim["metadata"]["uid"] in pods, "the container's process was restarted in place, not its Pod"


def _pods_any(t: Target, ns: str) -> list[str]:
    return [
        p["metadata"]["name"] for p in t.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
    ]


def test_a_lost_node_is_replaced_on_a_node_still_there(phalanx: Target, ns: str) -> None:
    if phalanx.power_off is None:
        pytest.fail("this cluster gives the scenarios no way to lose a node (Target.power_off)")
    operators = phalanx.kube.get(
        "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=operator"
    )
    spared = {p["spec"]["nodeName"] for p in operators["items"]}
    # The master goes beside the operator, the workers one per node: losing the other node loses a worker.
    _apply_example(phalanx, ns, steps=150, step_s=0.2, master_on=sorted(spared)[0])
    _training(phalanx, ns)
    workers = _pods(phalanx, ns, "worker")
    lost = next((p["spec"]["nodeName"] for p in workers if p["spec"]["nodeName"] not in spared), None)
    assert lost is not None, (
        f"no worker runs away from the master and operator: {[p['spec']['nodeName'] for p in workers]}"
    )
    victim = next(p for p in workers if p["spec"]["nodeName"] == lost)
    reached = int(_status(phalanx, ns)["step"])
    phalanx.power_off(lost)
    try:
        phalanx.kube.wait_for(
            "a replacement worker Running on another node",
            lambda: [
                p for p in _pods(phalanx, ns, "worker")
                if p["metadata"]["uid"] != victim["metadata"]["uid"] and p["spec"]["nodeName"] != lost
            ] and len([p for p in _pods(phalanx, ns, "worker") if p["spec"]["nodeName"] != lost]) == 2,
            timeout=180,
            namespace=ns,
        )  # fmt: skip
        status = _succeeded(phalanx, ns, timeout=300)
        assert status["step"] >= 149, status
        assert int(status["round"]) >= 2, f"the survivors re-formed with the replacement: {status}"
        # The replacement node's memory was empty and nothing was persisted: its ranks received the newest
        # step from the survivor's memory, and the job went on from there rather than from step 0.
        replacement = next(
            p["metadata"]["name"]
            for p in phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
            if p["metadata"]["uid"] != victim["metadata"]["uid"] and p["spec"]["nodeName"] != lost
            and p["metadata"]["name"] != _survivor(workers, lost)
        )  # fmt: skip
        loads = [(int(s), src) for s, src in LOADED.findall(_logs(phalanx, ns, replacement))]
        assert loads, "the replacement loaded nothing"
        assert {src for _, src in loads} == {"peer"}, f"the replacement's loads: {loads}"
        assert min(step for step, _ in loads) >= reached - 1, f"reached {reached} before the loss: {loads}"
    finally:
        assert phalanx.power_on is not None
        phalanx.power_on(lost)


MASTER_NODE_LOST_S = 5
"""The chart's operator.masterNodeLostSeconds in these scenarios (e2e/conftest.py)."""


def _answers(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=2).close()
    except OSError:
        return False
    return True


def test_a_master_whose_node_stops_answering_is_replaced_and_the_old_one_fenced(
    phalanx: Target, ns: str
) -> None:
    """The master's node loses its kubelet (its containers run on, unseen): the master Pod is evicted after
    the operator's bound, replaced at once on the other node, and the old master process, still running,
    stops by itself once the new one holds the job's state; the workers train on, none replaced."""
    t = phalanx
    if t.stop_kubelet is None or t.start_kubelet is None:
        pytest.fail("this cluster gives the scenarios no way to stop a kubelet (Target.stop_kubelet)")
    operators = t.kube.get("pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=operator")
    spared = sorted({p["spec"]["nodeName"] for p in operators["items"]})[0]
    silent = next(
        n["metadata"]["name"] for n in t.kube.get("nodes")["items"] if n["metadata"]["name"] != spared
    )
    t.kube("cordon", spared)  # the master goes to the node that will fall silent (and may leave it later)
    try:
        _apply_example(t, ns, steps=250, step_s=0.2)
        (old,) = t.kube.wait_for("the master placed", lambda: [
            p for p in t.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"]
            if p["spec"].get("nodeName")], timeout=60, namespace=ns)  # fmt: skip
    finally:
        t.kube("uncordon", spared)
    assert old["spec"]["nodeName"] == silent
    _training(t, ns)
    old = _pods(t, ns, "master")[0]
    old_ip, port = old["status"]["podIP"], 8080
    assert _answers(old_ip, port), "the old master serves before its node falls silent"
    reached = int(_status(t, ns)["step"])
    t.stop_kubelet(silent)
    stopped = time.monotonic()
    try:

        def master_ready() -> str:
            found = [c for c in _status(t, ns).get("conditions", []) if c["type"] == "MasterReady"]
            return found[0]["status"] if found else ""

        t.kube.wait_for("MasterReady False while its node is silent", lambda: master_ready() == "False",
                        timeout=90, namespace=ns)  # fmt: skip
        t.kube.wait_for("a new master serving on the other node", lambda: master_ready() == "True" and [
            p for p in _pods(t, ns, "master")
            if p["metadata"]["uid"] != old["metadata"]["uid"] and p["spec"]["nodeName"] == spared
        ], timeout=150, namespace=ns)  # fmt: skip
        took = time.monotonic() - stopped
        print(f"\nthe new master served {took:.1f} s after the master node's kubelet stopped")
        # NotReady after the node controller's grace (20 s here), evicted MASTER_NODE_LOST_S later, then
        # scheduled and started on the other node.
        assert took < 20 + MASTER_NODE_LOST_S + 60, f"the new master served {took:.0f} s after the loss"
        t.kube.wait_for("the old master process stopped by itself (fenced)",
                        lambda: not _answers(old_ip, port), timeout=30, namespace=ns)  # fmt: skip
        taken_over = int(_status(t, ns)["step"])
        assert taken_over > reached, "the workers trained on while the master was away"
        t.kube.wait_for("training going on with the new master",
                        lambda: int(_status(t, ns).get("step", -1)) > taken_over + 20, timeout=120,
                        namespace=ns)  # fmt: skip
        assert "MasterNodeLost" in _events(t, ns)
        status = _succeeded(t, ns, timeout=300)
        assert status["step"] >= 249, status
        assert status.get("replacements", 0) == 0, "no worker replaced: they kept training"
    finally:
        t.start_kubelet(silent)


def test_a_drained_nodes_worker_is_replaced_without_spending_the_eviction_budget(
    phalanx: Target, ns: str
) -> None:
    """`kubectl drain` of a worker's node on real kubelets: the eviction API ends the worker (its Pod gets
    the DisruptionTarget condition), the operator replaces it on the node still open, the job re-forms and
    succeeds, and the replacement is counted as a disruption, not against restart.maxEvictions."""
    operators = phalanx.kube.get(
        "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=operator"
    )
    spared = sorted({p["spec"]["nodeName"] for p in operators["items"]})[0]
    _apply_example(phalanx, ns, steps=150, step_s=0.2, master_on=spared)
    _training(phalanx, ns)
    workers = _pods(phalanx, ns, "worker")
    drained = next((p["spec"]["nodeName"] for p in workers if p["spec"]["nodeName"] != spared), None)
    assert drained is not None, f"no worker away from the master: {[p['spec']['nodeName'] for p in workers]}"
    victim = next(p for p in workers if p["spec"]["nodeName"] == drained)
    try:
        phalanx.kube(
            "drain", drained, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s",
            "--pod-selector=phalanx.dev/job=tiny",  # the job's Pods: other scenarios' leftovers are not ours
        )  # fmt: skip
        phalanx.kube.wait_for(
            "a replacement worker Running on the node still open",
            lambda: len([
                p for p in _pods(phalanx, ns, "worker")
                if p["metadata"]["uid"] != victim["metadata"]["uid"] and p["spec"]["nodeName"] == spared
            ]) == 2,
            timeout=180,
            namespace=ns,
        )  # fmt: skip
        status = _succeeded(phalanx, ns, timeout=300)
    finally:
        phalanx.kube("uncordon", drained)
    assert status["step"] >= 149, status
    assert status.get("replacements", 0) == 0, f"a drain spent the eviction budget: {status}"
    assert status.get("disruptions", 0) == 1, status
    assert int(status["round"]) >= 2, f"the job re-formed with the replacement: {status}"
    assert "WorkerDisrupted" in _events(phalanx, ns)


def _survivor(workers: list[dict[str, Any]], lost: str) -> str:
    return str(next(p["metadata"]["name"] for p in workers if p["spec"]["nodeName"] != lost))


LISTENING = """
import json
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.rsplit(":", 1)
        if state == "0A" and address not in ("0100007F", "00000000000000000000000001000000"):
            ports.add(int(port, 16))
print(json.dumps(sorted(ports)))
"""
"""Prints the TCP ports a Pod listens on beyond loopback (its network namespace's LISTEN sockets)."""

CONNECT = """
import json, socket, sys
answers = {}
for host, port in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect((host, port))
        answers[f"{host}:{port}"] = "open"
    except OSError as exc:
        answers[f"{host}:{port}"] = type(exc).__name__
    finally:
        s.close()
print(json.dumps(answers))
"""
"""Tries a TCP connection to each (address, port) of argv[1]; prints what became of each."""


def _python(t: Target, ns: str, pod: str, script: str, *args: str) -> Any:
    return json.loads(
        t.kube("exec", "-n", ns, pod, "--", "python", "-c", script, *args).strip().splitlines()[-1]
    )


def test_a_pod_of_another_namespace_cannot_reach_the_workers_stores(phalanx: Target, ns: str) -> None:
    """The job's NetworkPolicies (on by default) where the cluster enforces them: every port the workers
    listen on (the rank-0 worker's rendezvous store, torch's store, the agents' servers) takes connections
    from the job's own master and from no Pod of another namespace, not even one that carries the job's
    labels. The workers run on the node whose Pods the test cluster guards (k8s_harness/netpol.py)."""
    _apply_example(phalanx, ns, steps=400, step_s=0.2, workers_on=phalanx.guarded_node)
    _training(phalanx, ns)
    workers = _pods(phalanx, ns, "worker")
    targets = [
        (w["status"]["podIP"], port)
        for w in workers
        for port in _python(phalanx, ns, w["metadata"]["name"], LISTENING)
    ]
    print(f"\nthe workers listen on {targets}")
    assert len({ip for ip, _ in targets}) == 2, f"found no listening port on some worker: {targets}"
    (master,) = _pods(phalanx, ns, "master")
    from_master = _python(phalanx, ns, master["metadata"]["name"], CONNECT, json.dumps(targets))
    assert set(from_master.values()) == {"open"}, f"the job's own master was refused: {from_master}"

    stranger_ns = f"{ns}-stranger"[:63]
    phalanx.kube("create", "namespace", stranger_ns)
    try:
        stranger = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "stranger",
                "namespace": stranger_ns,
                "labels": {"phalanx.dev/job": "tiny", "phalanx.dev/role": "worker"},
            },
            "spec": {
                "containers": [{
                    "name": "c", "image": phalanx.image, "command": ["sleep", "3600"],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }],
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            },
        }  # fmt: skip
        phalanx.kube("apply", "-f", "-", input_text=json.dumps(stranger))
        phalanx.kube("wait", "--for=condition=Ready", "pod/stranger", "-n", stranger_ns, "--timeout=120s")
        from_stranger = _python(phalanx, stranger_ns, "stranger", CONNECT, json.dumps(targets))
        assert "open" not in from_stranger.values(), f"a Pod of another namespace got in: {from_stranger}"
    finally:
        phalanx.kube("delete", "namespace", stranger_ns, "--wait=false")
    # The job never noticed.
    reached = int(_status(phalanx, ns)["step"])
    phalanx.kube.wait_for(
        "training going on", lambda: int(_status(phalanx, ns)["step"]) > reached + 5, timeout=60, namespace=ns
    )


def test_workers_slow_to_start_do_not_run_down_the_min_nodes_timeout(phalanx: Target, ns: str) -> None:
    """A worker Pod that is placed but whose containers have not started (an init container sleeping 25 s
    stands for a training image pulled onto a new node for minutes) keeps the min-nodes clock stopped: with
    nodes.minNodesTimeout 8s the job waits for its workers and succeeds. Counted from placement, as it once
    was, the job failed 8 s after its Pods were placed, with "only 0 of the 2 required nodes"."""
    docs = example_documents()
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    job["spec"]["nodes"]["minNodesTimeout"] = "8s"
    pod = job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    trainer["env"] = [{"name": "TINY_STEPS", "value": "10"}, {"name": "TINY_STEP_S", "value": "0.1"}]
    pod["initContainers"] = [{"name": "pull", "image": trainer["image"], "command": ["sleep", "25"]}]
    phalanx.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all(docs))
    phalanx.kube.wait_for(
        "both workers placed, their init container running",
        lambda: len([
            p for p in phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
            if p["spec"].get("nodeName") and p["status"].get("phase") == "Pending"
        ]) == 2,
        timeout=120,
        namespace=ns,
    )  # fmt: skip
    job_now = phalanx.kube.get("ej", "tiny", "-n", ns)
    assert job_now["metadata"]["annotations"].get("phalanx.dev/scheduled-workers") == "0", job_now["metadata"]
    status = _succeeded(phalanx, ns, timeout=300)
    assert status["step"] >= 9, status
    assert status.get("replacements", 0) == 0, status


def test_a_deleted_worker_pod_is_replaced_and_the_job_succeeds(phalanx: Target, ns: str) -> None:
    _apply_example(phalanx, ns, steps=80, step_s=0.2)
    _training(phalanx, ns)
    victim = sorted(_pods(phalanx, ns, "worker"), key=lambda p: p["metadata"]["name"])[0]
    # The Pod is gone at once: no grace period for the agent.
    phalanx.kube("delete", "pod", victim["metadata"]["name"], "-n", ns, "--grace-period=0", "--force")
    phalanx.kube.wait_for(
        "a replacement worker Running",
        lambda: (
            len(_pods(phalanx, ns, "worker")) == 2
            and victim["metadata"]["uid"] not in {p["metadata"]["uid"] for p in _pods(phalanx, ns, "worker")}
        ),
        timeout=180,
        namespace=ns,
    )
    status = _succeeded(phalanx, ns, timeout=300)
    assert status["step"] >= 79, status
    assert int(status["round"]) >= 2, f"the survivors re-formed with the replacement: {status}"


def test_pods_that_cannot_start_say_why(phalanx: Target, ns: str) -> None:
    """Jobs whose workers never start, each for a cause of its own, on real kubelets and containerd: an image
    that does not exist, a Secret that is missing, a resource no node has, and an image that runs as root (as
    most vendor training images do) under the restricted defaults. Each job's PodsReady condition and a
    Warning Event name the cause in the kubelet's or the scheduler's words, with the fix where the kubelet
    names none, while its master runs; not after the minimum-node timeout. The causes that waiting does not
    heal then fail their job with that cause once the operator's stuck_pod_timeout_s has passed; the
    unschedulable job waits on. The root image with the fix the docs give (runAsUser in the template) runs to
    the end."""
    docs = example_documents()
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    config = [d for d in docs if d["kind"] != "ElasticJob"]
    causes = {
        "no-image": (
            {"image": "phalanx-does-not-exist:1"},
            ("ErrImagePull", "ImagePullBackOff"),
            "phalanx-does-not-exist:1",
        ),
        "no-secret": (
            {
                "env": [
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "phalanx-missing", "key": "k"}}}
                ]
            },
            ("CreateContainerConfigError",),
            'secret "phalanx-missing" not found',
        ),
        "no-node": (
            {"resources": {"limits": {"example.com/gpu": "1"}}},
            ("Unschedulable",),
            "Insufficient example.com/gpu",
        ),
    }
    if phalanx.root_image:
        causes["as-root"] = (
            {"image": phalanx.root_image},
            ("CreateContainerConfigError",),
            "image will run as root",
        )
    fixes = {"as-root": "set spec.template.spec.securityContext.runAsUser (and fsGroup) to a uid"}
    jobs = []
    for name, (change, _, _) in causes.items():
        stuck = copy.deepcopy(job)
        stuck["metadata"]["name"] = name
        (container,) = stuck["spec"]["template"]["spec"]["containers"]
        container.update(change)
        jobs.append(stuck)
    if phalanx.root_image:
        jobs.append(_as_root_with_the_fix(job, phalanx.root_image))
    phalanx.kube("apply", "-n", ns, "-f", "-", input_text=yaml.safe_dump_all(config + jobs))

    def said(name: str) -> dict[str, Any] | None:
        status = dict(phalanx.kube.get("ej", name, "-n", ns).get("status", {}))
        ready = next((c for c in status.get("conditions", []) if c["type"] == "PodsReady"), None)
        return ready if ready and ready["reason"] in causes[name][1] else None

    for name, (_, _, words) in causes.items():
        ready = phalanx.kube.wait_for(
            f"{name}: PodsReady says why", lambda n=name: said(n), timeout=180, namespace=ns
        )
        assert ready is not None
        assert ready["status"] == "False"
        assert words in ready["message"], ready["message"]
        assert fixes.get(name, "") in ready["message"], ready["message"]
        assert f"{name}-worker-" in ready["message"], ready["message"]
    bound = STUCK_POD_TIMEOUT_S + 60  # from the first pass that saw the cause

    def failed(name: str) -> dict[str, Any] | None:
        status = _status(phalanx, ns, name)
        if status.get("phase") != "Failed":
            return None
        return next(c for c in status.get("conditions", []) if c["type"] == "Failed")

    for name in ("no-image", "no-secret", *(["as-root"] if phalanx.root_image else [])):
        cond = phalanx.kube.wait_for(
            f"{name}: failed with its cause", lambda n=name: failed(n), timeout=bound, namespace=ns
        )
        assert cond is not None
        assert cond["reason"] in causes[name][1], cond
        assert causes[name][2] in cond["message"], cond["message"]
    assert _status(phalanx, ns, "no-node").get("phase") != "Failed", "an autoscaler may add the node"
    events = phalanx.kube.get("events", "-n", ns, "--field-selector", "involvedObject.kind=ElasticJob")[
        "items"
    ]
    warned = {e["reason"] for e in events if e["type"] == "Warning"}
    assert {"CreateContainerConfigError", "Unschedulable"} <= warned, warned
    assert warned & {"ErrImagePull", "ImagePullBackOff"}, warned
    if phalanx.root_image:
        ran = phalanx.kube.wait_for(
            "the root image with runAsUser: Succeeded",
            lambda: _status(phalanx, ns, "as-root-fixed").get("phase") == "Succeeded" or None,
            timeout=120,
            namespace=ns,
        )
        assert ran


def _as_root_with_the_fix(job: dict[str, Any], image: str) -> dict[str, Any]:
    """The root image as the docs say to run it: ``runAsUser`` (and ``fsGroup``) in the template, so the
    restricted defaults (``runAsNonRoot``) stand. Its workers run a shell command (that image has no torch)
    that fails unless it runs as that user."""
    fixed = copy.deepcopy(job)
    fixed["metadata"]["name"] = "as-root-fixed"
    pod = fixed["spec"]["template"]["spec"]
    pod["securityContext"] = {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
    (container,) = pod["containers"]
    container.update(image=image, command=["sh", "-c", 'test "$(id -u)" = 10001'])
    return fixed


def test_an_invalid_spec_is_refused_with_what_to_fix(phalanx: Target, ns: str) -> None:
    bad = (
        "apiVersion: phalanx.dev/v1alpha1\nkind: ElasticJob\nmetadata: {name: bad}\n"
        "spec:\n  nodes: {min: 3, max: 2}\n  nprocPerNode: 1\n"
        "  template: {spec: {containers: [{name: t, image: x, command: [python, t.py]}]}}\n"
    )
    out = phalanx.kube("apply", "-n", ns, "-f", "-", input_text=bad, check=False)
    assert "nodes.min must not be greater than nodes.max" in out, out
    assert "bad" not in phalanx.kube("get", "ej", "-n", ns, "-o", "name"), "nothing was created"


def test_a_suspended_job_frees_its_workers_and_resumes_from_the_step_it_persisted(
    phalanx: Target, ns: str
) -> None:
    claim = phalanx.shared_storage(ns)
    _apply_example(phalanx, ns, steps=150, step_s=0.2, storage_claim=claim)
    _training(phalanx, ns, past=8)
    master = phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"][0]
    phalanx.kube("patch", "ej", "tiny", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    phalanx.kube.wait_for(
        "job Suspended with no worker Pod",
        lambda: (
            _status(phalanx, ns).get("phase") == "Suspended"
            and not phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
        ),
        timeout=150,
        namespace=ns,
    )
    reached = int(_status(phalanx, ns)["step"])
    masters = phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"]
    assert [p["metadata"]["uid"] for p in masters] == [master["metadata"]["uid"]], "the master Pod stays"
    phalanx.kube("patch", "ej", "tiny", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    phalanx.kube.wait_for(
        "the resumed workers loaded a step",
        lambda: [m for p in _pods_any(phalanx, ns) for m in LOADED.findall(_logs(phalanx, ns, p))],
        timeout=240,
        namespace=ns,
    )
    loads = [
        (int(s), src) for p in _pods_any(phalanx, ns) for s, src in LOADED.findall(_logs(phalanx, ns, p))
    ]
    # New Pods have no memory to load from: one rank reads the persisted step and hands it to the others
    # (the state is replicated), so storage is read once, not once per rank.
    assert sorted(src for _, src in loads) == ["peer"] * (len(loads) - 1) + ["storage"], loads
    assert min(s for s, _ in loads) >= reached - 1, f"suspended at step {reached}, resumed after {loads}"
    status = _succeeded(phalanx, ns, timeout=300)
    assert status.get("replacements", 0) == 0, status
    assert status.get("evictions", []) == [], status
    reasons = _events(phalanx, ns)
    assert {"Suspending", "Suspended", "Resumed", "Succeeded"} <= reasons, reasons
