"""What a job's master serves over HTTP, as typed views: the contract between the master and whoever reads it
(``phalanx status``, ``phalanx local``, the ElasticJob's status, dashboards' scripts).

The master builds these models and FastAPI serves them with ``response_model``, so its OpenAPI schema
(``GET /openapi.json``) is the contract and mypy checks every field a builder sets. Readers parse an answer
with ``JobView.model_validate(payload)`` and read attributes, not keys.

Evolution: fields are added, never renamed or removed. A reader keeps the fields it does not know
(``extra="allow"``: an older client of a newer master neither fails nor drops them when it prints JSON).
The values of the enumerated fields (``Literal`` types, :class:`Phase`) are part of the contract: a new
value is a change of the API that its readers get with it (an older one refuses the answer with a message
that names the field), so a value is added only when the readers of this repository handle it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from phalanx.api.elasticjob import Phase

__all__ = [
    "EventView",
    "EventsPage",
    "EvictionView",
    "HangAnalysisView",
    "Health",
    "JobView",
    "LogLine",
    "LogsPage",
    "NodeStatusName",
    "NodeView",
    "NodesView",
    "PeerProbe",
    "ProbeResult",
    "ProbeRound",
    "ProbeStarted",
    "ProbeVerdict",
    "RankView",
    "RootCause",
    "SlowRank",
    "Straggler",
    "StragglerVerdict",
    "TimelineFailure",
    "TimelineInterval",
    "TimelineRank",
    "TimelineView",
    "View",
]


ProbeResult = Literal["running", "ok", "suspects", "evicted", "inconclusive", "aborted"]
NodeStatusName = Literal["alive", "lost", "evicted"]
StragglerVerdict = Literal["ok", "suspect", "slow"]


class View(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class Health(View):
    status: Literal["ok"] = "ok"
    phase: Phase


class EvictionView(View):
    """A node the master asked to evict (the operator replaces it on another machine)."""

    node_id: str
    machine: str
    reason: str
    kind: str = Field(
        description="What found it: heartbeat_timeout, connection_closed, hardware, hang, probe_failed, "
        "straggler, ..."
    )
    requested_at: float


class RootCause(View):
    """The first real failure of the latest failed round; a peer's communication error (an echo) only when
    nothing else failed."""

    node_id: str
    round: int
    rank: int
    local_rank: int
    exit_code: int
    failure_class: str = Field(description="user, killed, oom, comm, hardware, hang or unknown")
    kind: str = Field(description="worker_exit, hang or launch")
    message: str
    traceback: str
    log_tail: list[str]
    unix: float
    last_step: int
    explanation: str = Field(
        "",
        description='One sentence: "rank 1 on node-1 SIGKILLed at 12:00:01.2 UTC; ranks 0, 2, 3 lost their '
        'peer after it"',
    )


class HangAnalysisView(View):
    """What the stacks of a hung round's nodes said."""

    round: int
    hung_node: str = Field(description="The node whose agent found the hang.")
    odd_nodes: list[str]
    odd_ranks: list[int]
    nodes_reported: list[str]
    reason: str
    blamed: str = Field(
        "", description='The node the hang counts against ("": the evidence singled out none).'
    )


class ProbeVerdict(View):
    node_id: str
    kind: str
    confidence: str
    value: float
    reference: float
    reason: str


class ProbeRound(View):
    """The running or latest probe round (pairwise matmul and all-gather health probes)."""

    id: int
    round: int
    trigger: str
    result: ProbeResult
    members: list[str]
    started_unix: float
    finished_unix: float | None
    reported: dict[str, list[str]] = Field(
        description="probe kind (matmul, allgather) -> nodes that reported"
    )
    stale_reports: int
    verdicts: list[ProbeVerdict]
    evicted: list[str]


class ProbeStarted(View):
    """The answer of ``POST /v1/probe`` (202)."""

    probe: ProbeRound


class SlowRank(View):
    """A rank of the running round whose step intervals lag the others' (the step-time check)."""

    rank: int
    node: str
    median_interval_s: float
    reference_s: float
    reason: str


class JobView(View):
    """``GET /v1/job``: the job's status; also what the master publishes into the ElasticJob's status."""

    job_id: str
    phase: Phase
    suspended: bool = Field(description="the ElasticJob's spec.suspend, as the master follows it")
    spec_generation: int = Field(description="the ElasticJob generation it follows (0 outside Kubernetes)")
    reason: str = Field(description='why the job ended (or ""), one sentence')
    round: int = Field(description="latest completed rendezvous round, 0 before the first")
    open_round: int | None = Field(description="the round gathering now, if any")
    world_size: int = Field(description="processes in `round`")
    members: list[str] = Field(description="nodes of `round` in group-rank order")
    waiting: list[str] = Field(description="nodes that joined `open_round`")
    min_nodes: int
    max_nodes: int
    nodes_alive: int
    restart_count: int
    max_restarts: int
    eviction_count: int
    max_evictions: int
    evictions: list[EvictionView]
    committed_checkpoint_step: int = Field(description="-1 if none")
    max_step: int = Field(description="highest step any rank reported, -1 before the first")
    root_cause: RootCause | None
    hang_analysis: HangAnalysisView | None
    started_unix: float
    completed: list[str] = Field(description="members that reported completion of `round`")
    probe: ProbeRound | None
    slow_ranks: list[SlowRank]
    unconfirmed_stragglers: dict[str, int] = Field(
        description="node -> probe rounds in a row that found it slow, not yet enough to evict it"
    )


