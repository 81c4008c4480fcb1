"""Fault injection of ``phalanx local``: the pending faults fired when due (:func:`~phalanx.local.decide.
should_inject`), the lasting ones healed when their time is up, and the checkpoint hosts' faults followed
until the agent replaced the host."""

from __future__ import annotations

import contextlib
import os
import signal

from phalanx.agent.checkpointing import node_socket_path
from phalanx.api import views
from phalanx.api.errors import CheckpointError
from phalanx.checkpoint.protocol import HostClient
from phalanx.local.console import Console
from phalanx.local.decide import Steps, failure_record, heal_is_moot, node_id, should_inject, split_due
from phalanx.local.fleet import Fleet
from phalanx.local.inject import HOST_KINDS, NETWORK_KINDS, SLOW_KINDS, Injection
from phalanx.local.report import FailureRecord


class Faults:
    def __init__(
        self, injections: list[Injection], *, fleet: Fleet, console: Console, failures: list[FailureRecord]
    ) -> None:
        self.pending: list[Injection] = list(injections)
        self.due_heals: list[tuple[float, Injection]] = []
        self.fleet = fleet
        self.console = console
        self.failures = failures
        """The summary's records: a fired fault is appended, a healed or replaced host marked."""

    def targeting(self, index: int) -> set[str]:
        """The kinds of the faults still to come on the node started ``index``-th."""
        return {inj.kind for inj in self.pending if inj.node == index}

    def inject(self, steps: Steps, *, max_step: int, job: views.JobView | None) -> None:
        """Fires every pending fault that is due."""
        fleet, say = self.fleet, self.console.say
        for inj in list(self.pending):
            target = node_id(inj.node)
            node = fleet.nodes.get(target)
            if not should_inject(
                inj,
                steps=steps,
                max_step=max_step,
                elapsed_s=self.console.elapsed(),
                node_alive=node is not None and node.alive,
            ):
                continue
            pid = steps.get((target, inj.rank), (-1, 0, 0))[2]
            self.pending.remove(inj)
            record = failure_record(
                inj,
                steps=steps,
                max_step=max_step,
                round_=job.round if job else 0,
                injected_at=self.console.elapsed(),
            )
            if inj.kind == "kill-worker":
                os.kill(pid, 9)
                what = f"SIGKILL worker pid {pid} (local rank {inj.rank})"
            elif inj.kind == "hang-worker":
                os.kill(pid, 19)
                what = f"SIGSTOP worker pid {pid} (local rank {inj.rank})"
            elif inj.kind == "kill-node":
                assert node is not None
                fleet.kill_node(node)
                what = "SIGKILL agent and workers"
            elif inj.kind in NETWORK_KINDS:
                what = self._net_fault(inj, target)
            elif inj.kind in SLOW_KINDS:
                what = self._slow_fault(inj, target)
            elif inj.kind in HOST_KINDS:
                what, record.host_pid = self._host_fault(inj, target)
            else:
                fleet.master.kill()
                what = "SIGKILL master"
            self.failures.append(record)
            say(f"INJECT {inj.kind} on {record.node} at step {max_step}: {what}")
            if inj.kind == "kill-master":
                fleet.master.start()
                record.action = "master restarted on the same state"
                say(f"master restarted at {fleet.master.grpc_addr}")

    def _host_pid(self, node: str, *, timeout_s: float = 5.0) -> int:
        """The pid of the node's checkpoint host; raises CheckpointError when none answers."""
        socket_path = node_socket_path(job_id=self.fleet.job_id, node_id=node)
        with contextlib.closing(HostClient(str(socket_path), timeout_s=2.0)) as client:
            return int(client.call({"op": "ping"}, timeout_s=timeout_s)["pid"])

    def _host_fault(self, inj: Injection, node: str) -> tuple[str, int]:
        try:
            pid = self._host_pid(node)
        except CheckpointError as exc:
            return f"nothing: the node has no checkpoint host to fault ({exc})", 0
        if inj.kind == "kill-checkpoint-host":
            os.kill(pid, signal.SIGKILL)
            return f"SIGKILL checkpoint host pid {pid}", pid
        os.kill(pid, signal.SIGSTOP)
        return f"SIGSTOP checkpoint host pid {pid}", pid

    def track_host_faults(self) -> None:
        """A host fault is over when another host answers on the node's socket (the agent replaced it);
        the job itself is not meant to notice."""
        for f in self.failures:
            if f.kind not in HOST_KINDS or not f.host_pid or f.recovered_at is not None:
                continue
            try:
                pid = self._host_pid(f.node, timeout_s=0.2)
            except CheckpointError:
                continue  # none yet, or the stopped one
            if pid != f.host_pid:
                f.detected_at = f.recovered_at = self.console.elapsed()
                f.action = f"replaced by its agent (pid {pid})"
                self.console.say(f"recovered from {f.kind} on {f.node}: {f.action}")

    def _lasting(self, inj: Injection, what: str) -> str:
        """A lasting fault with ``for=`` is healed that long from now."""
        if inj.for_s is None:
            return what
        self.due_heals.append((self.console.elapsed() + inj.for_s, inj))
        return f"{what} for {inj.for_s:g}s"

    def _net_fault(self, inj: Injection, node: str) -> str:
        relay = self.fleet.relays[node]
        if inj.kind == "delay-node":
            relay.latency_s = inj.latency_s
            what = f"{inj.latency_s * 1000:g} ms added each way on its link to the master"
        else:
            relay.cut()
            what = "link to the master cut"
        return self._lasting(inj, what)

    def _slow_fault(self, inj: Injection, node: str) -> str:
        if inj.kind == "slow-network":
            assert self.fleet.fabric is not None
            self.fleet.fabric.throttle(inj.node, rate_bit_s=inj.rate_bit_s)
            what = f"its network limited to {inj.rate_bit_s / 1e6:g} Mbit/s each way"
        else:
            self.fleet.cpu_groups[node].limit(inj.cpus)
            what = f"its processes capped at {inj.cpus:g} CPUs"
        return self._lasting(inj, what)

    def heal(self) -> None:
        """Heals the lasting faults whose time is up."""
        fleet = self.fleet
        for due, inj in split_due(self.due_heals, now=self.console.elapsed()):
            self.due_heals.remove((due, inj))
            node = node_id(inj.node)
            if heal_is_moot(inj, nets=fleet.nets, cpu_groups=fleet.cpu_groups):
                continue  # the node was evicted meanwhile: there is nothing left to heal
            if inj.kind == "delay-node":
                fleet.relays[node].latency_s = 0.0
            elif inj.kind == "partition-node":
                fleet.relays[node].heal()
            elif inj.kind == "slow-network":
                assert fleet.fabric is not None
                fleet.fabric.unthrottle(inj.node)
            else:
                fleet.cpu_groups[node].unlimit()
            self.console.say(f"HEAL {inj.kind} on {node}")
            for f in reversed(self.failures):
                if (f.kind, f.node) == (inj.kind, node) and f.healed_at is None:
                    f.healed_at = self.console.elapsed()
                    break
