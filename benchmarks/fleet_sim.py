"""Scale by simulation: the master's pure core driven by a simulated fleet of thousands of nodes.

The master's decisions (:class:`phalanx.master.job.Job`: rendezvous, membership, failure policy) are pure
functions of requests and an injected clock, so the real code runs here against a simulated fleet, days of
simulated time in seconds of CPU, with no sleeping. Reported:

* **rendezvous**: CPU time of the core for N nodes to register and join until the round is formed, and for
  every member's GetRendezvous answer (the membership each agent receives); for 1,000 and 4,096 nodes. Then
  the same over the real ``phalanx master`` process with 1,000 simulated agents over real gRPC (``--grpc``):
  wall time from the first registration until every agent holds the formed round.
* **decision latency per failure**: failures arrive at a published rate with a seeded mix of kinds (see
  :data:`KINDS`); per failure, the core's CPU time from the failure report (or, for a silent host, the tick
  that finds it lost) to the decision, and to the new round being formed (every survivor's heartbeat that
  carries REJOIN, its join, the spare's join; the echo reports of every survivor's ranks separately),
  p50/p99/max.
* **goodput**: the share of wall time that trains, per failure detection + re-form + restore + recompute,
  from phalanx's measured figures (``benchmarks/results/*.json``, each named in :func:`load_figures`) and a
  stated checkpoint interval, against the same failure schedule restarting the whole job as torchrun does.

What is simulated and what is not: between failures nothing reaches the master but heartbeats that change no
decision, so the simulation marks every live node heard at each simulated instant instead of sending
millions of them (``_heard``); around a failure every request the agents make goes through the real code.

    .venv/bin/python -m benchmarks.fleet_sim --days 7 --grpc-nodes 1000

``--grpc-baseline-src`` runs the real-master rendezvous against another source tree's master too (the code
before a change, its sources unpacked from git), alternating with this tree's, and reports the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.master.sim import failure_report

from phalanx.api.settings import MasterSettings, from_mapping
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import Job

RESULTS = Path(__file__).resolve().parent / "results"

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 419
"""Meta's Llama 3 report: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s, one every
~3.1 h; as a per-GPU MTTF, 54 x 24 x 16,384 / 419 = 50,677 h."""
LLAMA3_GPU_MTTF_H = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS


@dataclass(frozen=True)
class Kind:
    """A kind of fault, how it reaches the master, and its share of all faults."""

    name: str
    share: float
    path: str
    """``hardware``: the agent reports a hardware failure (Xid, ECC): the node is evicted and replaced.
    ``crash``: one rank dies (a software bug): the round restarts in place.
    ``hang``: a collective never completes (a link or switch down): the agent's hang detector reports it;
    the round restarts in place (a node is evicted at its second hang counted against it; a simulated hang
    carries no evidence that singles out a node, so it counts against none).
    ``silent``: the host dies without closing its connections (power, kernel): its heartbeat timeout."""


KINDS = (
    # The Llama 3 report's breakdown of the 419: GPU-related 58.7% (faulty GPU 30.1%, HBM3 17.2%, SRAM 4.5%,
    # GPU system processor 4.1%, ...); network switch and cable 8.4%, NIC and NCCL watchdog 1.7% each;
    # software bugs 12.9%; host (maintenance, PSU, CPU, memory, SSD, ...) the rest.
    Kind("gpu", 0.587, "hardware"),
    Kind("software", 0.129, "crash"),
    Kind("network", 0.118, "hang"),
    Kind("host", 0.166, "silent"),
)


# --------------------------------------------------------------------------------------------------------
# The failure schedule


@dataclass(frozen=True)
class Fault:
    at: float
    """Simulated seconds since the job started."""
    kind: str
    slot: int
    """Which member is hit: an index into the round's members (mod their count) when it arrives."""


def schedule(
    rng: random.Random, *, gpus: int, gpu_mttf_h: float, horizon_s: float, kinds: Sequence[Kind] = KINDS
) -> list[Fault]:
    """Failures of a fleet of ``gpus`` GPUs over ``horizon_s``: a Poisson process at ``gpus / MTTF`` and a
    kind drawn by its share (seeded: the same seed gives the same schedule)."""
    rate = gpus / (gpu_mttf_h * 3600.0)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            return faults
        kind = rng.choices([k.name for k in kinds], weights=[k.share for k in kinds])[0]
        faults.append(Fault(at=t, kind=kind, slot=rng.randrange(1 << 30)))