class RankView(View):
    rank: int
    local_rank: int
    step: int
    step_unix: float
    beacon_age_s: float
    pid: int


class PeerProbe(View):
    """One measurement of a node's probe against a peer."""

    peer_node_id: str
    ok: bool
    elapsed_s: float
    rate: float
    error: str
    unix: float
    probe_round: int


class Straggler(View):
    """A node's latest step-time scores; verdict ``ok``, ``suspect`` while being confirmed, ``slow`` once
    confirmed."""

    verdict: StragglerVerdict
    basis: Literal["compute", "step"]
    step_time_s: float
    value_s: float
    relative: float
    reference_s: float
    individual: float
    baseline_s: float
    slow_checks: int
    reason: str


class NodeView(View):
    node_id: str
    incarnation: str
    host: str
    machine: str
    nproc: int
    agent_version: str
    status: NodeStatusName
    state: str = Field(
        description="idle, rendezvous, running, restarting, succeeded, failed, leaving (or unknown)"
    )
    round: int
    last_heartbeat_unix: float
    heartbeat_age_s: float
    disconnected_unix: float | None = Field(
        description="when a held heartbeat's connection closed and the node was not heard from since"
    )
    ranks: list[RankView]
    agent_restarts: int
    memory_checkpoint_step: int
    probes: dict[str, list[PeerProbe]] = Field(description="probe kind (matmul, allgather) -> measurements")
    exit_reason: str
    member: bool
    group_rank: int = Field(description="-1 if not a member")
    hang_count: int
    straggler: Straggler | None = Field(description="null when the latest check did not score the node")


class NodesView(View):
    """``GET /v1/nodes``."""

    nodes: list[NodeView]


class EventView(View):
    seq: int = Field(description="one more per event; jumps forward (never back) when the master restarts")
    unix: float
    kind: str = Field(
        description="job_started, master_resumed, node_registered, node_replaced, node_joined, round_open, "
        "round_complete, node_disconnected, node_lost, failure, restart, root_cause (a later report named a "
        "better root cause than the restart went by), eviction_requested, hang, hang_analysis, "
        "checkpoint_breakpoint, checkpoint_committed, checkpoint_failed, node_completed, job_succeeded, "
        "job_failed, probe_started, probe_finished, probe_failed, straggler, slow_steps, job_suspended, "
        "job_resumed, node_left; a reader skips a kind it does not know"
    )
    node: str
    rank: int
    round: int
    message: str


class EventsPage(View):
    """``GET /v1/events?since=SEQ&limit=N``: events with ``seq > since``, oldest first."""

    events: list[EventView]
    next_seq: int


class LogLine(View):
    unix: float
    node: str
    rank: int
    local_rank: int
    stream: str = Field(description="out or err")
    text: str


class LogsPage(View):
    """``GET /v1/logs?node=&rank=&tail=N``: the newest lines of the matching (node, rank) rings, oldest
    first."""

    lines: list[LogLine]


class TimelineInterval(View):
    name: str
    group: str
    seq: int
    start_unix_ns: int
    end_unix_ns: int = Field(description="0 while open")
    device: bool
    open: bool
    unfinished: bool = Field(description="closed by the master: the process that opened it is gone")


class TimelineRank(View):
    node: str
    rank: int
    local_rank: int
    pid: int
    last_beat_unix: float
    intervals: list[TimelineInterval]


class TimelineFailure(View):
    id: int = Field(description="the failure's event seq")
    unix: float
    kind: str
    node: str
    rank: int
    round: int
    message: str
    hang: list[dict[str, Any]] | None = Field(
        None, description="a hang's evidence per rank, as its agent reported it (stacks, flight recorder)"
    )


class TimelineView(View):
    """``GET /v1/timeline``: the ranks' recent intervals, at most 65,536, each rank's newest share."""

    now_unix: float
    start_unix: float
    end_unix: float
    ranks: list[TimelineRank]
    failures: list[TimelineFailure]
    around_failure: TimelineFailure | None
    refused: int
    kept: int
    omitted: int = Field(description="intervals left out (narrow with node, rank or window_s)")
    max_age_s: float
