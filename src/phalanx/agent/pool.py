"""The node's worker processes: :class:`WorkerPool` keeps the warm spares, the workers of the current round
and what the agent reads from them (progress beacons, interval rings, step histories). The supervisor
decides when to start, stop and refill; the pool does it."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.agent import decisions, workers, zygote
from phalanx.agent import env as worker_env
from phalanx.agent.config import AgentConfig
from phalanx.api import beacon
from phalanx.api import intervals as interval_ring
from phalanx.api import round as round_file
from phalanx.api.interval_tracker import Tracker
from phalanx.api.round import RoundInfo
from phalanx.api.v1 import master_pb2 as pb
from phalanx.checkpoint import shm
from phalanx.diagnostics import hang

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
"""The node's shared memory: the flash checkpoint's slots, and this user's worker files (below)."""


def worker_shm_dir() -> Path:
    """This user's directory of worker beacons, interval rings and recorder dumps, ``SHM_ROOT/phalanx-<uid>``
    (0700, refused when another user planted it): on a machine other users share, nobody else reads a job's
    progress or its NCCL dumps, or plants a file under a name the agent will open."""
    return shm.check_private_dir(shm.private_dir(SHM_ROOT))


NO_ROUND = RoundInfo(
    round=0, group_rank=0, rank_offset=0, world_size=0, local_world_size=0, store_host="", store_port=0
)

Sink = Callable[[int, int, int, str], None]
"""(rank, local rank, stream, line): where a worker's output lines go."""


@dataclass
class Hang:
    """A worker the hang verdict found stuck."""

    local_rank: int
    reason: str
    evidence: pb.HangEvidence