# --------------------------------------------------------------------------------------------------------
# The simulated fleet


def cpu() -> float:
    """CPU time of this thread: the core's own cost, not the other processes sharing the machine."""
    return time.thread_time()


@dataclass
class Outcome:
    """What the core did about one failure."""

    kind: str
    node: str
    at: float
    verdict: str
    """evict or restart (what the policy decided), as seen from the round that formed."""
    decided_after_s: float
    """Simulated seconds from the fault to the decision (the heartbeat timeout for a silent host; 0 where
    the agent reports: its detection is outside the master and comes from the measured figures)."""
    formed_after_s: float
    decision_cpu_s: float
    to_formed_cpu_s: float
    answers_cpu_s: float
    round: int
    world_size: int


@dataclass
class Fleet:
    """A job of ``nodes`` nodes with ``nproc`` ranks each, and ``spares`` registered spare nodes, driven
    through the real :class:`Job` with a simulated clock."""

    nodes: int
    nproc: int = 8
    spares: int = 4
    heartbeat_timeout_s: float = 10.0
    tick_s: float = 0.25
    """The master's tick (``phalanx.master.serve.server._tick_interval`` with the default settings)."""
    spare_join_s: float = 1.0
    """A spare joins within a heartbeat interval of the round opening."""
    rejoin_s: float = 0.05
    """Survivors rejoin a round this long after it opened (their held heartbeat answers at once)."""
    echoes: bool = False
    """Every surviving member reports its ranks' communication errors before it rejoins (the worst case:
    with NCCL a peer's death aborts every rank's collective). Off: the survivors' held heartbeats carry
    REJOIN first and their agents stop the workers (measured separately, see :func:`echo_worst_case`)."""
    start: float = 1_000_000.0
    job: Job = field(init=False)
    now: float = field(init=False)
    inc: dict[str, str] = field(init=False, default_factory=dict)
    spare_pool: list[str] = field(init=False, default_factory=list)
    dead: set[str] = field(init=False, default_factory=set)
    """Nodes whose agents are gone (evicted or crashed): they send nothing."""
    serial: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.now = self.start
        settings = from_mapping(
            MasterSettings,
            {
                "job_id": "fleet",
                "rendezvous": {"min_nodes": self.nodes, "max_nodes": self.nodes},
                "heartbeat": {"interval_s": 1.0, "timeout_s": self.heartbeat_timeout_s},
                # Days of failures: the budgets of a real job would be set for that; here they never run out.
                "restart": {"max_restarts": 1_000_000, "max_evictions": 1_000_000},
            },
        )
        self.job = Job(settings=settings, now=self.now)

    # -- agents' requests ------------------------------------------------------------------------------

    def _new_id(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}"

    def register(self, node: str) -> None:
        self.inc[node] = f"{node}-i1"
        req = pb.RegisterNodeRequest(
            job_id="fleet", node_id=node, incarnation=self.inc[node], host=node, nproc_per_node=self.nproc
        )
        self.job.register(req, now=self.now)

    def join(self, node: str) -> None:
        req = pb.JoinRendezvousRequest(
            node_id=node,
            incarnation=self.inc[node],
            nproc_per_node=self.nproc,
            store_host=node,
            store_port=29400,
            last_round=self.job.round_number,
        )
        self.job.join(req, now=self.now)

    def heartbeat(self, node: str) -> list[pb.Action]:
        req = pb.HeartbeatRequest(
            node_id=node, incarnation=self.inc[node], state=pb.NODE_STATE_RUNNING, round=self.job.round_number
        )
        return list(self.job.heartbeat(req, now=self.now).actions)

    def report(
        self,
        node: str,
        *,
        kind: pb.FailureKind.ValueType,
        cls: pb.FailureClass.ValueType,
        message: str,
        rank: int,
    ) -> pb.Action:
        req = failure_report(
            node,
            self.inc[node],
            self.job.round_number,
            kind=kind,
            cls=cls,
            message=message,
            rank=rank,
            now=self.now,
        )
        return self.job.report_failure(req, now=self.now)

    def answer_all(self) -> None:
        """Every member's GetRendezvous for the formed round (what each agent then receives)."""
        number = self.job.round_number
        for node in self.job.members:
            req = pb.GetRendezvousRequest(node_id=node, incarnation=self.inc[node], round=number)
            self.job.get_rendezvous(req, now=self.now)

    def _heard(self) -> None:
        """Every live agent heard now: stands for the heartbeats between decisions (see the module doc)."""
        for node in self.job.nodes.values():
            if node.node_id not in self.dead:
                node.last_seen = self.now

    # -- the job's life --------------------------------------------------------------------------------

    def form_first_round(self) -> dict[str, float]:
        """Registers the nodes and the spares, joins the nodes; CPU of each phase until the round forms."""
        members = [f"node-{i}" for i in range(self.nodes)]
        c0 = cpu()
        for node in members:
            self.register(node)
        c1 = cpu()
        for node in members:
            self.join(node)
        c2 = cpu()
        if self.job.round_number != 1:
            raise RuntimeError(f"the first round did not form with {self.nodes} nodes")
        self.answer_all()
        c3 = cpu()
        for _ in range(self.spares):
            self._add_spare()
        return {"register_cpu_s": c1 - c0, "join_to_formed_cpu_s": c2 - c1, "answers_cpu_s": c3 - c2}

    def _add_spare(self) -> None:
        node = self._new_id("spare")
        self.register(node)
        self.spare_pool.append(node)

    def advance(self, t: float) -> None:
        self.now = max(self.now, self.start + t)
        self._heard()
        self.job.tick(now=self.now)

    def inject(self, fault: Fault, *, answer: bool = True) -> Outcome:
        """Carries one fault through the core until the new round formed; returns what it did and cost
        (with ``answer``, also every member's GetRendezvous answer for the new round)."""
        self.advance(fault.at)
        members = self.job.members
        victim = members[fault.slot % len(members)]
        rank = (fault.slot % len(members)) * self.nproc
        fault_at = self.now
        before = self.job.round_number
        spent = 0.0
        path = next(k.path for k in KINDS if k.name == fault.kind)
        if path == "silent":
            self.dead.add(victim)
            decision = 0.0
            while not self.job.round_open:
                if self.now - fault_at > 10 * self.heartbeat_timeout_s:
                    raise RuntimeError(f"{victim} went silent and the master never noticed")
                self.now += self.tick_s
                self._heard()
                c0 = cpu()
                self.job.tick(now=self.now)
                decision = cpu() - c0
            spent = decision
        else:
            if path == "hardware":
                kind, cls, message = (
                    pb.FAILURE_KIND_WORKER_EXIT,
                    pb.FAILURE_CLASS_HARDWARE,
                    "Xid 79: GPU fell off",
                )
            elif path == "crash":
                kind, cls, message = (
                    pb.FAILURE_KIND_WORKER_EXIT,
                    pb.FAILURE_CLASS_USER,
                    "RuntimeError: bad batch",
                )
            else:
                kind, cls, message = pb.FAILURE_KIND_HANG, pb.FAILURE_CLASS_UNSPECIFIED, ""
            c0 = cpu()
            reply = self.report(victim, kind=kind, cls=cls, message=message, rank=rank)
            decision = cpu() - c0
            spent = decision
            if reply.kind == pb.ACTION_KIND_EXIT:
                self.dead.add(victim)
        decided_at = self.now
        # The survivors: their ranks' echoes, the REJOIN their next (held) heartbeat carries, their join.
        self.now += self.rejoin_s
        survivors = [m for m in members if m not in self.dead]
        first_rank = {node: i * self.nproc for i, node in enumerate(members)}
        c0 = cpu()
        if self.echoes:
            for node in survivors:
                if node != victim:
                    self.report(
                        node,
                        kind=pb.FAILURE_KIND_WORKER_EXIT,
                        cls=pb.FAILURE_CLASS_COMM,
                        message="DistBackendError: NCCL communicator was aborted",
                        rank=first_rank[node],
                    )
        for node in survivors:
            self.heartbeat(node)
            self.join(node)
        spent += cpu() - c0
        while self.job.round_number == before:
            if not self.spare_pool:
                raise RuntimeError("no spare left to replace an evicted node")
            self.now += self.spare_join_s
            self._heard()
            c0 = cpu()
            self.job.tick(now=self.now)
            if self.job.round_number == before:
                self.join(self.spare_pool.pop(0))
            spent += cpu() - c0
        formed_at = self.now
        answers = math.nan
        if answer:
            c0 = cpu()
            self.answer_all()
            answers = cpu() - c0
        while len(self.spare_pool) < self.spares:
            self._add_spare()  # a repaired or new machine takes the used spare's place
        joined = set(self.job.members)
        return Outcome(
            kind=fault.kind,
            node=victim,
            at=fault.at,
            verdict="evict" if victim not in joined else "restart",
            decided_after_s=decided_at - fault_at,
            formed_after_s=formed_at - fault_at,
            decision_cpu_s=decision,
            to_formed_cpu_s=spent,
            answers_cpu_s=answers,
            round=self.job.round_number,
            world_size=self.job.round.world_size if self.job.round else 0,
        )


