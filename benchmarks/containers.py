"""The same ElasticJob on real containers and as processes, side by side in one run.

Two clusters on this machine, one after the other, each with the same control plane and the same phalanx:

* ``containers``: two real nodes (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS: the e2e suite's
  cluster, tests/k8s/k8s_harness/nodes.py), the images built here, phalanx installed by its Helm chart;
* ``processes``: the test kubelet of tests/k8s, which runs each Pod as a process of this checkout, and the
  operator as a local process.

Each run applies examples/elasticjob.yaml (2 nodes x 2 processes, 0.2 s steps) and measures, from the
ElasticJob's status (polled every 0.2 s):

* ``start_s``: from creating the ElasticJob to its first reported step (Pods created, scheduled, started,
  ``import torch``, rendezvous, one step);
* ``worker_kill_s``: from a SIGKILL of one training process (inside its container: ``kubectl exec``; as a
  process: ``kill``) to the first step reported after it, the process restarted in place by its agent and
  the step loaded from the node's memory.

Medians over ``--runs`` jobs per cluster, and the ratios containers / processes, as one JSON line.

    .venv/bin/python -m benchmarks.containers --runs 3 --out benchmarks/results/containers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from e2e.faults import KILL_ONE_RANK

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_harness.cluster import Cluster  # noqa: E402
from k8s_harness.controlplane import ControlPlane, find_binaries  # noqa: E402
from k8s_harness.images import built_images, example_images  # noqa: E402
from k8s_harness.nodes import BRIDGE_IP, ContainerNodes  # noqa: E402


def _example(*, steps: int) -> str:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "elasticjob.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["env"] = [{"name": "TINY_STEPS", "value": str(steps)}, {"name": "TINY_STEP_S", "value": "0.2"}]
    return yaml.safe_dump_all(docs)


def _status(kubectl: Callable[..., str], ns: str) -> dict[str, Any]:
    out = kubectl("get", "ej", "tiny", "-n", ns, "-o", "json")
    return dict(json.loads(out).get("status", {}))


def _wait(what: str, probe: Callable[[], bool], *, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return time.monotonic()
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def one_job(kubectl: Callable[..., str], kill: Callable[[str], None], ns: str) -> dict[str, float]:
    kubectl("create", "namespace", ns)
    created = time.monotonic()
    kubectl("apply", "-n", ns, "-f", "-", input_text=_example(steps=60))
    first = _wait("the first step", lambda: _status(kubectl, ns).get("step", -1) >= 0, timeout=300)
    _wait("step 10", lambda: _status(kubectl, ns).get("step", -1) >= 10, timeout=300)
    reached = int(_status(kubectl, ns)["step"])
    killed = time.monotonic()
    kill(ns)
    resumed = _wait(
        "a step after the kill", lambda: int(_status(kubectl, ns).get("step", -1)) > reached + 1, timeout=300
    )
    kubectl("delete", "namespace", ns, "--wait=false")
    return {"start_s": round(first - created, 2), "worker_kill_s": round(resumed - killed, 2)}


@contextlib.contextmanager
def containers(state: Path) -> Iterator[tuple[Callable[..., str], Callable[[str], None]]]:
    bin_dir = find_binaries()
    assert bin_dir is not None, "run scripts/k8s-binaries first"
    images = built_images()
    ContainerNodes.prepare_network()
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state, bind_address=BRIDGE_IP)
    nodes = ContainerNodes(
        cp, images=[i.tarball for i in images.values()], pause_image=images["phalanx-pause"].ref
    )
    try:
        cp.start()
        nodes.start()
        for name in example_images():
            nodes.tag(images["phalanx-train"].ref, name)
        helm = subprocess.run(
            [str(ROOT / "scripts" / "helm-binary")], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        repository, _, tag = images["phalanx"].ref.rpartition(":")
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "HOME": str(state)}
        subprocess.run(
            [helm, "install", "phalanx", str(ROOT / "charts" / "phalanx"), "-n", "phalanx-system",
             "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
             "--set", "image.pullPolicy=Never", "--set", "operator.reconcileIntervalSeconds=1", "--wait"],
            check=True, env=env, capture_output=True,
        )  # fmt: skip

        def kill(ns: str) -> None:
            pods = json.loads(
                cp.kubectl("get", "pods", "-n", ns, "-l", "phalanx.dev/role=worker", "-o", "json")
            )
            name = sorted(p["metadata"]["name"] for p in pods["items"])[0]
            cp.kubectl("exec", "-n", ns, name, "--", "python", "-c", KILL_ONE_RANK)

        yield cp.kubectl, kill
    finally:
        nodes.stop()
        cp.stop()


@contextlib.contextmanager
def processes(state: Path) -> Iterator[tuple[Callable[..., str], Callable[[str], None]]]:
    bin_dir = find_binaries()
    assert bin_dir is not None
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    cluster = Cluster(cp=cp)
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        cp.kubectl("wait", "--for=condition=Established", "crd/elasticjobs.phalanx.dev", "--timeout=30s")
        cluster.start_kubelet()
        cluster.install_operator_rbac()
        cluster.start_operator()

        def kill(ns: str) -> None:  # one job runs at a time: any of its ranks, found as in a container
            subprocess.run([sys.executable, "-c", KILL_ONE_RANK], check=True, capture_output=True)

        yield cp.kubectl, kill
    finally:
        cluster.stop()
        cp.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for mode, cluster in (("containers", containers), ("processes", processes)):
        with (
            tempfile.TemporaryDirectory(prefix=f"phalanx-bench-{mode}-") as d,
            cluster(Path(d)) as (kubectl, kill),
        ):
            results[mode] = [one_job(kubectl, kill, f"bench-{i}") for i in range(args.runs)]
            print(mode, results[mode], file=sys.stderr, flush=True)
    medians = {
        mode: {k: statistics.median(r[k] for r in runs) for k in ("start_s", "worker_kill_s")}
        for mode, runs in results.items()
    }
    report = {
        "benchmark": "containers",
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "date": time.strftime("%Y-%m-%d"),
        "runs": results,
        "median": medians,
        "ratio_containers_to_processes": {
            k: round(medians["containers"][k] / medians["processes"][k], 2)
            for k in ("start_s", "worker_kill_s")
        },
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    return 0


if __name__ == "__main__":
    sys.exit(main())
