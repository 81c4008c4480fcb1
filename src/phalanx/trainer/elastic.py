"""The elastic training loop: train, and on a membership change re-form the groups in the same process.

On a new round (the round file changed) or a failed collective (a peer died) the loop abandons the step
in flight, destroys its process group, waits for the agent's next round, initialises torch.distributed
against that round's fresh store, rebuilds the mesh, and runs the recovery plan
(:mod:`phalanx.trainer.recovery`): survivors keep their replicas, joiners receive the state by broadcast
from a data-parallel peer, and the data is re-split over the new data degree. When some shard has no
replica left, every rank loads the newest checkpoint they all hold, in the same process; only without one
does the process exit with :data:`RESTART_EXIT_CODE` for the agent to restart the workers.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

import phalanx
from phalanx import intervals
from phalanx.api import round as round_file
from phalanx.api.errors import CheckpointError, PhalanxError, RendezvousTimeoutError
from phalanx.trainer.checkpointing import CheckpointSeam, shard_key
from phalanx.trainer.engine import Engine, OptimConfig, default_device
from phalanx.trainer.membership import RoundSource, RoundSpec
from phalanx.trainer.mesh import Mesh, ParallelConfig
from phalanx.trainer.model import GPTConfig
from phalanx.trainer.recovery import NO_STATE, Action, RecoveryPlan, Row, decode, encode, plan_recovery
from phalanx.trainer.watchdog import RoundWatch, abort_all_groups

RESTART_EXIT_CODE = 75
"""Exit status asking the agent to restart this worker (it then loads the checkpoint)."""

Event = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Everything the elastic loop needs besides the data."""

    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    global_batch: int = 12
    """Sequences per step over all data-parallel ranks; it is re-split when the data degree changes."""
    micro_batches: int = 1
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    collective_timeout_s: float = 30.0
    """How long a collective (and joining a round's store) may block before it counts as failed."""
    round_wait_s: float = 120.0
    """How long to wait for the agent's next round before giving up and asking for a restart."""
    backend: str = ""
    """torch.distributed backend; empty: nccl with a GPU, else gloo."""
    digest: bool = False
    """Report a SHA-256 of the training state after every (re)group (for tests and debugging)."""


class _GroupFailed(PhalanxError):
    """Forming the process group or running the recovery collectives failed."""