# --------------------------------------------------------------------------------------------------------
# Goodput: the accounting


@dataclass(frozen=True)
class Figures:
    """Measured seconds each recovery path costs, with the file each comes from (see :func:`load_figures`)."""

    values: dict[str, float]
    sources: dict[str, str]

    def __getitem__(self, key: str) -> float:
        return self.values[key]


@dataclass(frozen=True)
class Cost:
    """The training time one failure costs, in seconds."""

    detect: float
    reform: float
    restore: float
    recompute: float

    @property
    def total(self) -> float:
        return self.detect + self.reform + self.restore + self.recompute


def phalanx_cost(
    outcome: Outcome, fig: Figures, *, interval_s: float, step_s: float, answers_s: float = 0.0
) -> Cost:
    """What a failure costs under phalanx's policy.

    Restart in place (a crash, a hang): every node keeps its flash checkpoint in memory, so the work lost is
    the step in flight (half a step on average); the measured kill-to-recovered time covers detection,
    re-form and restore from memory. A node lost (evicted GPU, dead host): the survivors re-form with a spare,
    whose shard comes from storage, so the work since the last persisted checkpoint is recomputed (half the
    interval on average). The master's own time at this scale (``to_formed_cpu_s`` and the members' answers;
    ``answers_s`` where this failure's were not measured) is added to the re-form.
    """
    answers = answers_s if math.isnan(outcome.answers_cpu_s) else outcome.answers_cpu_s
    master = outcome.to_formed_cpu_s + answers
    if outcome.verdict == "restart":
        detect = fig["hang_detect_s"] if outcome.kind == "network" else 0.0
        return Cost(
            detect=detect, reform=fig["restart_in_place_s"] + master, restore=0.0, recompute=step_s / 2
        )
    detect = outcome.decided_after_s if outcome.kind == "host" else 0.0
    return Cost(
        detect=detect,
        reform=fig["node_replaced_s"] + master,
        restore=fig["restore_from_storage_s"],
        recompute=interval_s / 2,
    )


