"""``phalanx status JOB`` and ``kubectl phalanx status JOB`` on the real control plane: an ElasticJob whose
status subresource holds what the operator and the master publish, its Pods, and (for ``--job`` on
``phalanx timeline``) the job token Secret and master Service the operator creates, in front of a real
master process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_harness.controlplane import ControlPlane
from tests.cli.trace_format import check_trace
from tests.master.procs import TOKEN, Master

from phalanx.cli.main import main

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

JOB = "tiny-status"

STATUS = {
    "phase": "Running",
    "round": 3,
    "worldSize": 4,
    "step": 117,
    "restartCount": 1,
    "lastCommittedCheckpointStep": 110,
    "nodes": 2,
    "masterEndpoint": f"{JOB}-master.NS.svc:29400",
    "evictions": [{"nodeId": "node-1", "reason": "node-1 sent no heartbeat for 6s"}],
    "master": {"phase": "Running", "reason": "", "members": ["node-0", "node-2"]},
    "conditions": [
        {"type": "MasterReady", "status": "True", "reason": "MasterRunning", "message": "up"},
        {
            "type": "PodsReady",
            "status": "False",
            "reason": "ImagePullBackOff",
            "message": 'j-worker-1-1: ImagePullBackOff: container trainer: Back-off pulling image "nope:1"',
        },
    ],
}


def _pod(name: str, role: str, node_id: str = "") -> dict[str, object]:
    labels = {"phalanx.dev/job": JOB, "phalanx.dev/role": role}
    if node_id:
        labels["phalanx.dev/node-id"] = node_id
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "phalanx:test", "command": ["true"]}]},
    }


@pytest.fixture(scope="module")
def ns(control_plane: ControlPlane) -> object:
    cp = control_plane
    name = "status-cli"
    cp.kubectl("create", "namespace", name)
    job = {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": JOB},
        "spec": {
            # Another controller's job: the session's operator (the `cluster` fixture), when it runs, leaves
            # the status and the fake Pods below as the test wrote them.
            "managedBy": "test.phalanx.dev/nobody",
            "nodes": {"min": 2, "max": 2},
            "nprocPerNode": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "phalanx:test"}]}},
        },
    }
    cp.kubectl("apply", "-n", name, "-f", "-", input_text=json.dumps(job))
    status = json.dumps({"status": {**STATUS, "masterEndpoint": f"{JOB}-master.{name}.svc:29400"}})
    cp.kubectl("patch", "ej", JOB, "-n", name, "--subresource=status", "--type=merge", "-p", status)
    pods = [_pod(f"{JOB}-master", "master"), _pod(f"{JOB}-worker-0-0", "worker", "node-0")]
    pods.append(_pod(f"{JOB}-worker-1-1", "worker", "node-2"))
    cp.kubectl(
        "apply",
        "-n",
        name,
        "-f",
        "-",
        input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}),
    )
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false")


def test_status_of_an_elasticjob_through_the_kube_context(
    control_plane: ControlPlane, ns: str, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = str(control_plane.kubeconfig)
    assert main(["status", JOB, "-n", ns, "--kubeconfig", kubeconfig, "-o", "json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["source"] == "kubernetes"
    job = view["job"]
    assert (job["round"], job["world_size"], job["step"]) == (3, 4, 117)
    assert job["phase"] == "Running"
    assert job["committed_checkpoint_step"] == 110
    assert job["members"] == ["node-0", "node-2"]
    assert [(p["pod"], p["role"], p["node_id"]) for p in view["pods"]] == [
        (f"{JOB}-master", "master", ""),
        (f"{JOB}-worker-0-0", "worker", "node-0"),
        (f"{JOB}-worker-1-1", "worker", "node-2"),
    ]
    assert view["evictions"][0]["nodeId"] == "node-1"
    # The real kubectl runs the plugin from the PATH; the kube context travels in $KUBECONFIG.
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    kubectl = str(control_plane.bin_dir / "kubectl")
    listed = subprocess.run([kubectl, "plugin", "list"], capture_output=True, text=True, env=env, check=False)
    assert "kubectl-phalanx" in listed.stdout, listed.stdout + listed.stderr
    result = subprocess.run(
        [kubectl, "phalanx", "status", JOB, "-n", ns],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"job {JOB}: Running  round 3  world 4  step 117")
    assert any(line.split()[:3] == [f"{JOB}-worker-0-0", "worker", "node-0"] for line in lines)
    assert "node-1: node-1 sent no heartbeat for 6s" in result.stdout
    assert (
        "Pods not ready: ImagePullBackOff: j-worker-1-1: ImagePullBackOff: container trainer: Back-off"
        in (result.stdout)
    ), "a Pod that cannot start, and why"
    # A job that does not exist: a one-line error, exit code 1.
    capsys.readouterr()
    assert main(["status", "nope", "-n", ns, "--kubeconfig", kubeconfig]) == 1
    err = capsys.readouterr().err
    assert "ElasticJob nope" in err
    assert "404" in err


def test_timeline_and_status_find_the_token_in_the_jobs_secret(
    control_plane: ControlPlane, ns: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--job`` reads the token from ``<job>-token`` and the address from ``<job>-master``; ``--master``
    then only overrides the address (a port-forward), as here: the Service's DNS name does not resolve
    outside a cluster."""
    cp = control_plane
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{JOB}-token"},
        "stringData": {"token": TOKEN},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{JOB}-master"},
        "spec": {
            "selector": {"phalanx.dev/job": JOB, "phalanx.dev/role": "master"},
            "ports": [{"name": "grpc", "port": 29400}, {"name": "http", "port": 8080}],
        },
    }
    cp.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": [secret, service]}),
    )
    kubeconfig = str(cp.kubeconfig)
    # Without --master: the in-cluster address, which cannot be reached from here; the error says what to do.
    code = main(
        ["timeline", "--job", JOB, "-n", ns, "--kubeconfig", kubeconfig, "--timeout", "3", "--no-png"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert f"http://{JOB}-master.{ns}.svc:8080" in err
    assert "kubectl port-forward" in err
    master = Master(tmp_path, "--nodes", "1:1")
    try:
        url = f"http://{master.http}"
        out = tmp_path / "trace"
        args = ["--job", JOB, "-n", ns, "--kubeconfig", kubeconfig, "--master", url]
        assert main(["timeline", *args, "--no-png", "-o", str(out)]) == 0
        assert check_trace(json.loads(out.with_suffix(".json").read_text())) == []
        capsys.readouterr()
        assert main(["status", JOB, "-n", ns, "--kubeconfig", kubeconfig, "--master", url, "-o", "json"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["source"] == "master"
        assert view["job"]["name"] == "test-job"
    finally:
        master.stop()
    assert TOKEN not in capsys.readouterr().out
