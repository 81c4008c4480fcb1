"""The test cluster around a control plane: the test kubelet and the operator (run with the
ServiceAccount and ClusterRole of deploy/operator-rbac.yaml, so a missing permission fails a test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.eventually import eventually

from k8s_harness.controlplane import ControlPlane, free_port, write_kubeconfig

ROOT = Path(__file__).resolve().parents[3]
HARNESS = Path(__file__).resolve().parent
PROCESS_NODES = ("node-a", "node-b")
SIMULATED_NODES = ("sim-0", "sim-1", "sim-2", "sim-3")
METRICS_TOKEN = "prometheus-" + "m" * 24  # what the tests' operator hands every master for /metrics


def _spawn(argv: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=ROOT
        )


def _stop(proc: subprocess.Popen[bytes] | None, *, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Cluster:
    cp: ControlPlane
    kubelet: subprocess.Popen[bytes] | None = None
    operator: subprocess.Popen[bytes] | None = None
    operator_kubeconfig: Path = Path()
    operator_starts: int = 0
    operator_http: str = ""
    """host:port of the operator's /healthz and /metrics."""
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def kubelet_dir(self) -> Path:
        return self.cp.state_dir / "kubelet"

    def start_kubelet(self) -> None:
        self.kubelet_dir.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "k8s_harness.kubelet", "--kubeconfig", str(self.cp.kubeconfig)]
        argv += ["--state-dir", str(self.kubelet_dir)]
        for n in PROCESS_NODES:
            argv += ["--node", n]
        for n in SIMULATED_NODES:
            argv += ["--simulated-node", n]
        env = {**os.environ, "PYTHONPATH": str(HARNESS.parent)}
        self.kubelet = _spawn(argv, log=self.cp.state_dir / "kubelet.log", env=env)
        (self.cp.state_dir / "kubelet.pid").write_text(str(self.kubelet.pid))

        def all_ready() -> bool:
            if self.kubelet is not None and self.kubelet.poll() is not None:
                raise RuntimeError("the test kubelet exited; see kubelet.log")
            out = self.cp.kubectl("get", "nodes", "-o", "json", check=False)
            try:
                nodes = json.loads(out[: out.rfind("}") + 1])["items"]
            except json.JSONDecodeError:
                return False
            ready = [
                n for n in nodes
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in n["status"].get("conditions", []))
            ]  # fmt: skip
            return len(ready) == len(PROCESS_NODES) + len(SIMULATED_NODES)

        eventually(all_ready, timeout=60, interval=0.5, what="the test kubelet's nodes Ready")

    def install_operator_rbac(self) -> None:
        """The operator's identity, from the same manifest people deploy."""
        self.cp.kubectl("apply", "-f", str(ROOT / "deploy" / "operator-rbac.yaml"))
        self.cp.kubectl("apply", "-f", str(ROOT / "deploy" / "operator-leader-election.yaml"))
        token = self.cp.kubectl(
            "create", "token", "phalanx-operator", "-n", "phalanx-system", "--duration=4h"
        ).strip()
        self.operator_kubeconfig = write_kubeconfig(
            self.cp.state_dir / "operator.kubeconfig", server=self.cp.server, ca=self.cp.ca, token=token
        )

    def start_operator(self) -> None:
        if not self.operator_http:  # kept across restarts: tests scrape the same address
            self.operator_http = f"127.0.0.1:{free_port()}"
        self.operator_starts += 1
        self.operator = self.spawn_operator(self.operator_http, log="operator.log")
        (self.cp.state_dir / "operator.pid").write_text(str(self.operator.pid))

    def spawn_operator(
        self, http: str, *, log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """One operator replica (they elect a leader on the Lease phalanx-system/phalanx-operator); ``env``
        adds to or overrides its environment."""
        environment = {
            **os.environ,
            "KUBECONFIG": str(self.operator_kubeconfig),
            "PHALANX_OPERATOR_RECONCILE_INTERVAL_S": "1",
            # Its /healthz and /metrics; a fixed port would clash with a second cluster on this machine.
            "PHALANX_OPERATOR_HTTP_PORT": http.rsplit(":", 1)[1],
            "PHALANX_OPERATOR_LEASE_NAMESPACE": "phalanx-system",
            **self.extra_env,
            **(env or {}),
        }
        environment.pop("KUBERNETES_SERVICE_HOST", None)
        return _spawn(
            [sys.executable, "-m", "phalanx", "operator"], log=self.cp.state_dir / log, env=environment
        )

    def power_off(self, node: str) -> None:
        """One process node's machine dies (see the test kubelet's docstring): its Pods' processes are
        killed and its Lease goes stale; the other nodes run on."""
        self._power(node, "off")

    def power_on(self, node: str) -> None:
        """A node :meth:`power_off` killed boots again, empty."""
        self._power(node, "on")

    def _power(self, node: str, state: str) -> None:
        if node not in PROCESS_NODES:
            raise ValueError(f"{node} is not one of the process nodes {PROCESS_NODES}")
        power = self.kubelet_dir / "power"
        power.mkdir(exist_ok=True)
        (power / node).write_text(state)
        applied = power / f"{node}.applied"
        self.wait_for(
            f"the test kubelet to power {node} {state}",
            lambda: applied.exists() and applied.read_text() == state,
            timeout=30,
            interval=0.1,
        )

    def kill_operator(self) -> None:
        _stop(self.operator, sig=signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.operator, timeout=3)  # it hands its Lease over; nothing else to flush
        _stop(self.kubelet)

    # --- helpers for tests -------------------------------------------------------------------------
    def get_json(self, *args: str) -> Any:
        return self.cp.get(*args)

    def pod_pid(self, namespace: str, name: str) -> int:
        """OS process id of a Pod's container process (the test kubelet's sandbox records it)."""
        matches = sorted(
            (self.kubelet_dir / "pods").glob(f"{namespace}_{name}_*/pid"), key=lambda p: p.stat().st_mtime
        )
        if not matches:
            raise LookupError(f"no process for {namespace}/{name}")
        return int(matches[-1].read_text())

    def wait_for(self, what: str, predicate: Any, *, timeout: float, interval: float = 0.5) -> Any:
        return eventually(predicate, timeout=timeout, what=what, interval=interval, diagnose=self.diagnostics)

    def diagnostics(self) -> str:
        out = [self.cp.kubectl("get", "ej,pods", "-A", "-o", "wide", check=False)]
        op_log = self.cp.state_dir / "operator.log"
        if op_log.exists():
            out.append("--- operator.log (tail)\n" + op_log.read_text(errors="replace")[-3000:])
        kl = self.cp.state_dir / "kubelet.log"
        if kl.exists():
            out.append("--- kubelet.log (tail)\n" + kl.read_text(errors="replace")[-2000:])
        return "\n".join(out)