def torchrun_cost(outcome: Outcome, fig: Figures, *, interval_s: float) -> Cost:
    """The same failure when the whole job restarts, as torchrun does: every worker restarts from the last
    saved checkpoint (half the interval recomputed, a restore from storage). A crash or a lost GPU's worker
    exits and is seen at once; a hang or a silent host is found only when the collective times out."""
    detect = fig["collective_timeout_s"] if outcome.kind in ("network", "host") else 0.0
    return Cost(
        detect=detect,
        reform=fig["torchrun_restart_s"],
        restore=fig["restore_from_storage_s"],
        recompute=interval_s / 2,
    )


def goodput(horizon_s: float, costs: Sequence[Cost], *, save_overhead: float) -> float:
    """Share of ``horizon_s`` that trains: what failures cost comes off, then the saves' stall (a fraction of
    the time that is left). Failures are taken one after another (one arriving during a recovery is rare at
    these rates: about one every 1.5 h against minutes of recovery)."""
    lost = min(horizon_s, sum(c.total for c in costs))
    return (horizon_s - lost) / horizon_s * (1.0 - save_overhead)


def load_figures(results: Path = RESULTS) -> Figures:
    """The measured figures the goodput model uses, each with its file."""

    def read(name: str) -> Any:
        return json.loads((results / name).read_text())

    recovery = read("recovery.json")
    shard = read("shard_loss.json")
    detection = read("recorder_overhead-detection.json")
    storage = read("checkpoint-storage.json")
    ckpt = read("checkpoint.json")
    hangs = [
        run[k]["detected_after_s"]
        for run in detection["detection"]
        for k in ("sigstop", "never_entered")
        if k in run
    ]
    values = {
        "restart_in_place_s": recovery["phalanx"]["median_recovery_s"],
        "node_replaced_s": shard["kill-node"]["median_recovered_s"],
        "hang_detect_s": statistics.median(hangs),
        "restore_from_storage_s": storage["local_disk"]["load_from_storage_s"],
        "phalanx_save_stall_s": ckpt["results"]["phalanx"]["in_training"]["threads_2"]["phalanx"]["stall_s"],
        "torchrun_restart_s": recovery["torchrun"]["median_recovery_s"],
        "torch_save_blocking_s": ckpt["results"]["torch_save_disk"]["blocking_s"],
        "collective_timeout_s": 600.0,
    }
    sources = {
        "restart_in_place_s": "recovery.json phalanx.median_recovery_s (worker SIGKILL to recovered)",
        "node_replaced_s": "shard_loss.json kill-node.median_recovered_s (node SIGKILL to training again)",
        "hang_detect_s": "recorder_overhead-detection.json detection[].*.detected_after_s (median)",
        "restore_from_storage_s": "checkpoint-storage.json local_disk.load_from_storage_s (0.5 GiB)",
        "phalanx_save_stall_s": "checkpoint.json results.phalanx.in_training.threads_2.phalanx.stall_s",
        "torchrun_restart_s": "recovery.json torchrun.median_recovery_s (worker SIGKILL to recovered)",
        "torch_save_blocking_s": "checkpoint.json results.torch_save_disk.blocking_s (1 GiB torch.save)",
        "collective_timeout_s": "not measured: torch.distributed's default NCCL timeout (10 min)",
    }
    return Figures(values=values, sources=sources)


