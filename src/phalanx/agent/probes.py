"""Health probes the master asks a node to run (``ACTION_KIND_RUN_PROBE``).

:func:`plan` is the pure decision (which probe program, with which arguments and time limit, or why
none can run); :class:`ProbeExecutor` runs the plan through
:func:`phalanx.diagnostics.probe_runner.run_probe` on a background thread, so heartbeats and worker
monitoring never wait for a probe, and sends the measurements with ``ReportProbe``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from phalanx.agent.client import MasterClient
from phalanx.api.errors import TransportError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import probe_runner

MATMUL_SECONDS = 2.0  # long enough for a stable TFLOP/s figure, short enough to run between rounds
MATMUL_TIMEOUT_S = 120.0  # includes importing torch and initialising the devices
ALLGATHER_SECONDS = 2.0
ALLGATHER_PEER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProbePlan:
    """One probe run: the program's name and arguments and the runner's time limit, or ``error`` when
    the action cannot be carried out (reported as a failed measurement)."""

    kind: probe_runner.ProbeName | None
    args: list[str]
    timeout_s: float
    error: str = ""


def plan(action: pb.Action, *, node_id: str) -> ProbePlan:
    """What to run for a RUN_PROBE action (pure)."""
    if action.probe == pb.PROBE_KIND_MATMUL:
        return ProbePlan("matmul", probe_runner.matmul_args(seconds=MATMUL_SECONDS), MATMUL_TIMEOUT_S)
    if action.probe == pb.PROBE_KIND_ALLGATHER:
        group = list(action.probe_group)
        if node_id not in group:
            return ProbePlan(None, [], 0.0, error=f"node {node_id} is not in the probe group {group}")
        if not action.probe_store_addr or action.probe_store_port <= 0:
            return ProbePlan(None, [], 0.0, error="the all-gather probe needs a store address and port")
        args = probe_runner.allgather_args(
            rank=group.index(node_id),
            node_ids=group,
            store_host=action.probe_store_addr,
            store_port=action.probe_store_port,
            seconds=ALLGATHER_SECONDS,
            timeout_s=ALLGATHER_PEER_TIMEOUT_S,
        )
        timeout = probe_runner.allgather_timeout_s(
            seconds=ALLGATHER_SECONDS, timeout_s=ALLGATHER_PEER_TIMEOUT_S
        )
        return ProbePlan("allgather", args, timeout)
    return ProbePlan(None, [], 0.0, error=f"unknown probe kind {int(action.probe)}")


class ProbeExecutor:
    """Runs probes one at a time in the background and reports their measurements to the master."""

    def __init__(
        self,
        *,
        client: MasterClient,
        node_id: str,
        incarnation: str,
        env: Mapping[str, str],
        say: Callable[[str], None],
        python: str = sys.executable,
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.incarnation = incarnation
        self.env = dict(env)
        self.say = say
        self.python = python
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        """The running probe's process, for :meth:`stop`."""
        self.last_report: pb.ReportProbeRequest | None = None

    def start(self, action: pb.Action) -> threading.Thread | None:
        """Starts the probe of ``action`` on a background thread; None (logged) when one still runs: the
        master repeats a probe it gets no answer to."""
        if self._thread is not None and self._thread.is_alive():
            self.say("probe requested while another probe runs; ignored")
            return None
        self._thread = threading.Thread(target=self.run, args=(action,), name="phalanx-probe", daemon=True)
        self._thread.start()
        return self._thread

    def run(self, action: pb.Action) -> pb.ReportProbeRequest:
        """Runs the probe of ``action`` to completion and reports it (blocking)."""
        p = plan(action, node_id=self.node_id)
        if p.kind is None:
            measurements = [probe_runner.Measurement(ok=False, error=p.error)]
        else:
            self.say(f"running the {p.kind} probe (probe round {action.probe_round})")
            measurements = probe_runner.run_probe(
                kind=p.kind,
                python=self.python,
                args=p.args,
                timeout_s=p.timeout_s,
                env=self.env,
                started=self._started,
            )
        request = pb.ReportProbeRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            probe=action.probe,
            measurements=probe_runner.to_proto(measurements),
            probe_round=action.probe_round,
        )
        failed = [m.error for m in measurements if not m.ok]
        summary = ", ".join(f"{m.rate:.3g}" for m in measurements if m.ok)
        self.say(
            f"probe done: {len(measurements) - len(failed)} ok (rates {summary or '-'}), failed: {failed}"
        )
        with contextlib.suppress(TransportError):
            self.client.report_probe(request)
        self.last_report = request
        return request

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    def stop(self) -> None:
        """Kills a running probe (the agent is leaving): in a session of its own, it would outlive the agent
        and, blocked in a collective with peers that left too, hold the node's resources for nothing."""
        if self._proc is not None:
            probe_runner.stop(self._proc)

    def join(self, timeout_s: float) -> None:
        """Waits for a running probe (for shutdown and tests)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
