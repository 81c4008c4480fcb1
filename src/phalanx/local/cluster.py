"""``phalanx local``: a master and N node agents on this machine, evictions carried out, faults injected.

It plays the operator's part: it starts ``phalanx master`` and one ``phalanx-run`` per node (node ids
``node-0``, ``node-1``, ...), polls the master's HTTP API, kills evicted nodes and starts replacements
(new node ids) within a budget, injects the requested faults, shows live progress, and at the end
writes the summary.

:class:`LocalCluster` is the loop that observes and carries out; each of its jobs is a room of its own:
the processes (:mod:`.fleet`), the master's HTTP API (:mod:`.watch`), fault injection (:mod:`.faults`),
what became of each fault (:mod:`.accounting`), the console (:mod:`.console`), and the decisions, pure
(:mod:`.decide`).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import TextIO

from phalanx.local import accounting, cpulimit
from phalanx.local.console import Console
from phalanx.local.decide import (
    RunState,
    Steps,
    new_evictions,
    run_end,
    split_due,
    status_line,
)
from phalanx.local.faults import Faults
from phalanx.local.fleet import Fleet
from phalanx.local.options import LocalOptions
from phalanx.local.report import Summary, table
from phalanx.local.watch import MasterWatch

__all__ = ["LocalCluster", "LocalOptions"]  # LocalOptions lives in .options: the fleet reads it too

POLL_S = 0.05
UNPLACED_EXIT = 3
"""The exit code of a run that would have passed but left a fault it was asked for uninjected."""


class LocalCluster:
    def __init__(self, options: LocalOptions, *, out: TextIO = sys.stdout) -> None:
        self.o = options
        self.job_id = options.job_id or f"local-{secrets.token_hex(3)}"
        self.console = Console(out)
        self.fleet = Fleet(options, job_id=self.job_id)
        self.watch = MasterWatch()
        self.summary = Summary(job_id=self.job_id)
        self.faults = Faults(
            options.injections, fleet=self.fleet, console=self.console, failures=self.summary.failures
        )
        self.replacements = 0
        self.handled_evictions: set[str] = set()
        self.due_replacements: list[tuple[float, str]] = []
        self.t0_unix_ns = 0
        self.max_step = -1

    def _start_node(self) -> str:
        fleet = self.fleet
        targeted = self.faults.targeting(fleet.next_index)
        return fleet.start_node(targeted=targeted, now=self.console.elapsed()).node_id

    # -------------------------------------------------------------------------------------------------
    # observation

    def _poll_master(self) -> bool:
        poll = self.watch.poll(self.console.elapsed)
        if not poll.up:
            return False
        if poll.back:
            self.console.say("master answers again")
        accounting.master_answers(self.summary.failures, at=self.console.elapsed())
        for event in poll.events:
            self.console.say(accounting.event_line(event))
            accounting.on_event(self.summary.failures, event)
        return True

    def _track(self, steps: Steps) -> None:
        """Recovery accounting from what was observed; the lines it returns are shown."""
        job, failures = self.watch.job, self.summary.failures
        for line in accounting.track_recovery(
            failures,
            job=job,
            steps=steps,
            t0_unix_ns=self.t0_unix_ns,
            now_ns=time.time_ns(),
            at=self.console.elapsed(),
            is_running=_running,
        ):
            self.console.say(line)
        for line in accounting.track_fold_ins(
            failures, job=job, steps=steps, at=self.console.elapsed(), now_ns=time.time_ns()
        ):
            self.console.say(line)

    # -------------------------------------------------------------------------------------------------
    # actions

    def _carry_out_evictions(self) -> None:
        say = self.console.say
        job = self.watch.job
        for ev in new_evictions(job.evictions if job else [], handled=self.handled_evictions):
            node_id = ev.node_id
            self.handled_evictions.add(node_id)
            node = self.fleet.nodes.get(node_id)
            if node is not None:
                node.evicted = True
                if node.alive:
                    self.fleet.kill_node(node)
            accounting.evicted(self.summary.failures, node=node_id, reason=ev.reason)
            entry = {**ev.model_dump(mode="json"), "at": round(self.console.elapsed(), 3)}
            if self.replacements < self.o.max_replacements:
                self.replacements += 1
                self.due_replacements.append((self.console.elapsed() + self.o.replace_delay_s, node_id))
                say(f"evicted {node_id} ({ev.reason}); a replacement follows")
            else:
                say(f"evicted {node_id}; replacement budget ({self.o.max_replacements}) spent")
            self.summary.evictions.append(entry)

    def _start_replacements(self) -> None:
        for due, lost in split_due(self.due_replacements, now=self.console.elapsed()):
            self.due_replacements.remove((due, lost))
            new = self._start_node()
            self.console.say(f"started {new} to replace {lost}")
            accounting.replaced(
                self.summary.failures, self.summary.evictions, lost=lost, new=new, job=self.watch.job
            )

    # -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.console.start()
        self.t0_unix_ns = time.time_ns()
        self.summary.started_unix = self.t0_unix_ns / 1e9
        pending = self.faults.pending
        if any(inj.kind == "slow-cpu" for inj in pending):
            cpulimit.check_privileges()
        if self.o.private_network or any(inj.kind == "slow-network" for inj in pending):
            self.fleet.open_network()
        master, workdir = self.fleet.master, self.fleet.workdir
        master.start()
        self.watch.open(http_addr=master.http_addr, token=self.fleet.token)
        self.console.say(
            f"job {self.job_id}: master at {master.grpc_addr} (http {master.http_addr}); "
            f"starting {self.o.initial} nodes x {self.o.nproc_per_node} processes; logs in {workdir}"
        )
        try:
            for _ in range(self.o.initial):
                self._start_node()
            return self._loop()
        finally:
            self.fleet.stop_nodes()
            self.fleet.close()
            self.watch.close()
            self.fleet.remove_leftovers()
            self._finish()

    def _loop(self) -> int:
        state = RunState()
        while True:
            up = self._poll_master()
            steps = self.fleet.read_steps()
            if steps:
                self.max_step = max(self.max_step, *(s for s, _, _ in steps.values()))
            self._track(steps)
            self.faults.track_host_faults()
            self.faults.inject(steps, max_step=self.max_step, job=self.watch.job)
            self.faults.heal()
            if up:
                self._carry_out_evictions()
            self._start_replacements()
            if up:
                line = status_line(max_step=self.max_step, job=self.watch.job, alive=self.fleet.alive())
                self.console.status(line)
            job = self.watch.job
            state, end = run_end(
                state,
                phase=job.phase if job else None,
                reason=job.reason if job else "",
                any_alive=self.fleet.any_alive(),
                work_left=bool(self.faults.pending or self.due_replacements),
                now=self.console.elapsed(),
                timeout_s=self.o.timeout_s,
            )
            if end is not None:
                if end.exit:
                    self.summary.exit = end.exit
                self.summary.reason = end.reason
                return self._unplaced(end.code)
            time.sleep(POLL_S)

    def _unplaced(self, code: int) -> int:
        """A fault the run asked for and never placed fails the run (exit 3 where it would have passed):
        a test or a benchmark that asked for a fault must not pass without it."""
        missed = [inj.spec for inj in self.faults.pending]
        if not missed:
            return code
        self.summary.not_injected = missed
        self.console.say(f"ERROR: never injected (the run ended first): {', '.join(missed)}")
        if code == 0:
            self.summary.exit = "failed"
            self.summary.reason = f"{len(missed)} fault(s) never injected: {', '.join(missed)}"
            return UNPLACED_EXIT
        return code

    def _finish(self) -> None:
        s, job = self.summary, self.watch.job
        s.wall_seconds = self.console.elapsed()
        s.rounds = job.round if job else 0
        s.steps_completed = max(self.max_step, job.max_step if job else -1) + 1
        if not s.reason and job and job.reason:
            s.reason = job.reason
        self.console.say("done")
        self.console.show(table(s))
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
