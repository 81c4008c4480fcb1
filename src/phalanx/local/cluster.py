"""``phalanx local``: a master and N node agents on this machine, evictions carried out, faults injected.

It plays the operator's part: it starts ``phalanx master`` and one ``phalanx-run`` per node (node ids
``node-0``, ``node-1``, ...), polls the master's HTTP API, kills evicted nodes and starts replacements
(new node ids) within a budget, injects the requested faults, shows live progress, and at the end
writes the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from phalanx.agent.checkpointing import node_socket_path, remove_node_segments
from phalanx.agent.env import beacon_path
from phalanx.agent.pool import SHM_DIR
from phalanx.api.errors import CheckpointError
from phalanx.checkpoint.protocol import HostClient
from phalanx.local import cpulimit, fabric, foldin, procs
from phalanx.local.cpulimit import CpuGroup
from phalanx.local.inject import HOST_KINDS, NETWORK_KINDS, SLOW_KINDS, UNNOTICED_KINDS, Injection
from phalanx.local.relay import Relay
from phalanx.local.report import FailureRecord, Summary, cause_of, recovery_action, table

POLL_S = 0.05
STOP_GRACE_S = 40.0  # SIGTERM to SIGKILL at the end of a run: the agents' workers' grace, then a persist


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    min_nodes: int
    max_nodes: int
    initial: int
    nproc_per_node: int
    script: str
    script_args: list[str]
    workdir: Path
    injections: list[Injection] = field(default_factory=list)
    summary_json: Path | None = None
    max_replacements: int = 3
    max_restarts: int = 3
    heartbeat_timeout_s: float | None = None
    agent_args: list[str] = field(default_factory=list)
    master_args: list[str] = field(default_factory=list)
    timeout_s: float = 3600.0
    replace_delay_s: float = 0.0
    """Time between an eviction and the start of its replacement (a Kubernetes Pod takes a while too)."""
    show_output: bool = False
    job_id: str = ""
    private_network: bool = False
    """Each node in a network namespace of its own (:mod:`phalanx.local.fabric`); slow-network implies it."""


class LocalCluster:
    def __init__(self, options: LocalOptions, *, out: TextIO = sys.stdout) -> None:
        self.o = options
        self.out = out
        self.job_id = options.job_id or f"local-{secrets.token_hex(3)}"
        self.workdir = options.workdir
        procs.private_dir(self.workdir)  # logs, state and token: owner-only
        self.token = secrets.token_hex(24)
        self.token_file = self.workdir / "token"
        self.token_file.unlink(missing_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:  # created 0600: never readable by others, not even for a moment
            f.write(self.token)
        master_args = [
            "--job-id", self.job_id, "--nodes", f"{options.min_nodes}:{options.max_nodes}",
            "--port", "0", "--http-port", "0", "--token-file", str(self.token_file),
            "--state", str(self.workdir / "master-state.json"), "--max-restarts", str(options.max_restarts),
            *options.master_args,
        ]  # fmt: skip
        if options.heartbeat_timeout_s is not None:
            master_args += ["--heartbeat-timeout", f"{options.heartbeat_timeout_s:g}"]
        self.master = procs.MasterProc(args=master_args, log=self.workdir / "master.log")
        self.nodes: dict[str, procs.NodeProc] = {}
        self.next_index = 0
        self.replacements = 0
        self.handled_evictions: set[str] = set()
        self.due_replacements: list[tuple[float, str]] = []
        self.pending: list[Injection] = list(options.injections)
        self.relays: dict[str, Relay] = {}
        """The nodes with network faults to come reach the master through a relay (node id -> relay), and so
        do all nodes on a private network."""
        self.fabric: fabric.Fabric | None = None
        self.nets: dict[str, fabric.NodeNet] = {}
        self.sockets: Path | None = None
        """Where the relays' Unix sockets are: a short path (a socket's path has at most 107 bytes)."""
        self.cpu_groups: dict[str, CpuGroup] = {}
        self.due_heals: list[tuple[float, Injection]] = []
        self.summary = Summary(job_id=self.job_id)
        self.t0 = 0.0
        self.t0_unix_ns = 0
        self.events_seq = 0
        self.events: list[dict[str, Any]] = []
        self.job: dict[str, Any] = {}
        self.max_step = -1
        self.last_status = ""
        self.last_status_at = 0.0
        self.master_down_since: float | None = None
        self.http: httpx.Client | None = None

    # -------------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():7.2f}s] {text}", file=self.out, flush=True)

    def _agent_argv(self, node_id: str) -> list[str]:
        o = self.o
        relay = self.relays.get(node_id)
        endpoint = relay.address if relay is not None else self.master.grpc_addr
        net = self.nets.get(node_id)
        return [
            sys.executable, "-m", "phalanx.cli.run",
            "--nnodes", f"{o.min_nodes}:{o.max_nodes}", "--nproc-per-node", str(o.nproc_per_node),
            "--rdzv-endpoint", endpoint, "--rdzv-id", self.job_id, "--node-id", node_id,
            "--token-file", str(self.token_file), "--log-dir", str(self.workdir / node_id),
            "--max-restarts", str(o.max_restarts), "--local-addr", net.address if net else "127.0.0.1",
            *o.agent_args,
            o.script, *o.script_args,
        ]  # fmt: skip

    def start_node(self) -> procs.NodeProc:
        index = self.next_index
        self.next_index += 1
        node_id = f"node-{index}"
        targeted = {inj.kind for inj in self.pending if inj.node == index}
        env = dict(os.environ)
        env.pop("PHALANX_TOKEN_FILE", None)
        if self.fabric is not None:
            self.nets[node_id] = self.fabric.add_node(index)
            env["GLOO_SOCKET_IFNAME"] = fabric.IFNAME  # the host name resolves to loopback in there
        if self.fabric is not None or targeted & set(NETWORK_KINDS):
            unix_path = self.sockets / f"{node_id}.sock" if self.sockets is not None else None
            self.relays[node_id] = relay = Relay(self.master.grpc_addr, unix_path=unix_path)
            relay.start()
        procs.private_dir(self.workdir / node_id)  # the agent's --log-dir: the workers' logs
        argv = self._agent_argv(node_id)
        if "slow-cpu" in targeted:
            self.cpu_groups[node_id] = group = CpuGroup(f"phalanx-{self.job_id}-{node_id}")
            argv = group.wrap(argv)
        if node_id in self.nets:
            argv = self.nets[node_id].enter(argv)
        node = procs.start_node(
            index=index,
            node_id=node_id,
            argv=argv,
            log=self.workdir / f"{node_id}.log",
            env=env,
            now=self.elapsed(),
        )
        self.nodes[node_id] = node
        return node

    def kill_node(self, node: procs.NodeProc) -> None:
        procs.kill_tree(node.proc.pid)
        node.proc.wait()
        node.killed = True
        self._release(node)

    def _release(self, node: procs.NodeProc) -> None:
        """Gives back what the node ran in: its network namespace and its cgroup (its processes are gone).
        Removing either kills the node's checkpoint host too, so its shared memory is released here."""
        confined = False
        if self.fabric is not None and self.nets.pop(node.node_id, None) is not None:
            self.fabric.remove_node(node.index)
            confined = True
        group = self.cpu_groups.pop(node.node_id, None)
        if group is not None:
            group.remove()
            confined = True
        if confined:
            remove_node_segments(SHM_DIR, job_id=self.job_id, node_id=node.node_id)

    def stop_nodes(self) -> None:
        """Ends the nodes still running as Kubernetes ends Pods: SIGTERM, on which each agent persists its
        newest in-memory checkpoint (so a run stopped by --timeout or Ctrl-C resumes from there with the
        same checkpoint directory), then SIGKILL for whatever still runs after :data:`STOP_GRACE_S` or at
        a second Ctrl-C. The master stays up meanwhile: the nodes settle their step with it."""
        alive = [node for node in self.nodes.values() if node.alive]
        for node in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        try:
            for node in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(max(0.0, deadline - time.monotonic()))
        finally:
            for node in alive:
                self.kill_node(node)  # the leftovers of those that exited, all of those that did not

    # -------------------------------------------------------------------------------------------------
    # observation

    def _get(self, path: str) -> Any:
        assert self.http is not None
        resp = self.http.get(path)
        resp.raise_for_status()
        return resp.json()

    def _poll_master(self) -> bool:
        try:
            self.job = self._get("/v1/job")
            batch = self._get(f"/v1/events?since={self.events_seq}")
        except (httpx.HTTPError, ValueError):
            if self.master_down_since is None:
                self.master_down_since = self.elapsed()
            return False
        if self.master_down_since is not None:
            self.master_down_since = None
            self.say("master answers again")
        for f in self.summary.failures:
            # For a master kill, "detected" is when the restarted master serves the job again.
            if f.kind == "kill-master" and f.detected_at is None:
                f.detected_at = self.elapsed()
        items = batch.get("events", batch) if isinstance(batch, dict) else batch
        for ev in items:
            self.events_seq = max(self.events_seq, int(ev.get("seq", 0)))
            event = {**ev, "at": self.elapsed()}
            self.events.append(event)
            self._on_event(event)
        return True

    def _on_event(self, ev: dict[str, Any]) -> None:
        kind, node = ev.get("kind", ""), ev.get("node", "")
        text = f"{kind:<18} {node:<8} {ev.get('message', '')}".rstrip()
        self.say(f"event {text}")
        if kind in ("failure", "node_disconnected", "node_lost", "hang", "eviction_requested", "slow_steps"):
            f = cause_of(self.summary.failures, node=node, at=ev["at"])
            if f is not None:
                f.detected_at = ev["at"]
                if kind == "eviction_requested":
                    f.action = f"evicted {node}"
        if kind == "round_open":
            for f in self.summary.failures:
                if f.fold_in is not None:
                    foldin.round_opened(f.fold_in, at=ev["at"], reason=str(ev.get("message", "")))

    def _steps(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """(node id, local rank) -> (step, unix_ns, pid) of every live node's workers."""
        out = {}
        for node in self.nodes.values():
            if not node.alive:
                continue
            for lr in range(self.o.nproc_per_node):
                b = procs.read_beacon(
                    beacon_path(shm_dir=SHM_DIR, job_id=self.job_id, node_id=node.node_id, local_rank=lr)
                )
                if b is not None:
                    out[(node.node_id, lr)] = (b.step, b.unix_ns, b.pid)
        return out

    def _track_recovery(self, steps: dict[tuple[str, int], tuple[int, int, int]]) -> None:
        round_now = int(self.job.get("round", 0) or 0)
        for f in self.summary.failures:
            if f.recovered_at is not None:
                continue
            if f.kind in UNNOTICED_KINDS and f.detected_at is None:
                continue  # the job did not notice the fault: there is nothing to recover from
            # Recovery means a step completed by the recovered job: after a new round formed (workers
            # restarted), or, for a master kill, after the master answers again (workers never stopped).
            if f.kind == "kill-master":
                if f.detected_at is None:
                    continue
                since_ns = self.t0_unix_ns + int(f.injected_at * 1e9)
            else:
                if round_now <= f.round_at_injection or self.job.get("phase") != "Running":
                    continue
                if f.recovery_round_seen_ns == 0:
                    f.recovery_round_seen_ns = time.time_ns()
                since_ns = f.recovery_round_seen_ns
            fresh = [s for (s, ns, _) in steps.values() if ns > since_ns and s >= 0]
            if not fresh:
                continue
            if f.kind != "kill-master":
                running = {f"{n}/{lr}": pid for (n, lr), (_, _, pid) in steps.items() if _running(pid)}
                world = int(self.job.get("world_size", 0) or 0)
                f.recovery = recovery_action(
                    survivors=f.survivors, running=running, world=world, round_=round_now
                )
            f.resumed_step = min(fresh)
            f.recovered_at = self.elapsed()
            f.steps_lost = max(0, f.step_at_injection - f.resumed_step + 1)
            self.say(
                f"recovered from {f.kind} on {f.node}: step {f.resumed_step} completed "
                f"{f.recovered_at - f.injected_at:.2f}s after the fault, {f.steps_lost} steps lost"
            )

    # -------------------------------------------------------------------------------------------------
    # actions

    def _inject(self, steps: dict[tuple[str, int], tuple[int, int, int]]) -> None:
        for inj in list(self.pending):
            target = f"node-{inj.node}"
            if inj.kind == "kill-master":
                step = self.max_step
            else:
                step = steps.get((target, inj.rank), (-1, 0, 0))[0]
            if not inj.due(step=step, elapsed_s=self.elapsed()):
                continue
            node = self.nodes.get(target)
            if inj.kind != "kill-master" and (node is None or not node.alive):
                continue
            pid = steps.get((target, inj.rank), (-1, 0, 0))[2]
            if inj.kind in ("kill-worker", "hang-worker") and pid <= 0:
                continue
            self.pending.remove(inj)
            record = FailureRecord(
                kind=inj.kind,
                node=target if inj.kind != "kill-master" else "master",
                rank=inj.rank if inj.kind in ("kill-worker", "hang-worker") else -1,
                injected_at=self.elapsed(),
                step_at_injection=_job_step(steps, fallback=self.max_step),
                round_at_injection=int(self.job.get("round", 0) or 0),
                survivors={
                    f"{n}/{lr}": pid
                    for (n, lr), (_, _, pid) in steps.items()
                    if n != target or (inj.kind in ("kill-worker", "hang-worker") and lr != inj.rank)
                },
            )
            if inj.kind == "kill-worker":
                os.kill(pid, 9)
                what = f"SIGKILL worker pid {pid} (local rank {inj.rank})"
            elif inj.kind == "hang-worker":
                os.kill(pid, 19)
                what = f"SIGSTOP worker pid {pid} (local rank {inj.rank})"
            elif inj.kind == "kill-node":
                assert node is not None
                self.kill_node(node)
                what = "SIGKILL agent and workers"
            elif inj.kind in NETWORK_KINDS:
                what = self._net_fault(inj, target)
            elif inj.kind in SLOW_KINDS:
                what = self._slow_fault(inj, target)
            elif inj.kind in HOST_KINDS:
                what, record.host_pid = self._host_fault(inj, target)
            else:
                self.master.kill()
                what = "SIGKILL master"
            self.summary.failures.append(record)
            self.say(f"INJECT {inj.kind} on {record.node} at step {self.max_step}: {what}")
            if inj.kind == "kill-master":
                self.master.start()
                record.action = "master restarted on the same state"
                self.say(f"master restarted at {self.master.grpc_addr}")

    def _host_pid(self, node_id: str, *, timeout_s: float = 5.0) -> int:
        """The pid of the node's checkpoint host; raises CheckpointError when none answers."""
        socket_path = node_socket_path(job_id=self.job_id, node_id=node_id)
        with contextlib.closing(HostClient(str(socket_path), timeout_s=2.0)) as client:
            return int(client.call({"op": "ping"}, timeout_s=timeout_s)["pid"])

    def _host_fault(self, inj: Injection, node_id: str) -> tuple[str, int]:
        try:
            pid = self._host_pid(node_id)
        except CheckpointError as exc:
            return f"nothing: the node has no checkpoint host to fault ({exc})", 0
        if inj.kind == "kill-checkpoint-host":
            os.kill(pid, signal.SIGKILL)
            return f"SIGKILL checkpoint host pid {pid}", pid
        os.kill(pid, signal.SIGSTOP)
        return f"SIGSTOP checkpoint host pid {pid}", pid

    def _track_host_faults(self) -> None:
        """A host fault is over when another host answers on the node's socket (the agent replaced it);
        the job itself is not meant to notice."""
        for f in self.summary.failures:
            if f.kind not in HOST_KINDS or not f.host_pid or f.recovered_at is not None:
                continue
            try:
                pid = self._host_pid(f.node, timeout_s=0.2)
            except CheckpointError:
                continue  # none yet, or the stopped one
            if pid != f.host_pid:
                f.detected_at = f.recovered_at = self.elapsed()
                f.action = f"replaced by its agent (pid {pid})"
                self.say(f"recovered from {f.kind} on {f.node}: {f.action}")

    def _net_fault(self, inj: Injection, node_id: str) -> str:
        relay = self.relays[node_id]
        if inj.kind == "delay-node":
            relay.latency_s = inj.latency_s
            what = f"{inj.latency_s * 1000:g} ms added each way on its link to the master"
        else:
            relay.cut()
            what = "link to the master cut"
        if inj.for_s is None:
            return what
        self.due_heals.append((self.elapsed() + inj.for_s, inj))
        return f"{what} for {inj.for_s:g}s"

    def _slow_fault(self, inj: Injection, node_id: str) -> str:
        if inj.kind == "slow-network":
            assert self.fabric is not None
            self.fabric.throttle(inj.node, rate_bit_s=inj.rate_bit_s)
            what = f"its network limited to {inj.rate_bit_s / 1e6:g} Mbit/s each way"
        else:
            self.cpu_groups[node_id].limit(inj.cpus)
            what = f"its processes capped at {inj.cpus:g} CPUs"
        if inj.for_s is None:
            return what
        self.due_heals.append((self.elapsed() + inj.for_s, inj))
        return f"{what} for {inj.for_s:g}s"

    def _heal(self) -> None:
        for due, inj in list(self.due_heals):
            if self.elapsed() < due:
                continue
            self.due_heals.remove((due, inj))
            node_id = f"node-{inj.node}"
            if inj.kind in SLOW_KINDS and node_id not in (
                self.nets if inj.kind == "slow-network" else self.cpu_groups
            ):
                continue  # the node was evicted meanwhile: there is nothing left to heal
            if inj.kind == "delay-node":
                self.relays[node_id].latency_s = 0.0
            elif inj.kind == "partition-node":
                self.relays[node_id].heal()
            elif inj.kind == "slow-network":
                assert self.fabric is not None
                self.fabric.unthrottle(inj.node)
            else:
                self.cpu_groups[node_id].unlimit()
            self.say(f"HEAL {inj.kind} on {node_id}")
            for f in reversed(self.summary.failures):
                if (f.kind, f.node) == (inj.kind, node_id) and f.healed_at is None:
                    f.healed_at = self.elapsed()
                    break

    def _carry_out_evictions(self) -> None:
        for ev in self.job.get("evictions", []) or []:
            node_id = ev.get("node_id", "")
            if not node_id or node_id in self.handled_evictions:
                continue
            self.handled_evictions.add(node_id)
            node = self.nodes.get(node_id)
            if node is not None:
                node.evicted = True
                if node.alive:
                    self.kill_node(node)
            for f in self.summary.failures:
                if f.node == node_id and "evicted" not in f.action:
                    f.action = f"evicted {node_id}" + (f" ({ev.get('reason')})" if ev.get("reason") else "")
            entry = {**ev, "at": round(self.elapsed(), 3)}
            if self.replacements < self.o.max_replacements:
                self.replacements += 1
                self.due_replacements.append((self.elapsed() + self.o.replace_delay_s, node_id))
                self.say(f"evicted {node_id} ({ev.get('reason', '')}); a replacement follows")
            else:
                self.say(f"evicted {node_id}; replacement budget ({self.o.max_replacements}) spent")
            self.summary.evictions.append(entry)

    def _start_replacements(self) -> None:
        for due, node_id in list(self.due_replacements):
            if self.elapsed() < due:
                continue
            self.due_replacements.remove((due, node_id))
            new = self.start_node()
            self.say(f"started {new.node_id} to replace {node_id}")
            for entry in self.summary.evictions:
                if entry.get("node_id") == node_id and "replacement" not in entry:
                    entry["replacement"] = new.node_id
            for f in self.summary.failures:
                if f.node == node_id and "replaced" not in f.action:
                    f.action += f", replaced by {new.node_id}"
                    f.fold_in = foldin.started(
                        node=new.node_id,
                        lost=node_id,
                        round_=int(self.job.get("round", 0) or 0),
                        members=self.job.get("members") or [],
                        world=int(self.job.get("world_size", 0) or 0),
                    )

    def _track_fold_ins(self, steps: dict[tuple[str, int], tuple[int, int, int]]) -> None:
        """Follows each fault's replacement until the job's first step with it (:mod:`.foldin`)."""
        folds = [
            f.fold_in for f in self.summary.failures if f.fold_in is not None and f.fold_in.folded_at is None
        ]
        if not folds:
            return
        by_rank = {key: (step, unix_ns) for key, (step, unix_ns, _) in steps.items()}
        for fold in folds:
            done = foldin.observe(
                fold,
                at=self.elapsed(),
                now_ns=time.time_ns(),
                round_=int(self.job.get("round", 0) or 0),
                members=self.job.get("members") or [],
                world=int(self.job.get("world_size", 0) or 0),
                running=self.job.get("phase") == "Running",
                steps=by_rank,
            )
            if done:
                self.say(
                    f"folded {fold.node} in: step {fold.resumed_step} completed {fold.cost_s or 0.0:.2f}s "
                    f"after round {fold.round} opened, {fold.steps_lost} steps lost"
                )

    def _status(self) -> None:
        j = self.job
        alive = [n.node_id for n in self.nodes.values() if n.alive]
        line = (
            f"step {self.max_step:>5} | {j.get('phase', '?'):<10} | round {j.get('round', '?')} | "
            f"world {j.get('world_size', '?')} | nodes {' '.join(alive)}"
        )
        if line != self.last_status and self.elapsed() - self.last_status_at >= 1.0:
            self.last_status, self.last_status_at = line, self.elapsed()
            self.say(line)

    # -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.t0 = time.monotonic()
        self.t0_unix_ns = time.time_ns()
        self.summary.started_unix = self.t0_unix_ns / 1e9
        if any(inj.kind == "slow-cpu" for inj in self.pending):
            cpulimit.check_privileges()
        if self.o.private_network or any(inj.kind == "slow-network" for inj in self.pending):
            fabric.check_privileges()
            self.sockets = Path(tempfile.mkdtemp(prefix="phx-"))
            self.fabric = fabric.Fabric()
        self.master.start()
        self.http = httpx.Client(
            base_url=f"http://{self.master.http_addr}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=2.0,
        )
        self.say(
            f"job {self.job_id}: master at {self.master.grpc_addr} (http {self.master.http_addr}); "
            f"starting {self.o.initial} nodes x {self.o.nproc_per_node} processes; logs in {self.workdir}"
        )
        try:
            for _ in range(self.o.initial):
                self.start_node()
            return self._loop()
        finally:
            self.stop_nodes()
            self.master.kill()
            for relay in self.relays.values():
                relay.close()
            for node in self.nodes.values():
                self._release(node)
            if self.fabric is not None:
                self.fabric.close()
            if self.sockets is not None:
                shutil.rmtree(self.sockets, ignore_errors=True)
            self.http.close()
            # Killed agents could not remove their beacons and interval rings.
            for pattern in ("beacon", "intervals"):
                for stale in SHM_DIR.glob(f"phalanx-{self.job_id}-*.{pattern}"):
                    stale.unlink(missing_ok=True)
            self._finish()

    def _loop(self) -> int:
        end_seen_at: float | None = None
        idle_since: float | None = None
        while True:
            up = self._poll_master()
            steps = self._steps()
            if steps:
                self.max_step = max(self.max_step, *(s for s, _, _ in steps.values()))
            self._track_recovery(steps)
            self._track_fold_ins(steps)
            self._track_host_faults()
            self._inject(steps)
            self._heal()
            if up:
                self._carry_out_evictions()
            self._start_replacements()
            if up:
                self._status()
            phase = self.job.get("phase", "")
            if phase in ("Succeeded", "Failed"):
                end_seen_at = end_seen_at if end_seen_at is not None else self.elapsed()
                if not any(n.alive for n in self.nodes.values()) or self.elapsed() - end_seen_at > 15.0:
                    self.summary.exit = "succeeded" if phase == "Succeeded" else "failed"
                    self.summary.reason = str(self.job.get("reason", ""))
                    return 0 if phase == "Succeeded" else 1
            if (
                not any(n.alive for n in self.nodes.values())
                and not self.pending
                and not self.due_replacements
            ):
                idle_since = idle_since if idle_since is not None else self.elapsed()
                if self.elapsed() - idle_since > 10.0:
                    self.summary.reason = (
                        "every node exited but the master did not report the job as finished"
                    )
                    return 1
            else:
                idle_since = None
            if self.elapsed() > self.o.timeout_s:
                self.summary.reason = f"timed out after {self.o.timeout_s:g}s"
                return 1
            time.sleep(POLL_S)

    def _finish(self) -> None:
        s = self.summary
        s.wall_seconds = self.elapsed()
        s.rounds = int(self.job.get("round", 0) or 0)
        max_step = self.job.get("max_step")
        s.steps_completed = max(self.max_step, int(max_step) if isinstance(max_step, int) else -1) + 1
        if not s.reason and self.job.get("reason"):
            s.reason = str(self.job["reason"])
        self.say("done")
        print(table(s), file=self.out, flush=True)
        if self.o.summary_json is not None:
            self.o.summary_json.write_text(json.dumps(s.to_json(), indent=2))


def _running(pid: int) -> bool:
    """Whether the process still exists (a beacon keeps the pid of a worker that has since died)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _job_step(steps: dict[tuple[str, int], tuple[int, int, int]], *, fallback: int) -> int:
    """The step every live rank has completed (the slowest rank's), ``fallback`` before any rank stepped."""
    stepped = [s for (s, _, _) in steps.values() if s >= 0]
    return min(stepped) if stepped else fallback