def account(
    outcomes: Sequence[Outcome], fig: Figures, *, horizon_s: float, interval_s: float, step_s: float
) -> dict[str, Any]:
    """Goodput of phalanx and of whole-job restarts over the same failures, with the per-failure parts."""
    measured = [o.answers_cpu_s for o in outcomes if not math.isnan(o.answers_cpu_s)]
    typical = statistics.median(measured) if measured else 0.0
    ours = [phalanx_cost(o, fig, interval_s=interval_s, step_s=step_s, answers_s=typical) for o in outcomes]
    theirs = [torchrun_cost(o, fig, interval_s=interval_s) for o in outcomes]
    # phalanx saves every step into memory (its stall per step) and persists in the background; torchrun's
    # users save with torch.save every interval, blocking for it.
    ours_overhead = fig["phalanx_save_stall_s"] / step_s
    theirs_overhead = fig["torch_save_blocking_s"] / interval_s

    def parts(costs: Sequence[Cost]) -> dict[str, float]:
        return {
            f"{part}_s_mean": round(statistics.fmean(getattr(c, part) for c in costs), 3) if costs else 0.0
            for part in ("detect", "reform", "restore", "recompute", "total")
        }

    return {
        "phalanx": {
            "goodput": round(goodput(horizon_s, ours, save_overhead=ours_overhead), 5),
            "save_overhead": round(ours_overhead, 5),
            "lost_hours": round(sum(c.total for c in ours) / 3600, 3),
            **parts(ours),
        },
        "torchrun_whole_job": {
            "goodput": round(goodput(horizon_s, theirs, save_overhead=theirs_overhead), 5),
            "save_overhead": round(theirs_overhead, 5),
            "lost_hours": round(sum(c.total for c in theirs) / 3600, 3),
            **parts(theirs),
        },
    }