class WorkerPool:
    """One node's workers and warm spares. ``base_env`` is shared with the caller, which may add to it (the
    checkpoint host's variables) before the next spawn."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        base_env: dict[str, str],
        log_dir: Path,
        sink: Sink,
        say: Callable[[str], None],
    ) -> None:
        self.config = config
        self.base_env = base_env
        self.log_dir = log_dir
        self.round_path = log_dir / "round.json"
        self.shm_dir = worker_shm_dir()
        self._sink = sink
        self._say = say
        self.spec = workers.LaunchSpec(
            script=config.script,
            script_args=config.script_args,
            module=config.module,
            no_python=config.no_python,
            preimport=workers.WARM_IMPORTS if config.warm_spares else "",
        )
        self.workers: dict[int, workers.Worker] = {}
        self.spares: dict[int, workers.Worker] = {}
        self.histories: dict[int, hang.RankHistory] = {}
        self.stopped_since: dict[int, tuple[int, float]] = {}
        """Local rank -> (the pid, when it was first seen stopped by a signal) while it stays stopped."""
        self.rings: dict[int, tuple[interval_ring.RingReader, Tracker]] = {}
        """Per local rank: the reader of its interval ring and what it has read so far."""
        self._spawned = 0
        self.zygote: zygote.Zygote | None = None
        """Where warm spares are forked from (:mod:`phalanx.agent.zygote`); None: each spare imports alone."""
        self.imports_dir: Path | None = None
        """Where each local rank's script imports are recorded for its next spares; None: no warm spares."""
        if config.warm_spares and not config.no_python:
            self.imports_dir = log_dir / "imports"
            # Only this run's incarnations count: a reused log dir may hold another script's list.
            for stale in self.imports_dir.glob("*.txt"):
                stale.unlink(missing_ok=True)

    def paths(self, info: RoundInfo, local_rank: int) -> worker_env.WorkerPaths:
        d = self.log_dir / f"round{info.round}" / str(local_rank)
        job, node = self.config.job_id, self.config.node_id
        return worker_env.WorkerPaths(
            beacon=worker_env.beacon_path(
                shm_dir=self.shm_dir, job_id=job, node_id=node, local_rank=local_rank
            ),
            intervals=worker_env.intervals_path(
                shm_dir=self.shm_dir, job_id=job, node_id=node, local_rank=local_rank
            ),
            error_file=d / "error.json",
            stack_file=d / "stacks.txt",
            regroup_file=self.log_dir / "regroup" / f"{local_rank}.pid",
            stdout_log=d / "stdout.log",
            stderr_log=d / "stderr.log",
        )

    # -------------------------------------------------------------------------------------------------
    # spares and workers

    def _static_env(self, local_rank: int) -> dict[str, str]:
        return worker_env.static_env(
            self.base_env,
            local_rank=local_rank,
            local_world_size=self.config.nproc_per_node,
            job_id=self.config.job_id,
            node_id=self.config.node_id,
            instrument=self.config.hang.instrument,
        )

    def _spawn(self, local_rank: int) -> workers.Worker:
        self._spawned += 1
        start = functools.partial(
            workers.spawn,
            self.spec,
            local_rank=local_rank,
            env=self._static_env(local_rank),
            max_line_bytes=self.config.logs.max_line_bytes,
            ready_file=self.log_dir / "spares" / f"{local_rank}-{self._spawned}.ready",
            imports_file=self.imports_dir / f"{local_rank}.txt" if self.imports_dir else None,
        )
        if self.zygote is not None and self.zygote.ready():
            try:
                return start(zygote=self.zygote)
            except OSError as e:
                self._say(f"the zygote could not fork a spare ({e}); starting it cold")
        return start()

    def warm_up(self, *, deadline: float) -> None:
        """Starts the zygote and, once it has imported, forks a warm spare for every local rank; returns when
        they are ready or at ``deadline``. Without a zygote (``--no-python``) the spares import alone."""
        if self.config.warm_spares and not self.config.no_python and self.zygote is None:
            # The environment every spare shares at import time (threads, unbuffered output): local rank 0's.
            self.zygote = zygote.Zygote(
                preimport=self.spec.preimport,
                target=self.spec.target(),
                env=self._static_env(0),
                agent_pid_var=workers.AGENT_PID_ENV_VAR,
            )
            if not self.zygote.wait_ready(deadline - time.monotonic()):
                self._say("the zygote is not ready; warm spares import alone")
        self.fill_spares()
        while not self.spares_ready() and time.monotonic() < deadline:
            time.sleep(0.05)

    def fork_probe_server(self, env: Mapping[str, str] | None) -> zygote.ForkedProcess | None:
        """The node's warm probe server forked from the zygote; None without a ready one (the probes then
        start a server of their own)."""
        z = self.zygote
        if z is None or not z.ready():
            return None
        try:
            server = z.fork_probe_server(env if env is not None else os.environ)  # None: as Popen's, ours
        except OSError as e:
            self._say(f"the zygote could not fork the probe server ({e}); it starts on its own")
            return None
        self._say(f"the probe server is a fork of the zygote (pid {server.pid})")
        return server

    def fill_spares(self) -> None:
        for lr in range(self.config.nproc_per_node):
            spare = self.spares.get(lr)
            if spare is None or spare.proc.poll() is not None:
                self.spares[lr] = self._spawn(lr)

    def spares_ready(self) -> bool:
        return all(s.ready() for s in self.spares.values())

    def _take(self, local_rank: int) -> workers.Worker:
        spare = self.spares.pop(local_rank, None)
        if spare is not None and spare.proc.poll() is None:
            return spare
        return self._spawn(local_rank)

    def start(self, info: RoundInfo) -> None:
        """Starts the round's workers (from warm spares when there are), each with its beacon and ring."""
        round_file.write(self.round_path, info)  # always before the workers start
        (self.log_dir / "regroup").mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        self.workers = {}
        self.close_rings()
        for lr in range(self.config.nproc_per_node):
            w = self._take(lr)
            paths = self.paths(info, lr)
            beacon.create(paths.beacon)
            if paths.intervals is not None:
                interval_ring.create(paths.intervals)
                self.rings[lr] = (interval_ring.RingReader(paths.intervals), Tracker())
            env = worker_env.round_env(
                info,
                local_rank=lr,
                role=self.config.role,
                max_restarts=self.config.max_restarts,
                paths=paths,
                round_path=self.round_path,
            )
            w.hand_over(env=env, paths=paths, rank=info.rank(lr), sink=self._sink)
            self.workers[lr] = w
            self.histories[lr] = hang.RankHistory(started_at=now)
        self._say(
            f"started {len(self.workers)} workers: ranks {info.rank_offset}.."
            f"{info.rank(len(self.workers) - 1)} "
            f"of {info.world_size}, store {info.store_host}:{info.store_port}"
        )

    def regroup(self, info: RoundInfo) -> None:
        """Hands the running workers the new round (they regroup in place)."""
        round_file.write(self.round_path, info)
        for lr, w in self.workers.items():
            w.rank = info.rank(lr)

    def stop(self) -> dict[int, int]:
        """Stops the workers (within the grace period); their exit codes by local rank."""
        codes = workers.stop(list(self.workers.values()), grace_period_s=self.config.grace_period_s)
        self.workers = {}
        return codes

    def all_alive(self) -> bool:
        return all(w.proc.poll() is None for w in self.workers.values())

    def regroup_capable(self, info: RoundInfo | None) -> bool:
        """Whether every worker announced (with its pid) that it can regroup in place."""
        if not self.workers:
            return False
        for lr, w in self.workers.items():
            try:
                announced = int(self.paths(info or NO_ROUND, lr).regroup_file.read_text().strip())
            except (OSError, ValueError):
                return False
            if announced != w.pid:
                return False
        return True

    def maybe_refill(self, now: float) -> None:
        """Spawns new warm spares once the workers took the last ones and stepped (see decisions)."""
        handed = [w.handed_over_at for w in self.workers.values() if w.handed_over_at is not None]
        since = now - min(handed) if handed else 0.0
        stepped = all(h.last_step >= 0 for h in self.histories.values())
        alive = sum(1 for s in self.spares.values() if s.proc.poll() is None)
        if decisions.refill_due(
            spares=alive, wanted=self.config.nproc_per_node, since_handover_s=since, workers_stepped=stepped
        ):
            self.fill_spares()

    def close_logs(self) -> None:
        for w in self.workers.values():
            w.close_logs()

    def discard_spares(self) -> None:
        for spare in self.spares.values():
            spare.discard()
        self.spares = {}

    def close_zygote(self) -> None:
        """Ends the zygote; after the workers stopped (they are its children and would die with it)."""
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    # -------------------------------------------------------------------------------------------------
    # what the workers tell

    def progress(self, now: float) -> tuple[list[pb.RankProgress], Hang | None]:
        """Every worker's progress (beacon, activity, new intervals), and the first one found hung."""
        ranks: list[pb.RankProgress] = []
        hung: Hang | None = None
        for lr, w in self.workers.items():
            assert w.paths is not None
            try:
                reader = beacon.BeaconReader(w.paths.beacon)
                b = reader.read()
                reader.close()
            except (OSError, RuntimeError, ValueError):
                continue
            history = self.histories[lr]
            history.observe(step=b.step, now=now)
            age = now - (history.last_change_at if history.last_change_at is not None else history.started_at)
            progress = pb.RankProgress(
                rank=w.rank,
                local_rank=lr,
                step=b.step,
                step_unix_ns=b.unix_ns,
                beacon_age_s=age,
                pid=w.pid,
            )
            activity = self._read_ring(lr, progress)
            ranks.append(progress)
            v = hang.evidence_verdict(
                history, self.config.hang, now=now, activity=activity, now_unix_ns=time.time_ns()
            )
            if not v.hung:
                v = self._stopped(lr, w.pid, history, now=now) or v
            if v.hung and hung is None and w.proc.poll() is None:
                evidence = hang.evidence(v, activity)
                if w.paths.intervals is not None:  # a CUDA recorder answers with its NCCL flight recorder
                    evidence.nccl_trace = interval_ring.request_dump(w.paths.intervals, timeout_s=1.0)
                hung = Hang(lr, reason=hang.describe(w.rank, v), evidence=evidence)
        return ranks, hung

    def _stopped(
        self, lr: int, pid: int, history: hang.RankHistory, *, now: float
    ) -> hang.HangVerdict | None:
        """The verdict on a worker stopped by a signal (:func:`hang.stopped_verdict`), None while it runs."""
        if workers.process_state(pid) != hang.SIGNAL_STOPPED:
            self.stopped_since.pop(lr, None)
            return None
        seen = self.stopped_since.get(lr)
        if seen is None or seen[0] != pid:
            seen = self.stopped_since[lr] = (pid, now)
        stopped_for = now - seen[1]
        return hang.stopped_verdict(self.config.hang, stopped_for_s=stopped_for, last_step=history.last_step)

    def _read_ring(self, lr: int, progress: pb.RankProgress) -> pb.RankActivity | None:
        """Reads a worker's new interval records into ``progress`` (its activity, the intervals closed since
        the previous read); returns the activity, None while the worker has recorded nothing."""
        ring = self.rings.get(lr)
        if ring is None:
            return None
        reader, tracker = ring
        try:
            tracker.feed(reader.read())
        except (OSError, ValueError):
            return None
        if not tracker.active:
            return None
        activity = tracker.activity()
        progress.activity.CopyFrom(activity)
        progress.intervals.extend(tracker.take_intervals())
        return activity

    def close_rings(self) -> None:
        for reader, _ in self.rings.values():
            with contextlib.suppress(BufferError, OSError):
                reader.close()
        self.rings = {}

    def shm_files(self) -> list[Path]:
        """The shared-memory files of the workers: beacons and interval rings."""
        return [
            where(shm_dir=self.shm_dir, job_id=self.config.job_id, node_id=self.config.node_id, local_rank=lr)
            for lr in range(self.config.nproc_per_node)
            for where in (worker_env.beacon_path, worker_env.intervals_path)
        ]
