"""A cluster of real nodes on this machine, ready for phalanx: the control plane (API server on the nodes'
bridge), two container nodes with the images built here imported, the example's worker image known by the
name the example uses. Shared by the e2e suite, `make k8s-up` and benchmarks/containers.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from k8s_harness.controlplane import ControlPlane, find_binaries, go_tool
from k8s_harness.images import ROOT, Image, built_images, example_images
from k8s_harness.nodes import BRIDGE_IP, ContainerNodes

Started = tuple[ControlPlane, ContainerNodes, dict[str, Image]]


def start(state: Path, *, node_monitor_grace_s: int = 50) -> Started:
    """Starts it; stops what it started if a step fails. The caller stops it (:func:`stop`)."""
    bin_dir = find_binaries()
    if bin_dir is None or not (bin_dir / "kubelet").exists():
        raise RuntimeError("no Kubernetes binaries with a kubelet: run scripts/go-tools --nodes")
    images = built_images()
    ContainerNodes.prepare_network()
    cp = ControlPlane(
        bin_dir=bin_dir, state_dir=state, bind_address=BRIDGE_IP, node_monitor_grace_s=node_monitor_grace_s
    )
    nodes = ContainerNodes(
        cp, images=[i.tarball for i in images.values()], pause_image=images["phalanx-pause"].ref
    )
    try:
        cp.start()
        nodes.start()
        for name in example_images():  # the example runs as written, its image name included
            nodes.tag(images["phalanx-train"].ref, name)
    except BaseException:
        stop((cp, nodes, images))
        raise
    return cp, nodes, images


def import_images(state: Path, progress: Callable[[str], None]) -> None:
    """Builds the images if they changed and imports them into every node's containerd root, starting no
    cluster: what a cold machine's first cluster would otherwise spend inside a test's timeout."""
    images = built_images()
    # No Kubernetes binary runs here: `make test` imports while they are still being built (a clean-up of
    # what a killed run left uses kube-proxy when it is there).
    cp = ControlPlane(bin_dir=find_binaries() or state / "no-binaries", state_dir=state)
    nodes = ContainerNodes(
        cp, images=[i.tarball for i in images.values()], pause_image=images["phalanx-pause"].ref
    )
    nodes.import_images(progress)


def stop(started: Started) -> None:
    cp, nodes, _ = started
    nodes.stop()
    cp.stop()


@contextlib.contextmanager
def running(state: Path, *, node_monitor_grace_s: int = 50) -> Iterator[Started]:
    started = start(state, node_monitor_grace_s=node_monitor_grace_s)
    try:
        yield started
    finally:
        stop(started)


def helm_install(started: Started, *, namespace: str, values: tuple[str, ...] = ()) -> None:
    """phalanx from its chart, the operator running from the built image; nothing is ever pulled."""
    cp, _, images = started
    helm = str(go_tool("helm"))
    repository, _, tag = images["phalanx"].ref.rpartition(":")
    sets = [f"image.repository={repository}", f"image.tag={tag}", "image.pullPolicy=Never", *values]
    subprocess.run(
        [helm, "install", "phalanx", str(ROOT / "charts" / "phalanx"), "--namespace", namespace,
         "--create-namespace", *(a for s in sets for a in ("--set", s)), "--wait", "--timeout", "180s"],
        check=True, capture_output=True, env={**os.environ, "KUBECONFIG": str(cp.kubeconfig),
                                              "HOME": str(cp.state_dir)},
    )  # fmt: skip
