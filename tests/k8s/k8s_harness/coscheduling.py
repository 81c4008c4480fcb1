"""scheduler-plugins' kube-scheduler with its Coscheduling plugin (scripts/go-tools builds it), run as a
second scheduler against a test cluster, as its release runs it beside the default one: the profile
``scheduler-plugins-scheduler``, the PodGroup CRD (``scheduling.x-k8s.io/v1alpha1``) from its module.

Its controller, which writes a PodGroup's status phases, is not run: the plugin places Pods without it, and
the operator reads a coscheduled gang's verdict from its Pods (phalanx.operator.gang)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import yaml

from k8s_harness import served
from phalanx.api.ports import free_port

SCHEDULER_NAME = "scheduler-plugins-scheduler"
PERMIT_WAIT_S = 5
"""How long the plugin holds a gang's placed Pods for the rest (its release's example says 10 s)."""
REQUEUE_S = 10
"""The scheduler's --pod-max-in-unschedulable-pods-duration (default 5 min). The plugin requeues a gang it
rejected when a Pod is created or a PodGroup changes, not when one is deleted: a gang that waits for a
deleted Pod's room is tried again only after this. A busy cluster creates Pods all the time; the test's
does not."""


@contextlib.contextmanager
def running(*, binary: Path, kubeconfig: Path, kubectl: Path, state: Path) -> Iterator[str]:
    """Installs the PodGroup CRD and runs the scheduler until the block ends; yields its scheduler name."""
    folder = state / "scheduler-plugins"
    folder.mkdir(parents=True, exist_ok=True)
    crd = binary.parent / "scheduler-plugins-config" / "podgroups.yaml"
    for args in (
        ("apply", "--server-side", "-f", str(crd)),
        ("wait", "--for=condition=Established", "--timeout=90s", "crd/podgroups.scheduling.x-k8s.io"),
    ):
        subprocess.run([str(kubectl), f"--kubeconfig={kubeconfig}", *args], check=True, capture_output=True,
                       timeout=120)  # fmt: skip
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "profiles": [{
            "schedulerName": SCHEDULER_NAME,
            "plugins": {
                "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]},
            },
            "pluginConfig": [{"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": PERMIT_WAIT_S}}],
        }],
    }  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = folder / "scheduler.log"
    argv = [
        str(binary), f"--config={folder / 'config.yaml'}", "--v=2",
        f"--pod-max-in-unschedulable-pods-duration={REQUEUE_S}s",
        "--bind-address=127.0.0.1", f"--secure-port={port}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
    ]  # fmt: skip
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Its serving certificate is its own, made at start: nothing to verify it by.
        served.wait_answering(process, f"https://127.0.0.1:{port}/healthz", log, what="scheduler-plugins",
                              verify=False)  # fmt: skip
        yield SCHEDULER_NAME
    finally:
        served.stop(process)
