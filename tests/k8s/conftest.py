"""One real Kubernetes control plane per test session (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler on loopback), built from the official Go modules by scripts/go-tools.

Without the binaries (no Go toolchain, or `make go-tools` not run) the tests are skipped with a loud
reason, except under CI=true, where a missing control plane fails the session.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from k8s_harness import coscheduling as coscheduling_harness
from k8s_harness.cluster import METRICS_TOKEN, Cluster
from k8s_harness.controlplane import ControlPlane, find_binaries
from tests import release

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"
ADMISSION = ROOT / "deploy" / "elasticjob-admission.yaml"
"""Installed with the CRD, as a real install does: without it the operator refuses privileged templates."""


def _missing(reason: str) -> None:
    message = f"NO KUBERNETES CONTROL PLANE: {reason}. Run `make go-tools` (needs Go) to build it."
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: a skipped Kubernetes test is a failure)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    bin_dir = find_binaries()
    if bin_dir is None:
        _missing("kube-apiserver, etcd, ... not built (scripts/go-tools --cached found none)")
    assert bin_dir is not None
    state = Path(tempfile.mkdtemp(prefix="phalanx-k8s-"))
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    with contextlib.ExitStack() as stop:
        stop.callback(_stop_control_plane, cp)
        release.when_done("tests/k8s/", stop.close)  # idle after its tests, it would load the rest
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(CRD))
        cp.wait_established("elasticjobs.phalanx.dev")
        cp.kubectl("apply", "-f", str(ADMISSION))
        yield cp


def _stop_control_plane(cp: ControlPlane) -> None:
    cp.stop()
    if os.environ.get("PHALANX_K8S_KEEP") == "1":  # keep logs and certificates for debugging
        print(f"\nkept the control plane's state in {cp.state_dir}")
    else:
        cp.remove()


@pytest.fixture(scope="session")
def cluster(control_plane: ControlPlane) -> Iterator[Cluster]:
    """The control plane plus the test kubelet (2 process nodes, 4 simulated) and the operator."""
    c = Cluster(cp=control_plane)
    # The chart's setting for one PodMonitor across jobs: every master also accepts this token on /metrics.
    token_file = control_plane.state_dir / "metrics-token"
    token_file.write_text(METRICS_TOKEN + "\n")
    c.extra_env["PHALANX_OPERATOR_METRICS_TOKEN_FILE"] = str(token_file)
    with contextlib.ExitStack() as stop:
        stop.callback(c.stop)
        release.when_done("tests/k8s/", stop.close)
        c.start_kubelet()
        c.install_operator_rbac()
        c.start_operator()
        yield c


@pytest.fixture(scope="session")
def coscheduling(cluster: Cluster) -> Iterator[str]:
    """scheduler-plugins' scheduler with its Coscheduling plugin beside the default one; yields its name."""
    binary = cluster.cp.bin_dir / "scheduler-plugins"
    if not binary.exists():
        _missing("scheduler-plugins was not built (scripts/go-tools)")
    with contextlib.ExitStack() as stop:
        cp = cluster.cp
        name = stop.enter_context(
            coscheduling_harness.running(
                binary=binary, kubeconfig=cp.kubeconfig, kubectl=cp.bin_dir / "kubectl", state=cp.state_dir
            )
        )
        release.when_done("tests/k8s/", stop.close)
        yield name
