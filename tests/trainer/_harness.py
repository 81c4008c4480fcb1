"""A stand-in for the node agents: it plays their part of the regroup contract (src/phalanx/api/round.py).

Each "node" is a set of worker processes sharing one round file. The harness writes round files (fresh
store port every round, rank offsets in member order), starts workers with the agent's environment,
SIGKILLs nodes, and reads the JSON lines the workers log. Used by the trainer tests and by
benchmarks/regroup.py, so the trainer can be tested before ``phalanx-run`` supports regroup mode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.api import auth
from phalanx.api import round as round_file
from tests import torch_forks
from tests.eventually import eventually
from tests.trainer._procs import ROOT, free_port, worker_env

TRAIN = ROOT / "examples" / "gpt" / "train.py"
HARNESS_TOKEN = "harness-job-token-0123456789"  # a test job's token


class WorkerDied(AssertionError):
    """A worker exited with an error while the test waited for something else."""


@dataclass
class Node:
    node_id: str
    nproc: int
    folder: Path
    procs: list[torch_forks.Forked] = field(default_factory=list)
    generation: int = 0

    @property
    def round_path(self) -> Path:
        return self.folder / "round.json"

    def log_path(self, local_rank: int, generation: int | None = None) -> Path:
        gen = self.generation if generation is None else generation
        return self.folder / f"log-{local_rank}-{gen}.jsonl"


class Cluster:
    """Nodes of worker processes driven through round files, as the agents would."""

    def __init__(self, folder: Path, *, args: list[str], script: Path = TRAIN) -> None:
        self.folder = folder
        self.args = args
        self.script = script
        self.nodes: dict[str, Node] = {}
        self.round = 0
        self.members: list[str] = []
        self._held: dict[str, round_file.RoundInfo] = {}
        # One flash-checkpoint job per node: its own host and shared memory, as on separate machines.
        self.job = f"trainer-test-{os.getpid()}-{time.monotonic_ns()}"

    def checkpoint_job(self, node_id: str) -> str:
        """The flash-checkpoint job id of a node's workers (their host's socket and memory names)."""
        return f"{self.job}-{node_id}"

    def add(self, node_id: str, nproc: int = 1) -> Node:
        folder = self.folder / node_id
        folder.mkdir(parents=True, exist_ok=True)
        node = Node(node_id=node_id, nproc=nproc, folder=folder)
        self.nodes[node_id] = node
        return node

    def write_round(self, members: list[str], *, hold: tuple[str, ...] = ()) -> int:
        """Writes the next round to every member's round file; returns the round number.

        Members in ``hold`` get it only from :meth:`release`: an agent publishes a round once all its
        nodes have joined, so survivors need not wait inside a round for a joiner that is still starting.
        """
        self.round += 1
        port = free_port()
        world = sum(self.nodes[m].nproc for m in members)
        offset = 0
        joined = [m for m in members if m not in self.members]
        for index, m in enumerate(members):
            node = self.nodes[m]
            info = round_file.RoundInfo(
                round=self.round,
                group_rank=index,
                rank_offset=offset,
                world_size=world,
                local_world_size=node.nproc,
                store_host="127.0.0.1",
                store_port=port,
                members=list(members),
                joined=joined,
                # As an agent derives it from the job token: every key of the round's store under it.
                store_key=auth.store_key(HARNESS_TOKEN, f"round/{self.round}/127.0.0.1:{port}"),
            )
            if m in hold:
                self._held[m] = info
            else:
                round_file.write(node.round_path, info)
            offset += node.nproc
        self.members = list(members)
        return self.round

    def release(self) -> None:
        """Writes the held round files."""
        for m, info in self._held.items():
            round_file.write(self.nodes[m].round_path, info)
        self._held.clear()

    def announced(self, node_id: str) -> bool:
        """Whether every worker of the node called announce_regroup() (it is up and in the trainer)."""
        node = self.nodes[node_id]
        return all((node.folder / f"regroup-{lr}").exists() for lr in range(node.nproc))

    def start(self, node_id: str) -> None:
        node = self.nodes[node_id]
        node.generation += 1
        node.procs = []
        for lr in range(node.nproc):
            (node.folder / f"regroup-{lr}").unlink(missing_ok=True)
        for local_rank in range(node.nproc):
            env = worker_env(
                LOCAL_RANK=str(local_rank),
                PHALANX_ROUND_FILE=str(node.round_path),
                PHALANX_REGROUP_FILE=str(node.folder / f"regroup-{local_rank}"),
                PHALANX_CHECKPOINT_JOB=self.checkpoint_job(node_id),
                PHALANX_JOB_ID=self.job,  # as phalanx-run tells its workers: the job, whichever node
            )
            cmd = [sys.executable, str(self.script), *self.args, "--log-json", str(node.log_path(local_rank))]
            err = (node.folder / f"stderr-{local_rank}-{node.generation}.txt").open("wb")
            node.procs.append(torch_forks.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
            err.close()

    def kill(self, node_id: str) -> float:
        """SIGKILLs every worker of the node; returns the time of the kill (time.time())."""
        t = time.time()
        for proc in self.nodes[node_id].procs:
            proc.send_signal(signal.SIGKILL)
        for proc in self.nodes[node_id].procs:
            proc.wait()
        self.nodes[node_id].procs = []  # gone, as a lost node is; not a worker failure to report
        return t

    def records(
        self, node_id: str, local_rank: int = 0, generation: int | None = None
    ) -> list[dict[str, Any]]:
        path = self.nodes[node_id].log_path(local_rank, generation)
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being written right now
        return out

    def steps(self, node_id: str, local_rank: int = 0, generation: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records(node_id, local_rank, generation) if r["event"] == "step"]

    def last_step(self, node_id: str, local_rank: int = 0) -> int:
        steps = self.steps(node_id, local_rank)
        return int(steps[-1]["step"]) if steps else -1

    def wait(self, what: Callable[[], bool], *, timeout_s: float, label: str) -> None:
        """Waits for ``what``; fails at once when a worker dies, with the workers' stderr either way."""

        def reached() -> bool:
            if what():
                return True
            self.check_alive()
            return False

        try:
            eventually(reached, timeout=timeout_s, what=label, interval=0.02)
        except WorkerDied:
            raise  # its message carries the tail already
        except AssertionError as exc:
            self.dump_stacks()
            raise AssertionError(f"{exc}\n{self.stderr_tail(6000)}") from None

    def dump_stacks(self) -> None:
        """Has every live worker write its threads' stacks onto its stderr (see torch_forks), to say where
        a worker that made no progress is."""
        for node in self.nodes.values():
            for proc in node.procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def check_alive(self) -> None:
        for node in self.nodes.values():
            for proc in node.procs:
                code = proc.poll()
                if code not in (None, 0):
                    raise WorkerDied(f"worker of {node.node_id} exited {code}\n{self.stderr_tail()}")

    def exit_codes(self, node_id: str, *, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in self.nodes[node_id].procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired as exc:
                self.dump_stacks()
                raise AssertionError(f"{node_id} did not exit\n{self.stderr_tail(6000)}") from exc
        return codes

    def stderr_tail(self, chars: int = 1500) -> str:
        parts = []
        for node in self.nodes.values():
            for f in sorted(node.folder.glob("stderr-*.txt")):
                parts.append(f"--- {node.node_id}/{f.name}\n{f.read_text()[-chars:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for node in self.nodes.values():
            for proc in node.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if any("--ckpt-every" in a for a in self.args):
            # Local rank 0 started a detached host per node (it outlives the workers on purpose): stop it,
            # which unlinks the node's shared memory. Nodes that never started one just fail to connect.
            from phalanx.checkpoint import Checkpointer

            for node_id in self.nodes:
                Checkpointer(job_id=self.checkpoint_job(node_id), local_rank=1).close(stop_host=True)