def _wait_for_listener(host: str, port: int, *, timeout_s: float, superseded: Callable[[], bool]) -> None:
    """Returns once something accepts connections on ``host:port`` (or after ``timeout_s``).

    A TCPStore client that arrives before its server retries with a back-off of a few hundred
    milliseconds, which would dominate a regroup; probing the fresh port every few milliseconds does not.
    Raises _GroupFailed once ``superseded()``: the server (rank 0) may have gone on to a newer round.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if superseded():
            raise _GroupFailed(f"a newer round was written while waiting for its store at {host}:{port}")
        time.sleep(0.005)


_ARRIVED = "phalanx/arrived"
_ALL_ARRIVED = "phalanx/all-arrived"


def _gather(store: Store, *, world_size: int, timeout_s: float, superseded: Callable[[], bool]) -> None:
    """Counts this rank in on the round's store and returns once every member has counted itself in.

    gloo waits for its peers inside ``init_process_group`` (connecting the full mesh), and that wait cannot
    be interrupted: a member that went on to a newer round instead, or never came, costs the rest the whole
    collective timeout, 30 s by default, before they move on. This wait gives up as soon as the agent
    writes a newer round. Once everyone is here, gloo's own wait is a matter of milliseconds.
    """
    if store.add(_ARRIVED, 1) == world_size:
        store.set(_ALL_ARRIVED, "1")
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check([_ALL_ARRIVED]):
        if superseded():
            raise _GroupFailed("a newer round was written while this one gathered its members")
        if time.monotonic() > deadline:
            here = store.add(_ARRIVED, 0)
            raise _GroupFailed(f"{here} of {world_size} ranks came to the round in {timeout_s:g}s")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)  # the store serves every waiting rank: no tighter than 50 checks/s


def checkpoint_action(*, step: int, every: int, prepared: bool) -> str:
    """What to do with the checkpoint after completing ``step``: "save", "prepare" or "" (nothing).

    A shard's memory is readied ("prepare", in the background) after the first step that does not save:
    the state's shape is known once a step has created the optimizer's moments, and the first save then
    costs a plain copy instead of allocating and first-touching the memory on the training path.
    """
    if not every:
        return ""
    if step % every == 0:
        return "save"
    return "" if prepared else "prepare"


class ElasticTrainer:
    """Trains for a number of steps, surviving membership changes in-process where the replicas allow."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        batches: Callable[[int], torch.Tensor],
        checkpoint: CheckpointSeam | None = None,
        on_event: Callable[[Event], None] | None = None,
        rounds: RoundSource | None = None,
    ) -> None:
        self.config = config
        self.batches = batches
        self.checkpoint = checkpoint
        self._on_event = on_event or (lambda event: None)
        self.rounds = rounds or RoundSource()
        self.device = default_device()
        self.backend = config.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.step = 0
        self.has_state = False
        self.engine: Engine | None = None
        self.mesh: Mesh | None = None
        self.spec: RoundSpec | None = None
        self._store: Store | None = None
        self._prepared: set[str] = set()  # shard keys whose checkpoint memory is allocated
        # NCCL collectives wait out their timeout when a peer dies; gloo's fail when its sockets close.
        self._watch = (
            RoundWatch(changed=self._round_moved_on, abort=abort_all_groups)
            if self.backend == "nccl" and self.rounds.elastic
            else None
        )

    def on_event(self, event: Event) -> None:
        """Passes ``event`` (stamped with the wall time) to the caller's handler."""
        event.setdefault("time", time.time())
        self._on_event(event)

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, steps: int) -> int:
        """Trains until ``steps`` completed steps; returns the exit status (0 or RESTART_EXIT_CODE)."""
        if self.rounds.elastic:
            round_file.announce_regroup()
        try:
            first = self.rounds.current() or self.rounds.wait_newer(-1, timeout_s=self.config.round_wait_s)
            if not self._form_until_ready(first):
                return RESTART_EXIT_CODE
            while self.step < steps:
                if self.rounds.changed():
                    spec = self.rounds.current()
                    assert self.spec is not None
                    if spec is not None and spec.round > self.spec.round:
                        if not self._regroup(spec, cause="membership"):
                            return RESTART_EXIT_CODE
                        continue
                assert self.engine is not None
                started = time.monotonic()
                failure = ""
                try:
                    with self._watch or contextlib.nullcontext():
                        loss = self.engine.train_step(
                            self.batches(self.step), before_update=self._fence_checkpoint
                        )
                except (RuntimeError, dist.DistError) as exc:
                    if not self.rounds.elastic:
                        raise
                    failure = str(exc)[:300] or type(exc).__name__
                if failure:
                    # Outside the except block: the traceback's frames hold the step's tensors and work
                    # handles, and with them the old process groups, whose sockets must close now.
                    if not self._recover_from_failure(failure):
                        return RESTART_EXIT_CODE
                    continue
                self.step += 1
                self.has_state = True
                phalanx.report_step(self.step)
                self._emit_step(loss, time.monotonic() - started)
                self._maybe_checkpoint()
            return 0
        except RendezvousTimeoutError as exc:
            self.on_event({"event": "gave_up", "reason": str(exc), "pid": os.getpid()})
            return RESTART_EXIT_CODE
        finally:
            if self._watch is not None:
                self._watch.close()
            self._teardown()

    def _round_moved_on(self) -> bool:
        return self.spec is not None and self.rounds.newer_than(self.spec.round)

    def _recover_from_failure(self, error: str) -> bool:
        assert self.engine is not None
        assert self.spec is not None
        self.engine.optimizer.zero_grad()
        self.on_event({"event": "step_failed", "step": self.step, "error": error, "pid": os.getpid()})
        t0 = time.monotonic()
        self._teardown()  # before waiting: peers still blocked on this rank see its sockets close
        t1 = time.monotonic()
        spec = self.rounds.wait_newer(self.spec.round, timeout_s=self.config.round_wait_s)
        waited = time.monotonic() - t1
        self.on_event({"event": "torn_down", "teardown_s": round(t1 - t0, 4), "wait_s": round(waited, 4)})
        return self._form_until_ready(spec, cause="failure")

    def _regroup(self, spec: RoundSpec, *, cause: str) -> bool:
        self._teardown()
        return self._form_until_ready(spec, cause=cause)

    def _form_until_ready(self, spec: RoundSpec, *, cause: str = "start") -> bool:
        """Forms ``spec``'s group, moving on to newer rounds while forming fails; False: restart needed."""
        while True:
            try:
                plan = self._form(spec, cause=cause)
            except (_GroupFailed, RuntimeError, dist.DistError) as exc:
                self.on_event({"event": "form_failed", "round": spec.round, "error": str(exc)[:300]})
                self._teardown()
                spec = self.rounds.wait_newer(spec.round, timeout_s=self.config.round_wait_s)
                continue
            if plan.action is Action.RESTART:
                self.on_event({"event": "restart", "reason": plan.reason, "pid": os.getpid()})
                return False
            return True

    # -- forming a round --------------------------------------------------------------------------------

    def _form(self, spec: RoundSpec, *, cause: str) -> RecoveryPlan:
        started = time.monotonic()
        self.spec = spec
        self.on_event({"event": "forming", "round": spec.round, "rank": spec.rank, "world": spec.world_size})
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        if spec.world_size > 1 or self.rounds.elastic:
            if self.rounds.elastic:
                # The agent hands every round a fresh port; rank 0 serves the store, as in torchrun.
                superseded = self._round_moved_on
                if spec.rank != 0:
                    _wait_for_listener(
                        spec.store_host,
                        spec.store_port,
                        timeout_s=self.config.collective_timeout_s,
                        superseded=superseded,
                    )
                served = TCPStore(
                    spec.store_host,
                    spec.store_port,
                    spec.world_size,
                    is_master=spec.rank == 0,
                    timeout=timeout,
                    wait_for_workers=False,
                )
                # The store authenticates nobody: every key under the round's secret prefix, which a
                # stranger who reaches the port cannot name (gloo's peer addresses among them).
                self._store = PrefixStore(f"{spec.store_key}/", served) if spec.store_key else served
                _gather(
                    self._store,
                    world_size=spec.world_size,
                    timeout_s=self.config.collective_timeout_s,
                    superseded=superseded,
                )
                dist.init_process_group(
                    self.backend,
                    store=self._store,
                    rank=spec.rank,
                    world_size=spec.world_size,
                    timeout=timeout,
                )
            else:
                dist.init_process_group(
                    self.backend,
                    init_method="env://",
                    rank=spec.rank,
                    world_size=spec.world_size,
                    timeout=timeout,
                )
        mesh = Mesh(self.config.parallel, rank=spec.rank, world_size=spec.world_size)
        same_shard = self.mesh is not None and (self.mesh.coord.pipeline, self.mesh.coord.tensor) == (
            mesh.coord.pipeline,
            mesh.coord.tensor,
        )
        if self.engine is not None and same_shard:
            self.engine.rebind(mesh)
        else:
            self.engine = Engine(
                model=self.config.model,
                mesh=mesh,
                seed=self.config.seed,
                optim=self.config.optim,
                micro_batches=self.config.micro_batches,
                device=self.device,
            )
            self.has_state = False
        self.mesh = mesh
        formed = time.monotonic()
        plan = self._agree(mesh)
        self._apply(plan, mesh)
        event: Event = {
            "event": "formed",
            "cause": cause,
            "round": spec.round,
            "rank": spec.rank,
            "world": spec.world_size,
            "action": plan.action.value,
            "reason": plan.reason,
            "step": self.step,
            "pid": os.getpid(),
            "form_s": round(formed - started, 4),
            "sync_s": round(time.monotonic() - formed, 4),
        }
        if plan.action is Action.LOAD and self.checkpoint is not None:
            event["source"] = self.checkpoint.last_source
        if self.config.digest and plan.action is not Action.RESTART:
            event["digest"] = self.digest()
        self.on_event(event)
        return plan

    def _agree(self, mesh: Mesh) -> RecoveryPlan:
        key = shard_key(pipeline=mesh.coord.pipeline, tensor=mesh.coord.tensor)
        row = Row(
            step=self.step if self.has_state else NO_STATE,
            checkpoints=tuple(self.checkpoint.steps(key=key)) if self.checkpoint else (),
        )
        mine = torch.tensor(encode(row), dtype=torch.int64, device=self.device)
        if mesh.world_size == 1:
            return plan_recovery([row], config=self.config.parallel)
        table = torch.empty(mesh.world_size * mine.numel(), dtype=torch.int64, device=self.device)
        with intervals.collective("all_gather", label="world"):
            dist.all_gather_into_tensor(table, mine)
        rows = [decode(r.tolist()) for r in table.view(mesh.world_size, -1).cpu()]
        return plan_recovery(rows, config=self.config.parallel)

    def _apply(self, plan: RecoveryPlan, mesh: Mesh) -> None:
        assert self.engine is not None
        if plan.action is Action.LOAD:
            assert self.checkpoint is not None
            key = shard_key(pipeline=mesh.coord.pipeline, tensor=mesh.coord.tensor)
            state = dict(self.engine.state_tensors())
            loaded = self.checkpoint.load(step=plan.step, key=key, into=state)
            with torch.no_grad():
                for name, tensor in state.items():
                    if loaded[name] is not tensor:  # not filled in place by the load
                        tensor.copy_(loaded[name])
        elif plan.action is Action.BROADCAST:
            source = plan.sources.get(mesh.data_ranks[0])
            if source is not None:
                self._broadcast_state(source, mesh)
        if plan.action is not Action.RESTART:
            self.step = plan.step
            self.has_state = True

    def _broadcast_state(self, source: int, mesh: Mesh) -> None:
        """Copies the source replica's parameters and optimizer state into every rank of this data group."""
        assert self.engine is not None
        tensors = [t for _, t in self.engine.state_tensors()]
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        with intervals.collective("broadcast", group=mesh.data_group, label="dp"):
            dist.broadcast(flat, src=source, group=mesh.data_group)
        if mesh.rank == source:
            return
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def _teardown(self) -> None:
        # Whatever comes next (a load, a broadcast from a peer, the process's exit) may change or drop the
        # tensors a save behind training still copies.
        self._fence_checkpoint()
        # Drop every reference to the old groups first: a gloo group closes its sockets only when its last
        # reference goes, and survivors blocked in a collective with this rank fail fast only then.
        if self.engine is not None:
            self.engine.release_groups()
        if self.mesh is not None:
            self.mesh.release()
        leave_world()
        self._store = None
        gc.collect()  # autograd graphs of an abandoned step can hold groups in reference cycles

    # -- per step ---------------------------------------------------------------------------------------

    def _emit_step(self, loss: float, seconds: float) -> None:
        assert self.mesh is not None
        assert self.spec is not None
        self.on_event(
            {
                "event": "step",
                "step": self.step,
                "loss": loss,
                "world": self.mesh.world_size,
                "tp": self.mesh.tensor_size,
                "pp": self.mesh.pipeline_size,
                "dp": self.mesh.data_size,
                "rank": self.mesh.rank,
                "round": self.spec.round,
                "pid": os.getpid(),
                "step_s": round(seconds, 5),
                "time": time.time(),
            }
        )

    def _fence_checkpoint(self) -> None:
        """Waits for a checkpoint still copying behind training. A failed copy costs that snapshot, never
        the training: the one before it stays the newest."""
        if self.checkpoint is None:
            return
        try:
            self.checkpoint.fence()
        except CheckpointError as exc:
            self.on_event({"event": "checkpoint_failed", "step": self.step, "error": str(exc)[:300]})

    def _maybe_checkpoint(self) -> None:
        if self.checkpoint is None or self.mesh is None or self.mesh.coord.data != 0:
            return  # replicas are identical: one copy per shard, from data coordinate 0, is enough
        assert self.engine is not None
        key = shard_key(pipeline=self.mesh.coord.pipeline, tensor=self.mesh.coord.tensor)
        action = checkpoint_action(
            step=self.step, every=self.config.checkpoint_every, prepared=key in self._prepared
        )
        if action:
            self._prepared.add(key)
        if action == "save":
            started = time.monotonic()
            tensors = dict(self.engine.state_tensors())
            try:
                facts = self.checkpoint.save(step=self.step, key=key, tensors=tensors)
            except CheckpointError as exc:  # like a failed copy behind training: it costs the save alone
                self.on_event({"event": "checkpoint_failed", "step": self.step, "error": str(exc)[:300]})
                return
            blocking_s = round(time.monotonic() - started, 5)
            self.on_event(
                {"event": "checkpoint", "step": self.step, "key": key, "blocking_s": blocking_s, **facts}
            )
        elif action == "prepare":
            self.checkpoint.prepare(key=key, tensors=dict(self.engine.state_tensors()))

    def digest(self) -> str:
        """SHA-256 of this rank's parameters and optimizer state (bitwise)."""
        assert self.engine is not None
        h = hashlib.sha256()
        for name, t in self.engine.state_tensors():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def leave_world() -> None:
    """Destroys this process's process groups, if any, so that the next round forms from scratch.

    It also restarts torch's group naming at zero. A group's store keys carry its name, which comes from a
    per-process counter; ``destroy_process_group()`` resets that counter, but a formation that failed (a
    peer vanished while gloo connected the mesh) has counted its group without registering it, so nothing
    would. This process would then name its next world "1" while a freshly started peer names it "0", and
    each would wait for the other's keys until the timeout, round after round, until every process had
    been restarted (seen with a node evicted while the survivors regrouped: minutes without a step).
    """
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, dist.DistError):  # already broken: its peers are gone
            dist.destroy_process_group()
    dist.distributed_c10d._world.group_count = 0
