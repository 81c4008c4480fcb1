"""The job's durable state: what a restarted master resumes from (a JSON object).

Fields: ``version``, ``job_id``, ``phase``, ``reason``, ``started_unix``, ``round`` (number, members with
group ranks, world size, store address) or null, ``next_round``, ``round_open``, ``restart_count``,
``evictions``, ``committed_checkpoint_step``, ``nodes`` (node id -> incarnation, host, machine, nproc, status,
old incarnations), ``hang_counts``, ``completed``, ``root_cause``, ``event_seq``, ``action_seq``,
``suspended``, ``next_probe`` and ``recovery`` (the recovery in progress and the finished ones' totals,
:meth:`~phalanx.master.state.recovery.RecoveryTracker.to_json`): the durable fields of
:class:`~phalanx.master.state.jobstate.JobState`; and ``pending_restart``, the restart event still waiting for
the round's root cause (:class:`~phalanx.master.state.jobstate.PendingRestart`) or null. A state saved before
a key was added loads without it (``recovery`` and ``pending_restart`` then start empty).

Not durable, by design: heartbeat times (a restarted master gives every node one heartbeat timeout to
reappear), the joiners of a round still gathering (their GetRendezvous then answers NOT_MEMBER and they
join again), log rings, the event log itself and probe rounds (a running one is simply lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.errors import StateStoreError
from phalanx.api.verdicts import Eviction
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.state.checkpoints import CheckpointTracker
from phalanx.master.state.events import EventLog
from phalanx.master.state.jobstate import JobState, PendingRestart
from phalanx.master.state.nodes import Node
from phalanx.master.state.recovery import RecoveryTracker

__all__ = ["EVENT_SEQ_GAP", "STATE_VERSION", "durable", "pending_restart", "restore"]

STATE_VERSION = 1
EVENT_SEQ_GAP = 1000
"""How far a restarted master's event and action seqs skip past the saved counters: events and actions
after the last save died with the old master, and a seq a poller or an agent saw must stay below the new
ones."""


def durable(job: JobState) -> dict[str, Any]:
    """The state a restarted master resumes from (JSON)."""
    r = job.round
    return {
        "version": STATE_VERSION,
        "job_id": job.job_id,
        "phase": job.phase,
        "reason": job.reason,
        "started_unix": job.started_unix,
        "round": None
        if r is None
        else {
            "number": r.number,
            "members": [
                {
                    "node_id": m.node_id,
                    "group_rank": m.group_rank,
                    "nproc": m.nproc,
                    "rank_offset": m.rank_offset,
                    "newcomer": m.newcomer,
                }
                for m in r.members
            ],
            "world_size": r.world_size,
            "store_host": r.store_host,
            "store_port": r.store_port,
            "completed_at": r.completed_at,
        },
        "next_round": job.next_round,
        "round_open": job.round_open,
        "restart_count": job.restart_count,
        "evictions": [e.to_dict() for e in job.evictions],  # copies: written from a worker thread
        "committed_checkpoint_step": job.checkpoints.committed,
        "nodes": {n.node_id: n.durable() for n in job.nodes.values()},
        "hang_counts": dict(job.hang_counts),
        "completed": sorted(job.completed),
        "root_cause": job.root_cause,
        "event_seq": job.events.next_seq,
        "action_seq": job.action_seq,
        "suspended": job.suspended,
        "next_probe": job.next_probe,
        "recovery": job.recovery.to_json(),
        "pending_restart": None if job.pending_restart is None else job.pending_restart.to_json(),
    }


def restore(job: JobState, saved: Mapping[str, Any], *, now: float) -> None:
    """Loads ``saved`` into a freshly built job; every node gets one heartbeat timeout to reappear."""
    if saved.get("job_id") != job.job_id:
        raise StateStoreError(
            f"the saved master state belongs to job {saved.get('job_id')!r}, not {job.job_id!r}; "
            f"use another --state"
        )
    try:
        job.phase = Phase(str(saved["phase"]))
        job.reason = str(saved.get("reason", ""))
        job.started_unix = float(saved.get("started_unix", now))
        r = saved.get("round")
        if r:
            job.round = rdzv.Round(
                number=int(r["number"]),
                members=tuple(
                    rdzv.Member(
                        node_id=str(m["node_id"]),
                        group_rank=int(m["group_rank"]),
                        nproc=int(m["nproc"]),
                        rank_offset=int(m["rank_offset"]),
                        newcomer=bool(m.get("newcomer", False)),
                    )
                    for m in r["members"]
                ),
                world_size=int(r["world_size"]),
                store_host=str(r["store_host"]),
                store_port=int(r["store_port"]),
                completed_at=float(r.get("completed_at", now)),
            )
        job.next_round = int(saved["next_round"])
        job.round_open = bool(saved["round_open"])
        job.restart_count = int(saved["restart_count"])
        job.evictions = [Eviction.from_dict(e) for e in saved.get("evictions", [])]
        job.checkpoints = CheckpointTracker(committed=int(saved.get("committed_checkpoint_step", -1)))
        job.nodes = {k: Node.from_durable(k, v, now=now) for k, v in dict(saved.get("nodes", {})).items()}
        job.hang_counts = {str(k): int(v) for k, v in dict(saved.get("hang_counts", {})).items()}
        job.completed = {str(n) for n in saved.get("completed", [])}
        job.root_cause = saved.get("root_cause")
        job.suspended = bool(saved.get("suspended", False))
        job.recovery = RecoveryTracker.from_json(saved.get("recovery"))
    except (KeyError, TypeError, ValueError) as exc:
        raise StateStoreError(f"the saved master state is incomplete or malformed: {exc!r}") from exc
    # Probe ids stay unique across master restarts, so a report to the old master stays stale.
    job.next_probe = int(saved.get("next_probe", 1))
    job.opened_at = now
    job.below_min_since = now if len(job.alive()) < job.settings.rendezvous.min_nodes else None
    # A new log, past the gap: ``since=<last seen>`` never hides a new event; likewise an action pushed
    # after the last save must not reuse a seq an agent already acknowledged.
    job.events = EventLog(first_seq=int(saved.get("event_seq", 1)) + EVENT_SEQ_GAP)
    job.action_seq = int(saved.get("action_seq", 0)) + EVENT_SEQ_GAP
    job.pending_restart = pending_restart(saved)


def pending_restart(saved: Mapping[str, Any]) -> PendingRestart | None:
    """The restart event ``saved`` still held back, or None (none, or a state saved before it was durable)."""
    found = saved.get("pending_restart")
    if found is None:
        return None
    try:
        return PendingRestart.from_json(found)
    except (KeyError, TypeError, ValueError) as exc:
        raise StateStoreError(f"the saved master state is incomplete or malformed: {exc!r}") from exc