# --------------------------------------------------------------------------------------------------------
# The runs


def quantiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p99/max (milliseconds by default)."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return {}

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    return {
        "p50": round(pick(0.5) * scale, 3),
        "p99": round(pick(0.99) * scale, 3),
        "max": round(ordered[-1] * scale, 3),
    }


def rendezvous_core(nodes: int, runs: int) -> dict[str, Any]:
    """The pure core: ``nodes`` nodes register and join until the round forms (medians of ``runs``)."""
    samples = [Fleet(nodes=nodes, spares=0).form_first_round() for _ in range(runs)]
    out: dict[str, Any] = {k: round(statistics.median(s[k] for s in samples), 4) for k in samples[0]}
    out["register_and_join_to_formed_cpu_s"] = round(out["register_cpu_s"] + out["join_to_formed_cpu_s"], 4)
    out["runs"] = runs
    return out


def simulate(
    *,
    nodes: int,
    days: float,
    seed: int,
    gpu_mttf_h: float,
    answers_every: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Fleet, list[Outcome], list[Fault]]:
    """Every failure of the schedule through the core; the members' answers are measured on every
    ``answers_every``-th failure (they cost the same each round: N answers of N members)."""
    rng = random.Random(seed)
    faults = schedule(rng, gpus=nodes * 8, gpu_mttf_h=gpu_mttf_h, horizon_s=days * 86400)
    fleet = Fleet(nodes=nodes)
    fleet.form_first_round()
    outcomes = []
    for i, fault in enumerate(faults):
        outcomes.append(fleet.inject(fault, answer=i % answers_every == 0))
        if i % 20 == 0:
            progress(f"{i + 1}/{len(faults)} failures, round {fleet.job.round_number}")
    return fleet, outcomes, faults


def echo_worst_case(nodes: int) -> dict[str, Any]:
    """One failure of each reported kind where every surviving member also reports its ranks' communication
    errors: the master's CPU from the first report until the round formed."""
    fleet = Fleet(nodes=nodes, echoes=True)
    fleet.form_first_round()
    out = {}
    for i, kind in enumerate(("gpu", "software", "network")):
        o = fleet.inject(Fault(at=3600.0 * (i + 1), kind=kind, slot=17 * (i + 1)))
        out[kind] = {
            "verdict": o.verdict,
            "decision_cpu_ms": round(o.decision_cpu_s * 1000, 3),
            "to_formed_cpu_ms": round(o.to_formed_cpu_s * 1000, 1),
            "echo_reports": nodes - 1,
        }
    return out


