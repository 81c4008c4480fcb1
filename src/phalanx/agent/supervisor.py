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
from collections.abc import Mapping
from pathlib import Path

from phalanx.agent import breakpoints, checkpointing, decisions, failures, probes
from phalanx.agent.client import MasterClient
from phalanx.agent.config import AgentConfig
from phalanx.agent.link import Link, LogShipper
from phalanx.agent.outcomes import AgentExit, Event, Terminated
from phalanx.agent.pool import SHM_ROOT, WorkerPool
from phalanx.agent.session import MasterSession
from phalanx.api.errors import RendezvousClosedError, TransportError
from phalanx.api.round import RoundInfo
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.diagnostics.classify import FailureClass

USER_ERROR_SETTLE_S = 1.0  # how long other local workers get to fail too after a user error
AGREEMENT_WAIT_S = 10.0  # beyond the grace period, how long a leaving node waits for the others' reports
SPARE_WARMUP_LIMIT_S = 300.0  # a node joins after this long even if its spares are still importing


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
        self.session = MasterSession(
            config,
            client=client,
            incarnation=self.incarnation,
            machine=self.base_env.get("PHALANX_MACHINE", ""),
            say=self.say,
        )
        self.shipper = LogShipper(config.logs)
        self.link: Link | None = None
        self.pool = WorkerPool(
            config, base_env=self.base_env, log_dir=log_dir, sink=self._on_line, say=self.say
        )
        self.round: RoundInfo | None = None
        self.restarts = 0  # failure restarts, counted against --max-restarts
        self.total_restarts = 0
        self._echo_lock = threading.Lock()
        self.ckpt = checkpointing.NodeCheckpointHost(self.say)
        self.breakpoints = breakpoints.Breakpoints(
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
            fork_server=self.pool.fork_probe_server,  # from the zygote, which imported torch already
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

    # -------------------------------------------------------------------------------------------------
    # workers

    def _local_ranks(self) -> list[int]:
        """This node's global ranks in the current round."""
        return [self.round.rank(lr) for lr in range(self.config.nproc_per_node)] if self.round else []

    def _stop_workers(self) -> dict[int, int]:
        return self.pool.stop()

    # -------------------------------------------------------------------------------------------------
    # rendezvous

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
            self._on_the_side(action, running=False)

    def _on_the_side(self, action: pb.Action, *, running: bool) -> None:
        """Carries out an action that leaves the workers as they are, whether they run or not: a probe (on
        its own thread: monitoring and heartbeats go on; a node between rounds is the one to probe), a
        persist request, and, while workers run, a stack dump. Any other action is the caller's."""
        if action.kind == pb.ACTION_KIND_DUMP_STACKS and running:
            self._send_stacks()
        elif action.kind == pb.ACTION_KIND_RUN_PROBE:
            self.probes.start(action)
        elif action.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT:
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
            codes = {lr: w.proc.poll() for lr, w in self.pool.workers.items()}
            outcome, failed = decisions.workers_outcome(codes)
            if outcome is decisions.Outcome.FAILED:
                return Event("failed", failed, seen_unix_ns=dict.fromkeys(failed, time.time_ns()))
            if outcome is decisions.Outcome.SUCCEEDED:
                return Event("succeeded")
            ranks, hung = self.pool.progress(now)
            self.link_publish(pb.NODE_STATE_RUNNING, self.round.round, ranks)
            if hung is not None:
                return Event("hang", [hung.local_rank], reason=hung.reason, evidence=hung.evidence)
            while not self.link.actions.empty():
                action = self.link.actions.get_nowait()
                if action.kind == pb.ACTION_KIND_EXIT:
                    return Event("exit", action=action, reason=action.reason)
                if decisions.is_new_rejoin(action, current_round=self.round.round):
                    return Event("rejoin", action=action, reason=action.reason)
                self._on_the_side(action, running=True)
            if self.config.warm_spares:
                self.pool.maybe_refill(now)
            time.sleep(self.config.monitor_interval_s)

    def _send_stacks(self, reason: str = "") -> None:
        entries = failures.rank_stacks(self.pool.workers, self.pool.histories, now=time.monotonic())
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
            failures.classify_local(self.pool.workers[lr]) in (FailureClass.USER, FailureClass.COMM)
            for lr in event.local_ranks
        ):
            return event
        seen = dict(event.seen_unix_ns)
        deadline = time.monotonic() + USER_ERROR_SETTLE_S
        running = self.pool.workers
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in running.values()):
            time.sleep(0.05)
            for lr, w in running.items():
                if lr not in seen and w.proc.poll() is not None:
                    seen[lr] = time.time_ns()
        failed = sorted(lr for lr, w in running.items() if w.proc.poll() not in (None, 0))
        return Event("failed", failed, seen_unix_ns=seen)

    def _handle_failure(self, event: Event) -> decisions.Next:
        event = self._settle(event)
        if event.kind == "hang":
            self.say(event.reason)
            if event.evidence is not None and event.evidence.nccl_trace:
                self.say(hang.flight_recorder_summary(event.evidence.nccl_trace))
            self._send_stacks("(hang)")
        assert self.round is not None
        hung = event.kind == "hang"
        entries = [
            failures.worker_failure(
                lr,
                self.pool.workers[lr],
                hung=hung,
                reason=event.reason,
                history=self.pool.histories.get(lr),
                evidence=event.evidence,
                observed_unix_ns=event.seen_unix_ns.get(lr, 0),
            )
            for lr in event.local_ranks
        ]
        self.link_publish(pb.NODE_STATE_RESTARTING, self.round.round if self.round else 0)
        running = {lr: w for lr, w in self.pool.workers.items() if lr not in event.local_ranks}
        marks = failures.mark_stop(running) if not hung else {}
        self._stop_workers()
        if not hung:
            # Ranks that raised too but were slower than the settle to exit: the master needs every rank's
            # error to tell a bug on every rank (fail at once) from one bad rank (restart).
            late = failures.raised_before(running, marks)
            entries += [
                failures.worker_failure(
                    lr,
                    w,
                    hung=False,
                    reason="",
                    history=self.pool.histories.get(lr),
                    stopped_after_raising=True,
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
        resp = self.session.retry(
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
        if self.pool.workers:
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
            shm_root=SHM_ROOT,
            job_id=self.config.job_id,
            node_id=self.config.node_id,
            master_addr=self.config.master_addr,
            token_file=self.config.token_file,
            incarnation=self.incarnation,
            release_also=self.pool.shm_files(),  # a SIGKILLed agent cannot remove them itself
        ):
            self.base_env.update(self.ckpt.env())  # every worker and warm spare finds the host

    def _run(self) -> int:
        reg = self.session.retry(self.session.register, "register")
        interval = reg.heartbeat_interval_s or 1.0
        self.link = Link(
            client=self.client,
            node_id=self.config.node_id,
            incarnation=self.incarnation,
            interval_s=interval,
            shipper=self.shipper,
            reregister=self.session.reregister,
        )
        self.session.on_reregistered = self.link.forget_acks
        self.link.start()
        self.say(f"registered with the master (heartbeat every {interval:g}s); joining the rendezvous")
        if self.config.warm_spares:
            # Join only once the spares are warm: a node that joins a running job must not make the
            # others wait in a new round while it is still importing torch.
            self.pool.warm_up(deadline=time.monotonic() + SPARE_WARMUP_LIMIT_S)
            self.say("warm spares ready")
        return self._loop()

    def _loop(self) -> int:
        regroup = False
        while True:
            info = self.session.join_round(
                previous=self.round,
                joined=lambda r: self.link_publish(pb.NODE_STATE_RENDEZVOUS, r),
                waiting=self._drain_exit_actions,
            )
            self.breakpoints.unsettled = None  # a job that goes on gets the master's persist request instead
            previous, self.round = self.round, info
            if regroup and self.pool.workers and self.pool.all_alive():
                self.pool.regroup(info)
                self.say(f"regrouped in place: round {info.round}, world size {info.world_size}")
            else:
                if self.pool.workers:
                    self._stop_workers()
                if previous is not None:
                    self.total_restarts += 1
                    if set(info.members) != set(previous.members):
                        # A newcomer loads from storage: it must find the step this node still writes.
                        self.breakpoints.finish_pending()
                self.pool.start(info)
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
                    regroup_capable=self.pool.regroup_capable(self.round),
                    workers_alive=self.pool.all_alive(),
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
        ranks, _ = self.pool.progress(time.monotonic())
        self.link_publish(pb.NODE_STATE_SUCCEEDED, self.round.round, ranks)
        if self.link is not None:
            # The master learns the final steps before it hears of the completion.
            with contextlib.suppress(TransportError):
                self.link.beat_now()
        self.pool.close_logs()
        resp = self.session.retry(
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
                self.pool.workers = {}
                return None
            action = self._next_action(timeout=1.0)

    def _shutdown(self) -> None:
        self.probes.stop()
        self.pool.discard_spares()
        if self.pool.workers:
            self._stop_workers()
        self.pool.close_zygote()
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
        self.pool.close_rings()
        for path in self.pool.shm_files():
            with contextlib.suppress(OSError):
                path.unlink()
