"""The process fleet of ``phalanx local``: the master, the node agents, and what each node runs in (a relay
to the master, a network namespace, a cgroup), from their start to their release.

Node ids are ``node-0``, ``node-1``, ... in start order; a replacement gets a new one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

from phalanx.agent.checkpointing import remove_node_segments
from phalanx.agent.env import beacon_path
from phalanx.agent.pool import SHM_ROOT, worker_shm_dir
from phalanx.local import fabric, procs
from phalanx.local.cpulimit import CpuGroup
from phalanx.local.decide import Steps, node_id
from phalanx.local.inject import NETWORK_KINDS
from phalanx.local.options import LocalOptions
from phalanx.local.relay import Relay

STOP_GRACE_S = 40.0  # SIGTERM to SIGKILL at the end of a run: the agents' workers' grace, then a persist


class Fleet:
    def __init__(self, options: LocalOptions, *, job_id: str) -> None:
        self.o = options
        self.job_id = job_id
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
            "--exit-with-parent", *options.master_args,
        ]  # fmt: skip
        if options.heartbeat_timeout_s is not None:
            master_args += ["--heartbeat-timeout", f"{options.heartbeat_timeout_s:g}"]
        self.master = procs.MasterProc(args=master_args, log=self.workdir / "master.log")
        self.nodes: dict[str, procs.NodeProc] = {}
        self.next_index = 0
        self.relays: dict[str, Relay] = {}
        """The nodes with network faults to come reach the master through a relay (node id -> relay), and so
        do all nodes on a private network."""
        self.fabric: fabric.Fabric | None = None
        self.nets: dict[str, fabric.NodeNet] = {}
        self.sockets: Path | None = None
        """Where the relays' Unix sockets are: a short path (a socket's path has at most 107 bytes)."""
        self.cpu_groups: dict[str, CpuGroup] = {}

    def open_network(self) -> None:
        """Puts every node to come in a network namespace of its own (:mod:`phalanx.local.fabric`)."""
        fabric.check_privileges()
        self.sockets = Path(tempfile.mkdtemp(prefix="phx-"))
        self.fabric = fabric.Fabric()

    def alive(self) -> list[str]:
        """The ids of the nodes whose agent still runs."""
        return [n.node_id for n in self.nodes.values() if n.alive]

    def any_alive(self) -> bool:
        return any(n.alive for n in self.nodes.values())

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
            "--exit-with-parent", *o.agent_args,
            o.script, *o.script_args,
        ]  # fmt: skip

    def start_node(self, *, targeted: Collection[str], now: float) -> procs.NodeProc:
        """Starts the next node; ``targeted``: the kinds of the faults still to come on it, which decide
        what it runs in (a relay for a network fault, a cgroup for a slow CPU)."""
        index = self.next_index
        self.next_index += 1
        node = node_id(index)
        env = dict(os.environ)
        env.pop("PHALANX_TOKEN_FILE", None)
        if self.fabric is not None:
            self.nets[node] = self.fabric.add_node(index)
            env["GLOO_SOCKET_IFNAME"] = fabric.IFNAME  # the host name resolves to loopback in there
        if self.fabric is not None or set(targeted) & set(NETWORK_KINDS):
            unix_path = self.sockets / f"{node}.sock" if self.sockets is not None else None
            self.relays[node] = relay = Relay(self.master.grpc_addr, unix_path=unix_path)
            relay.start()
        procs.private_dir(self.workdir / node)  # the agent's --log-dir: the workers' logs
        argv = self._agent_argv(node)
        if "slow-cpu" in targeted:
            self.cpu_groups[node] = group = CpuGroup(f"phalanx-{self.job_id}-{node}")
            argv = group.wrap(argv)
        if node in self.nets:
            argv = self.nets[node].enter(argv)
        proc = procs.start_node(
            index=index, node_id=node, argv=argv, log=self.workdir / f"{node}.log", env=env, now=now
        )
        self.nodes[node] = proc
        return proc

    def kill_node(self, node: procs.NodeProc) -> None:
        procs.kill_tree(node.proc.pid)
        node.proc.wait()
        node.killed = True
        self.release(node)

    def release(self, node: procs.NodeProc) -> None:
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
            remove_node_segments(SHM_ROOT, job_id=self.job_id, node_id=node.node_id)

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

    def close(self) -> None:
        """After :meth:`stop_nodes`: the master, the relays, and what the nodes ran in go."""
        self.master.kill()
        for relay in self.relays.values():
            relay.close()
        for node in self.nodes.values():
            self.release(node)
        if self.fabric is not None:
            self.fabric.close()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Killed agents could not remove their beacons and interval rings."""
        for pattern in ("beacon", "intervals"):
            for stale in worker_shm_dir().glob(f"phalanx-{self.job_id}-*.{pattern}"):
                stale.unlink(missing_ok=True)

    def read_steps(self) -> Steps:
        """(node id, local rank) -> (step, unix_ns, pid) of every live node's workers."""
        out = {}
        shm_dir = worker_shm_dir()
        for node in self.nodes.values():
            if not node.alive:
                continue
            for lr in range(self.o.nproc_per_node):
                where = beacon_path(shm_dir=shm_dir, job_id=self.job_id, node_id=node.node_id, local_rank=lr)
                b = procs.read_beacon(where)
                if b is not None:
                    out[(node.node_id, lr)] = (b.step, b.unix_ns, b.pid)
        return out
