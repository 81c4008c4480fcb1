"""What the master keeps of the ranks' intervals (steps and collectives) for ``phalanx timeline``.

Each heartbeat carries, per rank, the intervals its recorder opened or closed since the previous beat
(``RankProgress.intervals``) and the rank's position (``RankProgress.activity``). :class:`Timeline`
keeps the last minutes of them per (node, rank), bounded three ways so that 1,000 ranks that beat as
fast as they may cannot grow the master:

* by age: intervals that ended more than ``max_age_s`` ago are dropped;
* by count: at most ``per_rank`` intervals per rank, and fewer when many ranks share the ``budget`` (the
  total over all ranks), never fewer than :data:`MIN_PER_RANK`;
* by series: at most ``max_series`` (node, rank) pairs; the one heard from least recently gives way.

Everything an agent sends is checked here, not trusted: names and groups are cut to
:data:`~phalanx.api.limits.MAX_NAME_CHARS`, a beat's intervals to the newest
:data:`~phalanx.api.limits.MAX_INTERVALS_PER_BEAT` per rank, and an interval with an unprintable name,
an end before its start, or a time far from the master's clock is refused (counted in
:attr:`Timeline.refused`), never the heartbeat that carried it: a broken recorder must not stop training.

An interval sent open (``end_unix_ns == 0``) and later sent again closed (same name, group, seq and
start) is one interval. A rank whose process changed (a new pid: the worker restarted) will never close
what its old process left open: those intervals end at the old process's last beat, marked
``unfinished``.

The timeline also remembers each failure (the job's ``failure``, ``hang`` and ``node_lost`` events, with
the event's ``seq`` as the failure's id), so a trace can be cut around one. A hang report's failure keeps
its evidence per rank (:func:`phalanx.diagnostics.hang.evidence_view`): the side, the collective, and the
rank's NCCL flight-recorder dump, which only the newest :data:`MAX_TRACED_FAILURES` failures keep (each dump
is up to 64 KiB a rank).

A :meth:`Timeline.window` answer holds at most :data:`MAX_ANSWER_INTERVALS` intervals, each rank's
newest share, so answering ``GET /v1/timeline`` is bounded work too.

Nothing here is durable: a restarted master starts with an empty timeline.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from phalanx.api import limits
from phalanx.master.state.beat import BeatRanks
from phalanx.master.state.events import Event, EventKind

__all__ = [
    "FAILURE_KINDS",
    "MIN_PER_RANK",
    "Span",
    "Timeline",
]

FAILURE_KINDS: frozenset[EventKind] = frozenset({"failure", "hang", "node_lost"})
"""Events that count as failures on the timeline (drawn as instants, and what ``around=<id>`` names)."""

MIN_PER_RANK = 64
"""The fewest intervals a rank keeps however many ranks share the budget: a few steps' worth."""

CLOCK_SLACK_S = 60.0
"""How far an interval's times may lie ahead of the master's clock (the nodes' clocks drift from it)."""

MAX_OPEN_PER_RANK = 64
"""Open intervals a rank may have waiting for their end; more are kept but never matched to an end."""

MAX_FAILURES = 1000

MAX_TRACED_FAILURES = 16
"""Failures that keep their ranks' NCCL flight-recorder dumps; an older one keeps the rest of its evidence."""

MAX_CACHED_NAMES = 4096
"""Distinct names and groups whose checked form is kept (and shared by every interval that uses it)."""

MAX_ANSWER_INTERVALS = 65_536
"""Intervals one ``window`` answer holds at most (about 12 MiB of JSON)."""

SWEEP_INTERVAL_S = 10.0
"""How often a beat also drops the ranks that went silent (a cost of O(ranks), so not on every beat)."""

_NS = 1_000_000_000


