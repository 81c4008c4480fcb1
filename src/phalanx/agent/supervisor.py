"""The node agent's main loop: register, rendezvous, start workers, watch them, and carry out the master's
decisions. Decisions come from :mod:`phalanx.agent.decisions` and :mod:`phalanx.diagnostics.hang`; this
module is the executor that does the I/O."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from phalanx import __version__
from phalanx.agent import checkpointing, decisions, failures, probes, workers
from phalanx.agent import env as worker_env
from phalanx.agent.client import MasterClient, MasterUnavailableError, UnknownNodeError, backoff_s
from phalanx.agent.config import AgentConfig
from phalanx.agent.link import Link, LogShipper
from phalanx.api import beacon
from phalanx.api import intervals as interval_ring
from phalanx.api import round as round_file
from phalanx.api.errors import RendezvousClosedError, TransportError
from phalanx.api.round import RoundInfo
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.diagnostics.classify import FailureClass

T = TypeVar("T")

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
MASTER_AWAY_LIMIT_S = 600.0  # how long blocking calls keep retrying a master that does not answer
USER_ERROR_SETTLE_S = 1.0  # how long other local workers get to fail too after a user error
AGREEMENT_WAIT_S = 10.0  # beyond the grace period, how long a leaving node waits for the others' reports
SPARE_WARMUP_LIMIT_S = 300.0  # a node joins after this long even if its spares are still importing


@dataclass
class Event:
    """What ended a stretch of monitoring."""

    kind: str  # failed | hang | succeeded | rejoin | exit | stacks
    local_ranks: list[int] = field(default_factory=list)
    action: pb.Action | None = None
    reason: str = ""
    evidence: pb.HangEvidence | None = None
    """For a hang: the verdict's evidence (side, age, timeout, the rank's activity)."""
    seen_unix_ns: dict[int, int] = field(default_factory=dict)
    """For a failure: when each failed local rank was first seen exited (a SIGKILLed rank has no error
    file to date it: it is dated by this, not by the report's time, which a settle puts up to 1 s later)."""


class AgentExit(Exception):
    """Ends the agent with an exit code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Terminated(BaseException):
    """SIGTERM reached the agent (its Pod deleted, its machine drained, its job suspended). A BaseException,
    like SystemExit, so that no handler meant for errors swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class Supervisor:
    """Runs one node's workers for the life of the job."""

    def __init__(
        self, config: AgentConfig, *, client: MasterClient, base_env: Mapping[str, str], log_dir: Path
    ) -> None:
        self.config = config
        self.client = client
        self.base_env = dict(base_env)
        self.log_dir = log_dir
        self.incarnation = uuid.uuid4().hex
        self.spec = workers.LaunchSpec(
            script=config.script,
            script_args=config.script_args,
            module=config.module,
            no_python=config.no_python,
            preimport=workers.WARM_IMPORTS if config.warm_spares else "",
        )
        self.shipper = LogShipper(config.logs)
        self.link: Link | None = None
        self.workers: dict[int, workers.Worker] = {}
        self.spares: dict[int, workers.Worker] = {}
        self.histories: dict[int, hang.RankHistory] = {}
        self.rings: dict[int, tuple[interval_ring.RingReader, interval_ring.Tracker]] = {}
        """Per local rank: the reader of its interval ring and what it has read so far."""
        self.round: RoundInfo | None = None
        self.last_round = 0
        self.restarts = 0  # failure restarts, counted against --max-restarts
        self.total_restarts = 0
        self.round_path = log_dir / "round.json"
        self._echo_lock = threading.Lock()
        self._spawned = 0
        self.ckpt = checkpointing.NodeCheckpointHost(self.say)
        self.breakpoints = checkpointing.Breakpoints(
            self.ckpt,
            report=client.report_checkpoint,
            node_id=config.node_id,
            incarnation=self.incarnation,
            say=self.say,
        )
        self.probes = probes.ProbeExecutor(
            client=client,
            node_id=config.node_id,
            incarnation=self.incarnation,
            env=self.base_env,
            say=self.say,
            warm=config.warm_probes,
        )

    # -------------------------------------------------------------------------------------------------
    # plumbing

    def say(self, message: str) -> None:
        r = self.round.round if self.round else 0
        print(
            f"[phalanx-run {self.config.job_id}/{self.config.node_id} r{r}] {message}",
            file=sys.stderr,
            flush=True,
        )

    def _on_line(self, rank: int, local_rank: int, stream: int, text: str) -> None:
        with self._echo_lock:
            out = sys.stdout if stream == 1 else sys.stderr
            out.write(f"[rank{rank}]:{text}\n")
            out.flush()
        self.shipper.offer(rank=rank, local_rank=local_rank, stream=stream, text=text)

    def _retry(self, call: Callable[[], T], what: str) -> T:
        """Retries a call while the master is away (restarting), re-registering if it forgot us."""
        deadline = time.monotonic() + MASTER_AWAY_LIMIT_S
        attempt = 0
        while True:
            try:
                return call()
            except UnknownNodeError:
                self.say(f"{what}: master does not know this incarnation; registering again")
                self._reregister()
            except MasterUnavailableError as exc:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"{what}: the master did not answer for {MASTER_AWAY_LIMIT_S:g}s"
                    ) from exc
                if attempt in (0, 5):
                    self.say(f"{what}: master unavailable, retrying with backoff")
            attempt += 1
            time.sleep(backoff_s(attempt))

    def _register(self) -> pb.RegisterNodeResponse:
        req = pb.RegisterNodeRequest(
            job_id=self.config.job_id,
            node_id=self.config.node_id,
            incarnation=self.incarnation,
            host=self.config.host,
            nproc_per_node=self.config.nproc_per_node,
            agent_version=__version__,
            machine=self.base_env.get("PHALANX_MACHINE", ""),
        )
        return self.client.register(req)

    def _reregister(self) -> None:
        self._register()
        if self.link is not None:
            self.link.forget_acks()

    def _paths(self, info: RoundInfo, local_rank: int) -> worker_env.WorkerPaths:
        d = self.log_dir / f"round{info.round}" / str(local_rank)
        return worker_env.WorkerPaths(
            beacon=worker_env.beacon_path(
                shm_dir=SHM_DIR, job_id=self.config.job_id, node_id=self.config.node_id, local_rank=local_rank
            ),
            intervals=worker_env.intervals_path(
                shm_dir=SHM_DIR, job_id=self.config.job_id, node_id=self.config.node_id, local_rank=local_rank
            ),
            error_file=d / "error.json",
            stack_file=d / "stacks.txt",
            regroup_file=self.log_dir / "regroup" / f"{local_rank}.pid",
            stdout_log=d / "stdout.log",
            stderr_log=d / "stderr.log",
        )

    # -------------------------------------------------------------------------------------------------
    # spares and workers

    def _spawn(self, local_rank: int) -> workers.Worker:
        env = worker_env.static_env(
            self.base_env,
            local_rank=local_rank,
            local_world_size=self.config.nproc_per_node,
            job_id=self.config.job_id,
            node_id=self.config.node_id,
        )
        self._spawned += 1
        return workers.spawn(
            self.spec,
            local_rank=local_rank,
            env=env,
            cwd=None,
            max_line_bytes=self.config.logs.max_line_bytes,
            ready_file=self.log_dir / "spares" / f"{local_rank}-{self._spawned}.ready",
        )

    def _fill_spares(self) -> None:
        for lr in range(self.config.nproc_per_node):
            spare = self.spares.get(lr)
            if spare is None or spare.proc.poll() is not None:
                self.spares[lr] = self._spawn(lr)

    def _take(self, local_rank: int) -> workers.Worker:
        spare = self.spares.pop(local_rank, None)
        if spare is not None and spare.proc.poll() is None:
            return spare
        return self._spawn(local_rank)

    def _start_workers(self, info: RoundInfo) -> None:
        round_file.write(self.round_path, info)  # always before the workers start
        (self.log_dir / "regroup").mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        self.workers = {}
        self._close_rings()
        for lr in range(self.config.nproc_per_node):
            w = self._take(lr)
            paths = self._paths(info, lr)
            beacon.create(paths.beacon)
            if paths.intervals is not None:
                interval_ring.create(paths.intervals)
                self.rings[lr] = (interval_ring.RingReader(paths.intervals), interval_ring.Tracker())
            env = worker_env.round_env(
                info,
                local_rank=lr,
                role=self.config.role,
                max_restarts=self.config.max_restarts,
                paths=paths,
                round_path=self.round_path,
            )
            w.hand_over(env=env, paths=paths, rank=info.rank(lr), sink=self._on_line)
            self.workers[lr] = w
            self.histories[lr] = hang.RankHistory(started_at=now)
        self.say(
            f"started {len(self.workers)} workers: ranks {info.rank_offset}.."
            f"{info.rank(len(self.workers) - 1)} "
            f"of {info.world_size}, store {info.store_host}:{info.store_port}"
        )

    def _local_ranks(self) -> list[int]:
        """This node's global ranks in the current round."""
        return [self.round.rank(lr) for lr in range(self.config.nproc_per_node)] if self.round else []

    def _stop_workers(self) -> dict[int, int]:
        codes = workers.stop(list(self.workers.values()), grace_period_s=self.config.grace_period_s)
        self.workers = {}
        return codes

    def _regroup_capable(self) -> bool:
        if not self.workers:
            return False
        for lr, w in self.workers.items():
            try:
                announced = int(self._paths(self.round or _NO_ROUND, lr).regroup_file.read_text().strip())
            except (OSError, ValueError):
                return False
            if announced != w.pid:
                return False
        return True

    def _progress(self, now: float) -> tuple[list[pb.RankProgress], Event | None]:
        ranks: list[pb.RankProgress] = []
        hung: Event | None = None
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
            if v.hung and hung is None and w.proc.poll() is None:
                hung = Event(
                    "hang", [lr], reason=hang.describe(w.rank, v), evidence=hang.evidence(v, activity)
                )
        return ranks, hung

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

    def _close_rings(self) -> None:
        for reader, _ in self.rings.values():
            with contextlib.suppress(BufferError, OSError):
                reader.close()
        self.rings = {}

    # -------------------------------------------------------------------------------------------------
    # rendezvous

    def _rendezvous(self) -> RoundInfo:
        while True:
            store_port = _free_port(self.config.host)
            joined = self._retry(
                lambda port=store_port: self.client.join(  # type: ignore[misc]
                    pb.JoinRendezvousRequest(
                        node_id=self.config.node_id,
                        incarnation=self.incarnation,
                        nproc_per_node=self.config.nproc_per_node,
                        store_host=self.config.host,
                        store_port=port,
                        last_round=self.last_round,
                    )
                ),
                "join rendezvous",
            )
            self.link_publish(pb.NODE_STATE_RENDEZVOUS, joined.round)
            while True:
                self._drain_exit_actions()
                resp = self._retry(
                    lambda r=joined.round: self.client.get_rendezvous(  # type: ignore[misc]
                        pb.GetRendezvousRequest(
                            node_id=self.config.node_id, incarnation=self.incarnation, round=r, wait_s=2.0
                        )
                    ),
                    "rendezvous",
                )
                if resp.status == pb.RENDEZVOUS_STATUS_COMPLETE:
                    self._drain_exit_actions()  # a persist request for the broken round: before the workers
                    return self._round_info(resp)
                if resp.status == pb.RENDEZVOUS_STATUS_CLOSED:
                    raise RendezvousClosedError("the job is over (rendezvous closed)")
                if resp.status == pb.RENDEZVOUS_STATUS_NOT_MEMBER:
                    self.say(f"round {resp.round} completed without this node; joining the next one")
                    time.sleep(0.2)
                    break

    def _round_info(self, resp: pb.GetRendezvousResponse) -> RoundInfo:
        members = [m.node_id for m in resp.members]
        previous = set(self.round.members) if self.round else set()
        return RoundInfo(
            round=resp.round,
            group_rank=resp.group_rank,
            rank_offset=resp.rank_offset,
            world_size=resp.world_size,
            local_world_size=self.config.nproc_per_node,
            store_host=resp.store_host,
            store_port=resp.store_port,
            restart_count=resp.restart_count,
            members=members,
            joined=[m for m in members if m not in previous] if previous else [],
        )

    def link_publish(self, state: int, round: int, ranks: list[pb.RankProgress] | None = None) -> None:
        if self.link is not None:
            self.link.publish(state=state, round=round, ranks=ranks, restart_count=self.total_restarts)

    def _drain_exit_actions(self) -> None:
        """While not running workers only EXIT, probes and persist requests matter; the rest is stale."""
        assert self.link is not None
        while not self.link.actions.empty():
            action = self.link.actions.get_nowait()
            if action.kind == pb.ACTION_KIND_EXIT:
                raise AgentExit(action.exit_code, action.reason or "told to exit")
            if action.kind == pb.ACTION_KIND_RUN_PROBE:  # a node between rounds is the one to probe
                self.probes.start(action)
            if action.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT:
                self._persist_asked(action)

    def _persist_asked(self, action: pb.Action) -> None:
        self.breakpoints.persist_asked(action, current_ranks=self._local_ranks())

    def _save_at_breakpoint(self, reason: str, *, wait: bool = True) -> None:
        round_no = self.round.round if self.round else 0
        self.breakpoints.save(reason, round_no=round_no, ranks=self._local_ranks(), wait=wait)

    def _await_agreement(self) -> None:
        self.breakpoints.await_agreement(limit_s=self.config.grace_period_s + AGREEMENT_WAIT_S)

    # -------------------------------------------------------------------------------------------------
    # monitoring

    def _monitor(self) -> Event:
        assert self.link is not None
        assert self.round is not None
        while True:
            now = time.monotonic()
            codes = {lr: w.proc.poll() for lr, w in self.workers.items()}
            outcome, failed = decisions.workers_outcome(codes)
            if outcome is decisions.Outcome.FAILED:
                return Event("failed", failed, seen_unix_ns=dict.fromkeys(failed, time.time_ns()))
            if outcome is decisions.Outcome.SUCCEEDED:
                return Event("succeeded")
            ranks, hung = self._progress(now)
            self.link_publish(pb.NODE_STATE_RUNNING, self.round.round, ranks)
            if hung is not None:
                return hung
            while not self.link.actions.empty():
                action = self.link.actions.get_nowait()
                if action.kind == pb.ACTION_KIND_EXIT:
                    return Event("exit", action=action, reason=action.reason)
                if decisions.is_new_rejoin(action, current_round=self.round.round):
                    return Event("rejoin", action=action, reason=action.reason)
                if action.kind == pb.ACTION_KIND_DUMP_STACKS:
                    self._send_stacks()
                if action.kind == pb.ACTION_KIND_RUN_PROBE:
                    self.probes.start(action)  # on its own thread: monitoring and heartbeats go on
                if action.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT:
                    self._persist_asked(action)
            if self.config.warm_spares:
                self._maybe_refill(now)
            time.sleep(self.config.monitor_interval_s)

    def _maybe_refill(self, now: float) -> None:
        handed = [w.handed_over_at for w in self.workers.values() if w.handed_over_at is not None]
        since = now - min(handed) if handed else 0.0
        stepped = all(h.last_step >= 0 for h in self.histories.values())
        alive = sum(1 for s in self.spares.values() if s.proc.poll() is None)
        if decisions.refill_due(
            spares=alive, wanted=self.config.nproc_per_node, since_handover_s=since, workers_stepped=stepped
        ):
            self._fill_spares()

    def _send_stacks(self, reason: str = "") -> None:
        entries = failures.rank_stacks(self.workers, self.histories, now=time.monotonic())
        round_no = self.round.round if self.round else 0
        request = pb.ReportStacksRequest(
            node_id=self.config.node_id, incarnation=self.incarnation, round=round_no, ranks=entries
        )
        with contextlib.suppress(TransportError):
            failures.send_fitted(
                self.client.report_stacks, request, failures.fit_stacks_report, what="report stacks"
            )
        self.say(f"sent stacks of {len(entries)} ranks {reason}".rstrip())

    # -------------------------------------------------------------------------------------------------
    # failures

    def _settle(self, event: Event) -> Event:
        """A user error usually hits every rank at once: give the other local workers a moment to fail on
        their own, so the report shows all of them (the master fails the job at once when every rank
        raised the same error). A communication error is the echo of another rank's failure, and that
        rank may be a local one whose exit is not reaped yet: the same moment puts the cause in the same
        report as its echo. A kill or a crash is reported without waiting."""
        if event.kind != "failed" or not any(
            failures.classify_local(self.workers[lr]) in (FailureClass.USER, FailureClass.COMM)
            for lr in event.local_ranks
        ):
            return event
        seen = dict(event.seen_unix_ns)
        deadline = time.monotonic() + USER_ERROR_SETTLE_S
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers.values()):
            time.sleep(0.05)
            for lr, w in self.workers.items():
                if lr not in seen and w.proc.poll() is not None:
                    seen[lr] = time.time_ns()
        failed = sorted(lr for lr, w in self.workers.items() if w.proc.poll() not in (None, 0))
        return Event("failed", failed, seen_unix_ns=seen)

    def _handle_failure(self, event: Event) -> decisions.Next:
        event = self._settle(event)
        if event.kind == "hang":
            self.say(event.reason)
            self._send_stacks("(hang)")
        assert self.round is not None
        hung = event.kind == "hang"
        entries = [
            failures.worker_failure(
                lr,
                self.workers[lr],
                hung=hung,
                reason=event.reason,
                history=self.histories.get(lr),
                evidence=event.evidence,
                observed_unix_ns=event.seen_unix_ns.get(lr, 0),
            )
            for lr in event.local_ranks
        ]
        self.link_publish(pb.NODE_STATE_RESTARTING, self.round.round if self.round else 0)
        running = {lr: w for lr, w in self.workers.items() if lr not in event.local_ranks}
        marks = failures.mark_stop(running) if not hung else {}
        self._stop_workers()
        if not hung:
            # Ranks that raised too but were slower than the settle to exit: the master needs every rank's
            # error to tell a bug on every rank (fail at once) from one bad rank (restart).
            late = failures.raised_before(running, marks)
            entries += [
                failures.worker_failure(
                    lr, w, hung=False, reason="", history=self.histories.get(lr), stopped_after_raising=True
                )
                for lr, w in late.items()
            ]
            desc = ", ".join(f"rank {e.rank} exit {e.exit_code}" for e in entries)
            self.say(f"worker failure: {desc}")
        request = pb.ReportFailureRequest(
            node_id=self.config.node_id,
            incarnation=self.incarnation,
            round=self.round.round,
            kind=pb.FAILURE_KIND_HANG if hung else pb.FAILURE_KIND_WORKER_EXIT,
            failures=entries,
        )
        resp = self._retry(
            lambda: failures.send_fitted(
                self.client.report_failure, request, failures.fit_failure_report, what="report failure"
            ),
            "report failure",
        )
        # Save at the breakpoint while the master decides: the restarted workers (or the next run) resume
        # from the newest step, and storage holds it even if this node goes away. Only the queueing waits
        # (it pins the snapshots): workers restarted on the same nodes load from memory, so they need not
        # wait for storage; a round with other nodes waits for it (see _loop).
        self._save_at_breakpoint("worker failure", wait=False)
        nxt = decisions.after_failure(
            resp.action, restarts_used=self.restarts, max_restarts=self.config.max_restarts
        )
        while nxt.kind == "wait":
            action = self._next_action(timeout=1.0)
            if action is not None and action.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT:
                self._persist_asked(action)
            elif action is not None:
                nxt = decisions.after_failure(
                    action, restarts_used=self.restarts, max_restarts=self.config.max_restarts
                )
        return nxt

    def _next_action(self, timeout: float) -> pb.Action | None:
        assert self.link is not None
        try:
            return self.link.actions.get(timeout=timeout)
        except queue.Empty:
            return None

    # -------------------------------------------------------------------------------------------------
    # the loop

    def run(self) -> int:
        try:
            self._start_checkpoint_host()
            return self._run()
        except AgentExit as exc:
            self.say(f"exiting with code {exc.code}: {exc.reason}")
            return exc.code
        except RendezvousClosedError as exc:
            self.say(str(exc))
            return 0
        except Terminated as exc:
            return self._leave(exc.signum)
        finally:
            self._shutdown()

    def _leave(self, signum: int) -> int:
        """Leaves the job on SIGTERM, persisting first what only this node holds: the workers' newest
        in-memory snapshots, which die with the Pod's /dev/shm. The step is settled with the other nodes
        (a suspended job's nodes all leave at once), as at any breakpoint; the Pod's termination grace
        period bounds the whole of it, and a step cut short is never committed."""
        self.say(f"terminated (signal {signum}): stopping the workers and persisting their newest checkpoint")
        if self.workers:
            self._stop_workers()
        if self.round is not None:
            self._save_at_breakpoint("terminated")
            self._await_agreement()
        return 128 + signum

    def _start_checkpoint_host(self) -> None:
        if not self.config.checkpoint_host:
            return
        if self.ckpt.start(
            settings=self.config.checkpoint,
            shm_root=SHM_DIR,
            job_id=self.config.job_id,
            node_id=self.config.node_id,
            master_addr=self.config.master_addr,
            token_file=self.config.token_file,
            incarnation=self.incarnation,
            release_also=self._beacon_paths(),  # a SIGKILLed agent cannot remove them itself
        ):
            self.base_env.update(self.ckpt.env())  # every worker and warm spare finds the host

    def _run(self) -> int:
        reg = self._retry(self._register, "register")
        interval = reg.heartbeat_interval_s or 1.0
        self.link = Link(
            client=self.client,
            node_id=self.config.node_id,
            incarnation=self.incarnation,
            interval_s=interval,
            shipper=self.shipper,
            reregister=self._reregister,
        )
        self.link.start()
        self.say(f"registered with the master (heartbeat every {interval:g}s); joining the rendezvous")
        if self.config.warm_spares:
            # Join only once the spares are warm: a node that joins a running job must not make the
            # others wait in a new round while it is still importing torch.
            self._fill_spares()
            deadline = time.monotonic() + SPARE_WARMUP_LIMIT_S
            while not all(s.ready() for s in self.spares.values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.say("warm spares ready")
        return self._loop()

    def _loop(self) -> int:
        regroup = False
        while True:
            info = self._rendezvous()
            self.breakpoints.unsettled = None  # a job that goes on gets the master's persist request instead
            previous, self.round = self.round, info
            self.last_round = info.round
            if regroup and self.workers and all(w.proc.poll() is None for w in self.workers.values()):
                round_file.write(self.round_path, info)
                for lr, w in self.workers.items():
                    w.rank = info.rank(lr)
                self.say(f"regrouped in place: round {info.round}, world size {info.world_size}")
            else:
                if self.workers:
                    self._stop_workers()
                if previous is not None:
                    self.total_restarts += 1
                    if set(info.members) != set(previous.members):
                        # A newcomer loads from storage: it must find the step this node still writes.
                        self.breakpoints.finish_pending()
                self._start_workers(info)
            regroup = False
            self.link_publish(pb.NODE_STATE_RUNNING, info.round)
            event = self._monitor()
            if event.kind in ("failed", "hang"):
                nxt = self._handle_failure(event)
                if nxt.kind == "exit":
                    if nxt.job_ended:
                        self._await_agreement()
                    raise AgentExit(nxt.exit_code, nxt.reason)
                self.restarts += 1
                self.say(f"restarting in place ({self.restarts}/{self.config.max_restarts}): {nxt.reason}")
            elif event.kind == "succeeded":
                done = self._complete()
                if done is not None:
                    raise AgentExit(*done)
                self.say("a new round opened after this node finished; rejoining")
            elif event.kind == "exit":
                assert event.action is not None
                if event.action.exit_code != 0 and decisions.job_ended(event.action):
                    # The job failed while these workers ran: storage keeps their newest step for the job's
                    # next run. (A node evicted from a job that goes on leaves the state to the survivors.)
                    self.link_publish(pb.NODE_STATE_FAILED, info.round)
                    self._stop_workers()
                    self._save_at_breakpoint("leaving the job")
                    self._await_agreement()
                raise AgentExit(event.action.exit_code, event.reason or "told to exit")
            elif event.kind == "rejoin":
                mode = decisions.rejoin_mode(
                    own_failure=False,
                    regroup_capable=self._regroup_capable(),
                    workers_alive=all(w.proc.poll() is None for w in self.workers.values()),
                )
                self.say(f"membership changed ({event.reason}); {mode.value}")
                if mode is decisions.RejoinMode.REGROUP:
                    regroup = True
                else:
                    self.link_publish(pb.NODE_STATE_RESTARTING, info.round)
                    self._stop_workers()
                    self._save_at_breakpoint("membership change")

    def _complete(self) -> tuple[int, str] | None:
        """Reports success; returns the exit code and reason, or None when the node must rejoin (another
        node failed before the job finished: the workers resume from the last checkpoint)."""
        assert self.round is not None
        self.say("all local workers finished successfully")
        ranks, _ = self._progress(time.monotonic())
        self.link_publish(pb.NODE_STATE_SUCCEEDED, self.round.round, ranks)
        if self.link is not None:
            # The master learns the final steps before it hears of the completion.
            with contextlib.suppress(TransportError):
                self.link.beat_now()
        self.workers_done()
        resp = self._retry(
            lambda: self.client.report_completion(
                pb.ReportCompletionRequest(
                    node_id=self.config.node_id,
                    incarnation=self.incarnation,
                    round=self.round.round if self.round else 0,
                )
            ),
            "report completion",
        )
        action: pb.Action | None = resp.action
        while True:
            if action is not None and action.kind == pb.ACTION_KIND_EXIT:
                return action.exit_code, action.reason or "job finished"
            if action is not None and decisions.is_new_rejoin(action, current_round=self.round.round):
                self.workers = {}
                return None
            action = self._next_action(timeout=1.0)

    def workers_done(self) -> None:
        for w in self.workers.values():
            w.close_logs()

    def _shutdown(self) -> None:
        self.probes.stop()
        for spare in self.spares.values():
            spare.discard()
        self.spares = {}
        if self.workers:
            self._stop_workers()
        if self.link is not None:
            self.link.stop()
            # One last heartbeat-free moment: give queued log lines a chance to reach the master.
            with contextlib.suppress(TransportError):
                batch, dropped = self.shipper.take()
                if batch or dropped:
                    self.client.report_logs(
                        pb.ReportLogsRequest(
                            node_id=self.config.node_id,
                            incarnation=self.incarnation,
                            lines=batch,
                            dropped=dropped,
                        ),
                        timeout=1.0,
                    )
            self.link.leave()  # after the logs: the master may forget a node that left
        self.breakpoints.finish_pending()
        self.ckpt.stop()  # after the workers: nothing writes to the segments it unlinks
        self._close_rings()
        for path in self._beacon_paths():
            with contextlib.suppress(OSError):
                path.unlink()

    def _beacon_paths(self) -> list[Path]:
        """The shared-memory files of the workers: beacons and interval rings."""
        return [
            where(shm_dir=SHM_DIR, job_id=self.config.job_id, node_id=self.config.node_id, local_rank=lr)
            for lr in range(self.config.nproc_per_node)
            for where in (worker_env.beacon_path, worker_env.intervals_path)
        ]


_NO_ROUND = RoundInfo(
    round=0, group_rank=0, rank_offset=0, world_size=0, local_world_size=0, store_host="", store_port=0
)


def _free_port(host: str) -> int:
    """A port free right now on this host; fresh for every round so no stale c10d store is reused."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])
