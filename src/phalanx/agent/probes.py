"""Health probes the master asks a node to run (``ACTION_KIND_RUN_PROBE``).

:func:`plan` is the pure decision (which probe program, with which arguments and time limit, or why
none can run); :class:`ProbeExecutor` runs the plan on a background thread, so heartbeats and worker
monitoring never wait for a probe, and sends the measurements with ``ReportProbe``. A probe is forked from
the node's warm probe server (:mod:`phalanx.diagnostics.warm_probes`), which has imported torch already,
or, with warm probes off or no server to take it, started cold
(:func:`phalanx.diagnostics.probe_runner.run_probe`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from phalanx.agent.client import MasterClient
from phalanx.api import auth
from phalanx.api.errors import TransportError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import probe_runner
from phalanx.diagnostics.warm_probes import ForkServer, WarmProbes

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
    """Runs probes in the background, one at a time, and reports their measurements to the master.

    A probe round sends one RUN_PROBE per kind at once (the matmul, then the all-gather); they are queued and
    run in that order, since two probes at once would each measure the other. A probe of a newer round
    ends what is left of older ones, queued or running: the master has closed those rounds and ignores
    their reports, and a stale all-gather may wait half a minute for a peer that is gone.
    """

    def __init__(
        self,
        *,
        client: MasterClient,
        node_id: str,
        incarnation: str,
        env: Mapping[str, str],
        say: Callable[[str], None],
        python: str = sys.executable,
        warm: bool = True,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.incarnation = incarnation
        self.env = dict(env)
        self.say = say
        self.python = python
        self._lock = threading.Lock()
        self._queue: deque[pb.Action] = deque()
        self._running: pb.Action | None = None
        self._thread: threading.Thread | None = None
        """The thread draining the queue; None once it has found the queue empty (under the lock)."""
        self._drainer: threading.Thread | None = None
        """The last such thread started, kept so that :meth:`join` can wait for its end."""
        self._kill: Callable[[], None] | None = None
        """Kills the running probe's process group, for :meth:`stop`."""
        self._warm = WarmProbes(python=python, env=self.env, fork=fork_server) if warm else None
        """The warm probe server, started at the first probe: later probes skip ``import torch``."""
        self._stopped = False
        self.last_report: pb.ReportProbeRequest | None = None

    def start(self, action: pb.Action) -> threading.Thread | None:
        """Queues the probe of ``action`` and returns the thread that runs the queue; None (logged) when
        that probe is already queued or running, or the executor has stopped."""
        with self._lock:
            if self._stopped:
                return None
            pending = [*self._queue, *([self._running] if self._running is not None else [])]
            if any(_same_probe(a, action) for a in pending):
                self.say(f"probe {_describe(action)} requested again while queued or running; ignored")
                return None
            stale = [a for a in self._queue if a.probe_round < action.probe_round]
            for a in stale:
                self._queue.remove(a)
            if self._running is not None and self._running.probe_round < action.probe_round:
                self.say(f"probe {_describe(self._running)} is stale: {_describe(action)} was requested")
                self._kill_running()
            self._queue.append(action)
            if self._thread is None:
                self._thread = self._drainer = threading.Thread(
                    target=self._drain, name="phalanx-probe", daemon=True
                )
                self._thread.start()
            return self._thread

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._stopped or not self._queue:
                    self._thread = None
                    stopped = self._stopped
                    break
                self._running = action = self._queue.popleft()
            try:
                self.run(action)
            finally:
                with self._lock:
                    self._running = None
                    self._kill = None
        if stopped and self._warm is not None:
            self._warm.close()  # after the killed probe's report: the server tells how it ended

    def run(self, action: pb.Action) -> pb.ReportProbeRequest:
        """Runs the probe of ``action`` to completion and reports it (blocking)."""
        p = plan(action, node_id=self.node_id)
        how = ""
        if p.kind is None:
            measurements = [probe_runner.Measurement(ok=False, error=p.error)]
        else:
            self.say(f"running the {p.kind} probe (probe round {action.probe_round})")
            measurements, how = self._measure(p.kind, p, store_key=self.client.store_key(probe_store(action)))
        request = pb.ReportProbeRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            probe=action.probe,
            measurements=probe_runner.to_proto(measurements),
            probe_round=action.probe_round,
        )
        failed = [m.error for m in measurements if not m.ok]
        summary = ", ".join(f"{m.rate:.3g}" for m in measurements if m.ok)
        ok = len(measurements) - len(failed)
        self.say(f"probe done{how}: {ok} ok (rates {summary or '-'}), failed: {failed}")
        with contextlib.suppress(TransportError):
            self.client.report_probe(request)
        self.last_report = request
        return request

    def _measure(
        self, kind: probe_runner.ProbeName, p: ProbePlan, *, store_key: str
    ) -> tuple[list[probe_runner.Measurement], str]:
        """The probe's measurements, and how it ran (for the log). ``store_key`` reaches the probe in its
        environment (:data:`auth.STORE_KEY_ENV`), never on its command line, which any user may read."""
        secret = {auth.STORE_KEY_ENV: store_key}
        if self._warm is not None:
            warm = self._warm.run(
                kind=kind, args=p.args, timeout_s=p.timeout_s, started=self._started, env=secret
            )
            if warm is not None:
                return warm, " (warm)"
        # Cold: warm processes are off, or no warm server could take the probe.
        cold = probe_runner.run_probe(
            kind=kind,
            python=self.python,
            args=p.args,
            timeout_s=p.timeout_s,
            env={**self.env, **secret},
            started=self._started,
        )
        return cold, " (cold)"

    def _started(self, kill: Callable[[], None]) -> None:
        with self._lock:
            self._kill = kill
            if self._stopped or self._running is None:  # stopped, or made stale, while it was starting
                kill()

    def _kill_running(self) -> None:
        """Kills the running probe (under the lock); :meth:`run` then reports it failed."""
        self._running = None
        if self._kill is not None:
            self._kill()

    def stop(self) -> None:
        """Drops the queue and kills a running probe (the agent is leaving): in a session of its own, it
        would outlive the agent and, blocked in a collective with peers that left too, hold the node's
        resources for nothing."""
        with self._lock:
            self._stopped = True
            self._queue.clear()
            self._kill_running()
            idle = self._thread is None
        if idle and self._warm is not None:
            self._warm.close()  # else the thread closes it once its probe has ended

    def join(self, timeout_s: float) -> None:
        """Waits until the queue has run and its thread has ended (for shutdown and tests). The thread lets
        go of ``_thread`` a moment before it ends, so the last one started is joined too."""
        deadline = time.monotonic() + timeout_s
        while (thread := self._thread or self._drainer) is not None and thread.is_alive():
            if (left := deadline - time.monotonic()) <= 0:
                return
            thread.join(min(left, 0.1))


def probe_store(action: pb.Action) -> str:
    """What a probe round's store key is derived from: its round and its store, unique within the job."""
    return f"probe/{action.probe_round}/{action.probe_store_addr}:{action.probe_store_port}"


def _same_probe(a: pb.Action, b: pb.Action) -> bool:
    return a.probe_round == b.probe_round and a.probe == b.probe


def _describe(action: pb.Action) -> str:
    try:
        kind = pb.ProbeKind.Name(action.probe).removeprefix("PROBE_KIND_").lower()
    except ValueError:  # a kind this agent does not know; plan() reports it
        kind = f"kind {int(action.probe)}"
    return f"{kind} of probe round {action.probe_round}"