def decision_report(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    by_kind: dict[str, Any] = {}
    for kind in sorted({o.kind for o in outcomes}):
        these = [o for o in outcomes if o.kind == kind]
        by_kind[kind] = {
            "failures": len(these),
            "verdicts": {
                v: sum(1 for o in these if o.verdict == v) for v in sorted({o.verdict for o in these})
            },
            "decision_cpu_ms": quantiles([o.decision_cpu_s for o in these]),
            "to_formed_cpu_ms": quantiles([o.to_formed_cpu_s for o in these]),
            "answers_cpu_ms": quantiles([o.answers_cpu_s for o in these]),
            "simulated_decided_after_s": quantiles([o.decided_after_s for o in these], scale=1.0),
            "simulated_formed_after_s": quantiles([o.formed_after_s for o in these], scale=1.0),
        }
    return {
        "failures": len(outcomes),
        "decision_cpu_ms": quantiles([o.decision_cpu_s for o in outcomes]),
        "to_formed_cpu_ms": quantiles([o.to_formed_cpu_s for o in outcomes]),
        "answers_cpu_ms": quantiles([o.answers_cpu_s for o in outcomes]),
        "by_kind": by_kind,
    }


# -- the real master over real gRPC ----------------------------------------------------------------------


def rendezvous_grpc(nodes: int, *, channels: int = 8, source: str = "") -> dict[str, Any]:
    """``nodes`` light agents (one asyncio process, ``channels`` connections) register, join and long-poll
    GetRendezvous on the real ``phalanx master`` (from ``source``, another tree's ``src``, when given);
    wall time until each holds the formed round."""
    import grpc

    from benchmarks.master_capacity import AUTH, cpu_seconds, start_master
    from phalanx.api.v1 import master_pb2_grpc as pb_grpc

    with tempfile.TemporaryDirectory() as tmp:
        proc, addr, _http = start_master(Path(tmp), nodes, cpu=0, source=source)
        try:

            async def run() -> dict[str, Any]:
                chans = [grpc.aio.insecure_channel(addr) for _ in range(channels)]
                stubs = [pb_grpc.MasterStub(c) for c in chans]
                gate = asyncio.Semaphore(128)
                registered: list[float] = []
                joined: list[float] = []
                formed: list[float] = []

                async def agent(i: int) -> None:
                    stub = stubs[i % channels]
                    node, inc = f"node-{i}", f"inc-{i}"
                    async with gate:
                        reg = pb.RegisterNodeRequest(
                            job_id="capacity", node_id=node, incarnation=inc, host="h", nproc_per_node=8
                        )
                        await stub.RegisterNode(reg, metadata=AUTH, timeout=60)
                        registered.append(time.perf_counter())
                        join = pb.JoinRendezvousRequest(
                            node_id=node, incarnation=inc, nproc_per_node=8, store_host="h", store_port=29400
                        )
                        number = (await stub.JoinRendezvous(join, metadata=AUTH, timeout=60)).round
                        joined.append(time.perf_counter())
                    while True:  # the agent's long-poll, outside the gate: every agent holds one
                        req = pb.GetRendezvousRequest(node_id=node, incarnation=inc, round=number, wait_s=20)
                        resp = await stub.GetRendezvous(req, metadata=AUTH, timeout=60)
                        if resp.status == pb.RENDEZVOUS_STATUS_COMPLETE:
                            if len(resp.members) != nodes:
                                raise RuntimeError(f"round of {len(resp.members)} members, not {nodes}")
                            formed.append(time.perf_counter())
                            return

                cpu0 = cpu_seconds(proc.pid)
                t0 = time.perf_counter()
                await asyncio.gather(*(agent(i) for i in range(nodes)))
                master_cpu = cpu_seconds(proc.pid) - cpu0
                for c in chans:
                    await c.close()
                return {
                    "nodes": nodes,
                    "all_registered_s": round(max(registered) - t0, 3),
                    "all_joined_s": round(max(joined) - t0, 3),
                    "all_hold_formed_round_s": round(max(formed) - t0, 3),
                    "master_cpu_s": round(master_cpu, 3),
                    "client": f"one asyncio process, {channels} channels, 128 registrations/joins in flight",
                }

            return asyncio.run(run())
        finally:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--days", type=float, default=7.0, help="simulated days of failures")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpu-mttf-h", type=float, default=LLAMA3_GPU_MTTF_H)
    parser.add_argument("--checkpoint-interval-min", type=float, default=30.0)
    parser.add_argument("--step-s", type=float, default=5.0, help="the training step time assumed")
    parser.add_argument("--rendezvous-sizes", default="1000,4096")
    parser.add_argument("--rendezvous-runs", type=int, default=3)
    parser.add_argument("--grpc-nodes", type=int, default=1000, help="0: skip the real master")
    parser.add_argument("--grpc-runs", type=int, default=3)
    parser.add_argument(
        "--grpc-baseline-src",
        default="",
        help="another source tree's src (the code before a change): its master's rendezvous runs alternate",
    )
    parser.add_argument("--grpc-baseline-label", default="", help="what the baseline is, for the JSON")
    parser.add_argument("--answers-every", type=int, default=10, help="measure the answers every Nth failure")
    parser.add_argument("--echo-nodes", type=int, default=1024, help="0: skip the echo worst case")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the core logs every decision; thousands of lines measure nothing here

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_at_start = os.getloadavg()[0]

    rendezvous = {}
    for size in (int(s) for s in args.rendezvous_sizes.split(",") if s):
        say(f"rendezvous of {size} nodes in the core")
        rendezvous[str(size)] = rendezvous_core(size, args.rendezvous_runs)

    say(f"simulating {args.days:g} days of {args.nodes} nodes")
    wall0 = time.perf_counter()
    fleet, outcomes, _faults = simulate(
        nodes=args.nodes,
        days=args.days,
        seed=args.seed,
        gpu_mttf_h=args.gpu_mttf_h,
        answers_every=args.answers_every,
        progress=say,
    )
    sim_wall = time.perf_counter() - wall0

    fig = load_figures()
    horizon = args.days * 86400
    scenarios = {}
    for minutes in sorted({10.0, 30.0, 60.0, args.checkpoint_interval_min}):
        scenarios[f"interval_{minutes:g}min"] = account(
            outcomes, fig, horizon_s=horizon, interval_s=minutes * 60, step_s=args.step_s
        )

    echo: dict[str, Any] = {}
    if args.echo_nodes:
        say(f"echo reports from every survivor, {args.echo_nodes} nodes")
        echo = {"nodes": args.echo_nodes, **echo_worst_case(args.echo_nodes)}

    grpc_result: dict[str, Any] = {}
    if args.grpc_nodes:
        # With a baseline, its runs alternate with this tree's, so both see the same drift of the machine.
        arms = {"": "this tree", **({args.grpc_baseline_src: "baseline"} if args.grpc_baseline_src else {})}
        samples: dict[str, list[dict[str, Any]]] = {source: [] for source in arms}
        for i in range(args.grpc_runs):
            for source, arm in arms.items():
                say(f"real master ({arm}): {args.grpc_nodes} agents over gRPC, run {i + 1}")
                try:
                    samples[source].append(rendezvous_grpc(args.grpc_nodes, source=source))
                except Exception as exc:  # a failed run is reported; the simulation stands
                    failed = {
                        "error": repr(exc),
                        "all_hold_formed_round_s": math.nan,
                        "master_cpu_s": math.nan,
                    }
                    samples[source].append(failed)

        def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "median_all_hold_formed_round_s": statistics.median(
                    s["all_hold_formed_round_s"] for s in runs
                ),
                "median_master_cpu_s": statistics.median(s["master_cpu_s"] for s in runs),
                "runs": runs,
            }

        grpc_result = {"nodes": args.grpc_nodes, **summary(samples[""])}
        if args.grpc_baseline_src:
            before = summary(samples[args.grpc_baseline_src])
            grpc_result["baseline"] = {"source": args.grpc_baseline_label or args.grpc_baseline_src, **before}
            grpc_result["vs_baseline"] = round(
                grpc_result["median_all_hold_formed_round_s"] / before["median_all_hold_formed_round_s"], 3
            )

    gpus = args.nodes * 8
    result = {
        "name": "fleet_sim",
        "machine": f"{os.cpu_count()} cores, no GPU; 1-min load average {load_at_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "running_beside": args.note,
        "setup": {
            "nodes": args.nodes,
            "gpus_per_node": 8,
            "spares": fleet.spares,
            "simulated_days": args.days,
            "seed": args.seed,
            "gpu_mttf_h": round(args.gpu_mttf_h, 1),
            "gpu_mttf_source": "Llama 3 report: 419 unexpected interruptions in 54 days on 16,384 GPUs",
            "fleet_mtbf_h": round(args.gpu_mttf_h / gpus, 3),
            "mix": {k.name: k.share for k in KINDS},
            "checkpoint_interval_min": args.checkpoint_interval_min,
            "step_s": args.step_s,
            "heartbeat_timeout_s": fleet.heartbeat_timeout_s,
            "echo_reports": "none in the schedule (see echo_worst_case)",
            "simulation_wall_s": round(sim_wall, 1),
            "answers_measured_every": args.answers_every,
        },
        "rendezvous_core": rendezvous,
        "rendezvous_grpc": grpc_result,
        "decisions": decision_report(outcomes),
        "echo_worst_case": echo,
        "goodput": scenarios[f"interval_{args.checkpoint_interval_min:g}min"],
        "goodput_by_interval": scenarios,
        "figures": fig.values,
        "figure_sources": fig.sources,
    }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