@dataclass(slots=True)
class Span:
    """One interval as the master keeps it; ``end_ns == 0`` while it is open."""

    name: str
    group: str
    seq: int
    start_ns: int
    end_ns: int
    device: bool
    unfinished: bool = False
    """Closed by the master, not the recorder: the process that opened it is gone."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "seq": self.seq,
            "start_unix_ns": self.start_ns,
            "end_unix_ns": self.end_ns,
            "device": self.device,
            "open": self.end_ns == 0,
            "unfinished": self.unfinished,
        }


class IntervalLike(Protocol):
    """The fields of ``phalanx.v1.Interval`` this module reads."""

    name: str
    group: str
    seq: int
    start_unix_ns: int
    end_unix_ns: int
    device: bool


@dataclass(slots=True)
class _Series:
    node: str
    rank: int
    local_rank: int = -1
    pid: int = 0
    last_beat: float = 0.0
    spans: deque[Span] = field(default_factory=deque)
    open: dict[tuple[str, str, int, int], Span] = field(default_factory=dict)


def _cleaned(text: str, cache: dict[str, str | None] | None) -> str | None:
    if cache is None:
        return clean_name(text)
    try:
        return cache[text]
    except KeyError:
        cleaned = clean_name(text)
        if len(cache) < MAX_CACHED_NAMES:  # a recorder sending ever new names gets no cache, not a leak
            cache[text] = cleaned
        return cleaned


def clean_name(text: str) -> str | None:
    """``text`` cut to :data:`MAX_NAME_CHARS`, or None when it holds a character that is not printable
    (a name ends up in a terminal, a JSON trace and a picture)."""
    cut = text[: limits.MAX_NAME_CHARS]
    return cut if cut.isprintable() else None


def accept(
    iv: IntervalLike, *, now: float, max_age_s: float, names: dict[str, str | None] | None = None
) -> Span | None:
    """The interval as kept, or None when it is garbage (see the module docstring). ``names`` caches
    :func:`clean_name`: the few names and groups a job uses are then checked once and stored once, not
    once per interval."""
    name = _cleaned(iv.name, names)
    group = _cleaned(iv.group, names)
    if not name or group is None or iv.seq < 0:
        return None
    start, end = int(iv.start_unix_ns), int(iv.end_unix_ns)
    latest = int((now + CLOCK_SLACK_S) * _NS)
    earliest = int((now - max_age_s - CLOCK_SLACK_S) * _NS)
    if not earliest <= start <= latest:
        return None
    if end != 0 and not start <= end <= latest:
        return None
    return Span(name=name, group=group, seq=int(iv.seq), start_ns=start, end_ns=end, device=bool(iv.device))


class Timeline:
    """Per (node, rank): the recent intervals; and the recent failures. See the module docstring."""

    def __init__(
        self,
        *,
        max_age_s: float = 300.0,
        per_rank: int = 4096,
        budget: int = 262_144,
        max_series: int = 8192,
    ) -> None:
        if not (math.isfinite(max_age_s) and max_age_s > 0):
            raise ValueError(f"max_age_s must be a positive number, got {max_age_s}")
        self.max_age_s = max_age_s
        self.per_rank = max(MIN_PER_RANK, per_rank)
        self.budget = max(self.per_rank, budget)
        self.max_series = max(1, max_series)
        self._series: dict[tuple[str, int], _Series] = {}
        self._series_of: dict[str, int] = {}
        """Node -> how many of its ranks have a series: a beat of a node with none and no recorder is
        passed over without a look at its ranks."""
        self._failures: deque[dict[str, Any]] = deque(maxlen=MAX_FAILURES)
        self._traced: deque[dict[str, Any]] = deque()
        """The failures that hold NCCL dumps, oldest first (at most :data:`MAX_TRACED_FAILURES`)."""
        self.refused = 0
        """Intervals refused as garbage or cut as over a beat's limit, since the master started."""
        self.total = 0
        """Intervals kept now, over all ranks."""
        self._swept = 0.0
        self._names: dict[str, str | None] = {}

    # ------------------------------------------------------------------------------------------------
    # Feeding

    def cap(self) -> int:
        """Intervals each rank may keep now: its share of the budget, within [MIN_PER_RANK, per_rank]."""
        share = self.budget // max(1, len(self._series))
        return max(MIN_PER_RANK, min(self.per_rank, share))

    def observe(self, node_id: str, ranks: BeatRanks, *, now: float) -> None:
        """Takes the ranks of one heartbeat of ``node_id``."""
        if now - self._swept > SWEEP_INTERVAL_S:
            self._swept = now
            self.sweep(now=now)
        if not ranks.recorded and node_id not in self._series_of:
            return  # no recorder on the node (the common case without one, so before any look at a rank)
        for progress in ranks.progress:
            if progress.rank < 0:
                continue
            if (
                not progress.intervals
                and not progress.HasField("activity")
                and (node_id, progress.rank) not in self._series
            ):
                continue  # a rank without a recorder (the common case, so before any copying)
            intervals = list(progress.intervals)
            over = len(intervals) - limits.MAX_INTERVALS_PER_BEAT
            if over > 0:  # the agent sends the newest; keep those
                self.refused += over
                intervals = intervals[over:]
            current = None
            activity = getattr(progress, "activity", None)
            if activity is not None and progress.HasField("activity") and activity.current.name:
                current = activity.current
            if not intervals and current is None and (node_id, progress.rank) not in self._series:
                continue  # a rank without a recorder: nothing to keep
            series = self._series_for(node_id, progress.rank, now=now)
            series.local_rank = progress.local_rank
            if progress.pid and series.pid and progress.pid != series.pid:
                self._abandon(series)
            series.pid = progress.pid or series.pid
            series.last_beat = now
            for iv in intervals:
                self._add(series, iv, now=now)
            if current is not None and current.end_unix_ns == 0:
                self._add(series, current, now=now)
            self._trim(series, now=now)

    def _series_for(self, node_id: str, rank: int, *, now: float) -> _Series:
        key = (node_id, rank)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= self.max_series:
                self._drop(min(self._series, key=lambda k: self._series[k].last_beat))
            series = self._series[key] = _Series(node=node_id, rank=rank, last_beat=now)
            self._series_of[node_id] = self._series_of.get(node_id, 0) + 1
        return series

    def _drop(self, key: tuple[str, int]) -> None:
        self.total -= len(self._series.pop(key).spans)
        node_id = key[0]
        left = self._series_of[node_id] - 1
        if left:
            self._series_of[node_id] = left
        else:
            del self._series_of[node_id]

    def _add(self, series: _Series, iv: IntervalLike, *, now: float) -> None:
        span = accept(iv, now=now, max_age_s=self.max_age_s, names=self._names)
        if span is None:
            self.refused += 1
            return
        key = (span.name, span.group, span.seq, span.start_ns)
        known = series.open.get(key)
        if known is not None:
            if span.end_ns:
                known.end_ns = span.end_ns
                del series.open[key]
            return  # a repeat of an interval still open
        if span.end_ns == 0:
            if len(series.open) >= MAX_OPEN_PER_RANK:
                del series.open[next(iter(series.open))]
            series.open[key] = span
        series.spans.append(span)
        self.total += 1

    @staticmethod
    def _abandon(series: _Series) -> None:
        """The rank's process changed: what the old one left open ends at its last beat, unfinished."""
        end = int(series.last_beat * _NS)
        for span in series.open.values():
            span.end_ns = max(span.start_ns, end)
            span.unfinished = True
        series.open.clear()

    def _trim(self, series: _Series, *, now: float) -> None:
        cap = self.cap()
        cutoff = int((now - self.max_age_s) * _NS)
        spans = series.spans
        while spans and (len(spans) > cap or 0 < spans[0].end_ns < cutoff):
            span = spans.popleft()
            self.total -= 1
            if span.end_ns == 0:
                series.open.pop((span.name, span.group, span.seq, span.start_ns), None)

    def sweep(self, *, now: float) -> None:
        """Drops the ranks not heard from for ``max_age_s`` (their intervals are all older than that)."""
        stale = [k for k, s in self._series.items() if s.last_beat < now - self.max_age_s]
        for key in stale:
            self._drop(key)

    def note_event(self, event: Event, *, hang: list[dict[str, Any]] | None = None) -> None:
        """Remembers ``event`` when it is a failure (see :data:`FAILURE_KINDS`), with a hang report's
        evidence per rank (``hang``)."""
        if event.kind not in FAILURE_KINDS:
            return
        failure: dict[str, Any] = {
            "id": event.seq,
            "unix": event.unix,
            "kind": event.kind,
            "node": event.node,
            "rank": event.rank,
            "round": event.round,
            "message": event.message[:500],
        }
        if hang:
            failure["hang"] = hang
            if any("nccl_trace" in rank for rank in hang):
                self._traced.append(failure)
                if len(self._traced) > MAX_TRACED_FAILURES:
                    self._drop_traces(self._traced.popleft())
        self._failures.append(failure)

    def _drop_traces(self, failure: dict[str, Any]) -> None:
        """Replaces ``failure`` by a copy without its NCCL dumps: a copy, since an answer being encoded in
        another thread may hold the original."""
        slim = dict(failure)
        slim["hang"] = [
            {k: v for k, v in rank.items() if k != "nccl_trace"} | {"nccl_trace_dropped": True}
            if "nccl_trace" in rank
            else rank
            for rank in failure["hang"]
        ]
        for i, kept in enumerate(self._failures):
            if kept is failure:
                self._failures[i] = slim
                return

    # ------------------------------------------------------------------------------------------------
    # Reading

    def failure(self, failure_id: int) -> dict[str, Any] | None:
        return next((f for f in self._failures if f["id"] == failure_id), None)

    def failures(self) -> list[dict[str, Any]]:
        return list(self._failures)

    def window(
        self,
        *,
        start: float,
        end: float,
        now: float,
        node: str = "",
        rank: int | None = None,
        limit: int = MAX_ANSWER_INTERVALS,
    ) -> dict[str, Any]:
        """The intervals that overlap [start, end] (unix seconds) and the failures within it, per rank in
        (node, rank) order; an open interval overlaps everything after its start. At most ``limit``
        intervals in all: each rank keeps its newest share (``omitted`` counts the rest), so one answer
        stays a bounded piece of work for the master's event loop."""
        lo, hi = int(start * _NS), int(end * _NS)
        chosen = [
            self._series[key]
            for key in sorted(self._series)
            if not (node and key[0] != node) and not (rank is not None and key[1] != rank)
        ]
        share = max(1, limit // max(1, len(chosen)))
        ranks = []
        omitted = 0
        for series in chosen:
            inside = [s for s in series.spans if s.start_ns <= hi and (s.end_ns == 0 or s.end_ns >= lo)]
            omitted += max(0, len(inside) - share)
            ranks.append(
                {
                    "node": series.node,
                    "rank": series.rank,
                    "local_rank": series.local_rank,
                    "pid": series.pid,
                    "last_beat_unix": series.last_beat,
                    "intervals": [s.to_json() for s in inside[-share:]],
                }
            )
        return {
            "now_unix": now,
            "start_unix": start,
            "end_unix": end,
            "ranks": ranks,
            "failures": [f for f in self._failures if start <= f["unix"] <= end],
            "refused": self.refused,
            "kept": self.total,
            "omitted": omitted,
            "max_age_s": self.max_age_s,
        }
