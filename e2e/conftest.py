"""The cluster the e2e scenarios run against, with phalanx installed the way people install it: `helm
install` of charts/phalanx (the operator Deployment, its RBAC, the CRD).

* ``PHALANX_E2E_KUBECONFIG`` set: that cluster (kind, or any other), with the images named by
  ``PHALANX_E2E_IMAGE`` (the Dockerfile's ``base`` target: operator and masters) and
  ``PHALANX_E2E_TRAIN_IMAGE`` (``train``: workers). See e2e/README.md.
* Otherwise (``make test``, CI): a control plane started here from the binaries of scripts/k8s-binaries,
  with the test kubelet of tests/k8s, which runs each Pod as a process of this checkout. Without the
  binaries or helm the scenarios skip with a loud reason, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.kube import Helm, Kube

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "phalanx"
RELEASE, RELEASE_NAMESPACE = "phalanx", "phalanx-e2e"


@dataclass(frozen=True)
class Target:
    kube: Kube
    helm: Helm
    image: str
    """The operator's and masters' image."""
    train_image: str
    """The workers' image."""
    chart_values: tuple[str, ...] = ()
    """Extra ``--set`` values of the chart for this cluster."""


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"E2E CANNOT RUN: {reason} (CI=true: a skipped e2e scenario is a failure)")
    pytest.skip(f"E2E CANNOT RUN: {reason}")


def _helm_binary() -> str:
    found = shutil.which("helm")
    if os.environ.get("PHALANX_E2E_KUBECONFIG") and found:
        return found
    has_go = shutil.which("go") or Path("/usr/local/go/bin/go").exists()
    tools = Path(os.environ.get("PHALANX_TOOLS_CACHE", Path.home() / ".cache/phalanx/tools"))
    if not has_go and not list(tools.glob("helm-*/helm")):
        _missing("no helm: install it, or Go to build it with scripts/helm-binary")
    result = subprocess.run(
        [str(ROOT / "scripts" / "helm-binary")], capture_output=True, text=True, timeout=880, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    home = tmp_path_factory.mktemp("helm-home")
    external = os.environ.get("PHALANX_E2E_KUBECONFIG")
    if external:
        image, train = os.environ.get("PHALANX_E2E_IMAGE"), os.environ.get("PHALANX_E2E_TRAIN_IMAGE")
        if not image or not train:
            pytest.fail("PHALANX_E2E_KUBECONFIG needs PHALANX_E2E_IMAGE and PHALANX_E2E_TRAIN_IMAGE too")
        kubeconfig = Path(external).expanduser()
        kube = Kube(os.environ.get("PHALANX_E2E_KUBECTL", "kubectl"), kubeconfig)
        yield Target(kube, Helm(_helm_binary(), home, kubeconfig), image, train)
        return
    sys.path.insert(0, str(ROOT / "tests" / "k8s"))
    from k8s_harness.cluster import Cluster
    from k8s_harness.controlplane import ControlPlane, find_binaries, free_port

    bin_dir = find_binaries()
    if bin_dir is None:
        _missing("no Kubernetes control plane under ~/.cache/phalanx/k8s; run `make k8s-binaries` (needs Go)")
    assert bin_dir is not None
    helm = _helm_binary()
    state = Path(tempfile.mkdtemp(prefix="phalanx-e2e-"))
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    cluster = Cluster(cp=cp)
    try:
        cp.start()
        cluster.start_kubelet()
        # The test kubelet runs this checkout whatever the image says; the names only have to be valid.
        kube = Kube(str(bin_dir / "kubectl"), cp.kubeconfig)
        # Its Pods share this machine's network: the operator's port must not clash with another cluster's.
        values = (f"operator.httpPort={free_port()}",)
        yield Target(
            kube, Helm(helm, home, cp.kubeconfig), "phalanx:checkout", "phalanx-train:checkout", values
        )
    finally:
        cluster.stop()
        cp.stop()
        if os.environ.get("PHALANX_K8S_KEEP") == "1":
            print(f"\nkept the e2e control plane's state in {state}")
        else:
            cp.remove()


@pytest.fixture(scope="session")
def phalanx(target: Target) -> Iterator[Target]:
    """phalanx installed by its Helm chart, the operator running."""
    repository, _, tag = target.image.rpartition(":")
    target.helm(
        "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", "operator.reconcileIntervalSeconds=1",
        *(arg for value in target.chart_values for arg in ("--set", value)),
    )  # fmt: skip
    try:
        target.kube(
            "rollout", "status", f"deployment/{RELEASE}-operator", "-n", RELEASE_NAMESPACE, "--timeout=120s"
        )
        yield target
    finally:
        target.helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "60s")
