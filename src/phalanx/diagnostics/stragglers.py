"""Fault isolation from health probes and step times: pure functions of the values the master holds.

Three checks, each returning typed verdicts with one sentence of reason:

* :func:`compute_verdicts` -- matmul probe results per node. A node whose probe failed (wrong result,
  crash, timeout) is a suspect with high confidence. A node is slow when one of its devices reached less
  than ``compute_threshold`` times the median rate of all *other* devices of the probe round; leaving
  the device out keeps a two-node round meaningful (the median of two values would be their mean).
* :func:`link_verdicts` -- pairwise all-gather results (each node reports one measurement per probe
  partner, ``peer_node_id`` set). A pair is bad when any of its ends failed or its bandwidth is below
  ``link_threshold`` times the upper quartile of all pair bandwidths. The upper quartile, not the
  median, is the reference because in a ring of pairs a bad node spoils two pairs, which is half of
  them in a four-node round. MegaScale-style isolation: a node in two or more bad pairs is the suspect
  (high confidence); a bad pair not explained by such a node is ambiguous, so both of its nodes are
  reported with low confidence.
* :func:`step_verdicts` -- recent step intervals per rank (from heartbeats). A rank lags when its median
  interval over the last ``step_window`` intervals exceeds ``step_factor`` times the median of the other
  ranks' medians. In fully synchronous data parallelism collectives equalise step intervals, so this
  check catches ranks whose own progress falls behind (pipeline stages, asynchronous or local-SGD
  training, a rank that reports late) rather than a slow GPU hidden behind an all-reduce; the probes
  cover those.
* :func:`node_scores` -- the same step figures per node during training (its slowest rank), preferring each
  rank's compute time per step (step time minus time inside collectives, from its interval recorder),
  which collectives do not equalise. A node gets a relative score (against the median of the other
  nodes) and an individual one (against its own baseline, :func:`new_baselines`); only the relative
  score makes it slow, and :func:`confirm_slow` confirms that over several checks in a row.

Every threshold is relative, so scaling all rates or intervals by the same factor leaves the verdicts
unchanged, and a cluster of equal nodes yields none. No I/O, no clock: the master injects the values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from phalanx.api.settings import StragglerSettings

VerdictKind = Literal["probe_failed", "slow_compute", "slow_link", "slow_steps"]
Confidence = Literal["high", "low"]


class MeasurementLike(Protocol):
    """What the analysis reads of a probe measurement (the protobuf message or the runner's dataclass)."""

    @property
    def peer_node_id(self) -> str: ...
    @property
    def ok(self) -> bool: ...
    @property
    def rate(self) -> float: ...
    @property
    def error(self) -> str: ...


@dataclass(frozen=True)
class NodeVerdict:
    """A node the probes point at."""

    node_id: str
    kind: VerdictKind
    confidence: Confidence
    value: float
    """The node's figure: slowest device rate (TFLOP/s) or worst pair bandwidth (GB/s); 0 on failure."""
    reference: float
    """What ``value`` was compared with, in the same unit; 0 when nothing was compared."""
    reason: str


@dataclass(frozen=True)
class RankVerdict:
    """A rank whose steps take longer than its peers'."""

    rank: int
    median_interval_s: float
    reference_s: float
    """Median of the other ranks' median step intervals."""
    reason: str


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _median_without(ordered: Sequence[float], index: int) -> float:
    """Median of ``ordered`` (sorted) with the element at ``index`` left out, in O(1)."""
    n = len(ordered) - 1

    def at(i: int) -> float:
        return ordered[i if i < index else i + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


def _upper_quartile(ordered: Sequence[float]) -> float:
    """Nearest-rank 75th percentile of sorted values."""
    return ordered[max(0, math.ceil(0.75 * len(ordered)) - 1)]


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compute_verdicts(
    matmul: Mapping[str, Sequence[MeasurementLike]], *, settings: StragglerSettings | None = None
) -> list[NodeVerdict]:
    """Verdicts on nodes from one round of matmul probes (node id -> its per-device measurements)."""
    cfg = settings or StragglerSettings()
    verdicts: list[NodeVerdict] = []
    devices: list[tuple[float, str]] = []  # (rate, node) of every successful device measurement
    for node, measurements in sorted(matmul.items()):
        failed = [m for m in measurements if not m.ok]
        if not measurements or failed:
            detail = _short(failed[0].error) if failed else "no measurement"
            count = f"{len(failed)} of {len(measurements)} devices" if failed else "the probe"
            verdicts.append(
                NodeVerdict(
                    node_id=node,
                    kind="probe_failed",
                    confidence="high",
                    value=0.0,
                    reference=0.0,
                    reason=f"matmul probe failed on {node} ({count}): {detail or 'no error text'}",
                )
            )
            continue
        devices.extend((m.rate, node) for m in measurements)
    if len(devices) < 2:
        return verdicts
    devices.sort()
    ordered = [rate for rate, _ in devices]
    worst: dict[str, tuple[float, float]] = {}  # node -> (slowest device rate, its reference)
    for index, (rate, node) in enumerate(devices):
        reference = _median_without(ordered, index)
        if rate < cfg.compute_threshold * reference and node not in worst:
            worst[node] = (rate, reference)  # devices are sorted: the first one seen is the slowest
    for node, (rate, reference) in sorted(worst.items()):
        ratio = rate / reference if reference > 0 else 0.0
        verdicts.append(
            NodeVerdict(
                node_id=node,
                kind="slow_compute",
                confidence="high",
                value=rate,
                reference=reference,
                reason=(
                    f"{node}'s slowest device reached {rate:.3g} TFLOP/s, {ratio:.2f}x the median "
                    f"{reference:.3g} TFLOP/s of the other devices (threshold {cfg.compute_threshold}x)"
                ),
            )
        )
    return verdicts


def link_verdicts(
    allgather: Mapping[str, Sequence[MeasurementLike]],
    *,
    expected: Collection[str] = (),
    settings: StragglerSettings | None = None,
) -> list[NodeVerdict]:
    """Verdicts on nodes from one round of pairwise all-gather probes.

    ``allgather`` maps each reporting node to its measurements, one per probe partner. ``expected`` names
    the nodes of the probe group; one that reported nothing is a suspect (it may be dead or hung).
    Measurements without a peer (group mode, or a failure before any pair formed) only count as a
    low-confidence failure of the reporting node, since they cannot say which link is at fault.
    """
    cfg = settings or StragglerSettings()
    verdicts: list[NodeVerdict] = []
    for node in sorted(set(expected) - set(allgather)):
        verdicts.append(
            NodeVerdict(
                node_id=node,
                kind="probe_failed",
                confidence="high",
                value=0.0,
                reference=0.0,
                reason=f"{node} did not report its all-gather probe",
            )
        )
    pair_ok: dict[tuple[str, str], bool] = {}
    pair_rate: dict[tuple[str, str], float] = {}
    pair_error: dict[tuple[str, str], str] = {}
    for node, measurements in sorted(allgather.items()):
        for m in measurements:
            if not m.peer_node_id:
                if not m.ok:
                    verdicts.append(
                        NodeVerdict(
                            node_id=node,
                            kind="probe_failed",
                            confidence="low",
                            value=0.0,
                            reference=0.0,
                            reason=f"all-gather probe failed on {node} without naming a peer: "
                            f"{_short(m.error) or 'no error text'}",
                        )
                    )
                continue
            a, b = sorted((node, m.peer_node_id))
            key = (a, b)
            pair_ok[key] = pair_ok.get(key, True) and m.ok
            if m.ok:
                pair_rate[key] = min(pair_rate.get(key, math.inf), m.rate)
            elif key not in pair_error:
                pair_error[key] = f"{node} reported: {_short(m.error) or 'no error text'}"
    rates = sorted(pair_rate[k] for k in pair_rate if pair_ok[k])
    reference = _upper_quartile(rates) if rates else 0.0
    bad: dict[tuple[str, str], str] = {}
    for key, ok in sorted(pair_ok.items()):
        if not ok:
            bad[key] = f"failed ({pair_error[key]})"
        elif len(rates) >= 2 and pair_rate[key] < cfg.link_threshold * reference:
            bad[key] = f"{pair_rate[key]:.3g} GB/s"
    count: dict[str, int] = {}
    for a, b in bad:
        count[a] = count.get(a, 0) + 1
        count[b] = count.get(b, 0) + 1
    suspects = {node for node, n in count.items() if n >= 2}
    flagged: dict[str, NodeVerdict] = {}
    for node in sorted(suspects):
        pairs = sorted(k for k in bad if node in k)
        listed = "; ".join(f"with {a if b == node else b}: {bad[(a, b)]}" for a, b in pairs)
        rates_here = [pair_rate.get(k, 0.0) if pair_ok[k] else 0.0 for k in pairs]
        flagged[node] = NodeVerdict(
            node_id=node,
            kind="slow_link",
            confidence="high",
            value=min(rates_here),
            reference=reference,
            reason=(
                f"{node} is in {len(pairs)} bad all-gather pairs ({listed}); reference {reference:.3g} GB/s, "
                f"threshold {cfg.link_threshold}x"
            ),
        )
    for (a, b), what in sorted(bad.items()):
        if a in suspects or b in suspects:
            continue  # explained by a node in two bad pairs
        value = pair_rate.get((a, b), 0.0) if pair_ok[(a, b)] else 0.0
        for node, other in ((a, b), (b, a)):
            if node not in flagged:
                flagged[node] = NodeVerdict(
                    node_id=node,
                    kind="slow_link",
                    confidence="low",
                    value=value,
                    reference=reference,
                    reason=(
                        f"the all-gather pair {a}-{b} is bad ({what}; reference {reference:.3g} GB/s) "
                        f"and no other pair tells whether {node} or {other} is at fault"
                    ),
                )
    verdicts.extend(flagged[n] for n in sorted(flagged))
    return verdicts


def step_verdicts(
    intervals: Mapping[int, Sequence[float]], *, settings: StragglerSettings | None = None
) -> list[RankVerdict]:
    """Ranks whose recent step intervals (seconds, oldest first) lag the other ranks'."""
    cfg = settings or StragglerSettings()
    medians: list[tuple[float, int]] = []
    for rank, values in intervals.items():
        recent = list(values)[-cfg.step_window :]
        if len(recent) >= cfg.step_min_samples:
            medians.append((_median(sorted(recent)), rank))
    if len(medians) < 2:
        return []
    medians.sort()
    ordered = [m for m, _ in medians]
    verdicts: list[RankVerdict] = []
    for index, (median, rank) in enumerate(medians):
        reference = _median_without(ordered, index)
        if median > cfg.step_factor * reference:
            verdicts.append(
                RankVerdict(
                    rank=rank,
                    median_interval_s=median,
                    reference_s=reference,
                    reason=(
                        f"rank {rank}'s median step interval {median:.3g}s is "
                        f"{median / reference if reference > 0 else math.inf:.2f}x the other ranks' "
                        f"median {reference:.3g}s (threshold {cfg.step_factor}x)"
                    ),
                )
            )
    verdicts.sort(key=lambda v: v.rank)
    return verdicts


def suspects(verdicts: Sequence[NodeVerdict]) -> list[str]:
    """Nodes to evict: those with at least one high-confidence verdict, sorted."""
    return sorted({v.node_id for v in verdicts if v.confidence == "high"})


# --- Per-node scores during training ---------------------------------------------------------------------

ScoreBasis = Literal["compute", "step"]
StragglerState = Literal["ok", "suspect", "slow"]


@dataclass(frozen=True)
class NodeTiming:
    """One node's recent steps as the master sees them: the figures of its slowest rank."""

    step_time_s: float
    """Median step interval (from the beacons' step reports)."""
    compute_time_s: float = 0.0
    """Median step time minus the time spent inside collectives, from the ranks' interval recorders; 0 when
    a rank of the node has no recorder (the node is then judged on step times)."""


@dataclass(frozen=True)
class NodeScore:
    """One check's scores of one node: how slow it is against the other nodes and against itself."""

    node_id: str
    basis: ScoreBasis
    """What was compared: ``compute`` (own compute time per step) or ``step`` (step interval)."""
    value_s: float
    relative: float
    """``value_s`` over the median of the other nodes' values; 0 with fewer than two nodes."""
    reference_s: float
    individual: float
    """``value_s`` over the node's own baseline; 0 before it has one."""
    baseline_s: float
    slow: bool
    """This check finds the node relatively slow (``relative > step_factor``); unconfirmed."""
    step_time_s: float = 0.0
    """The node's median step interval, whatever the basis (what a person reads first)."""


def rank_timings(
    intervals: Mapping[int, Sequence[float]],
    activity: Mapping[int, tuple[float, float]],
    *,
    settings: StragglerSettings | None = None,
) -> dict[int, NodeTiming]:
    """Per rank with enough samples: its median recent step interval and its compute time per step.

    ``activity`` maps a rank to the (step time, collective time) medians its recorder reported (0, 0 without
    a recorder). A rank with fewer than ``step_min_samples`` intervals in the window is not judged yet."""
    cfg = settings or StragglerSettings()
    out: dict[int, NodeTiming] = {}
    for rank, values in intervals.items():
        recent = list(values)[-cfg.step_window :]
        if len(recent) < cfg.step_min_samples:
            continue
        step_s, collective_s = activity.get(rank, (0.0, 0.0))
        compute = max(step_s - collective_s, 0.0) if step_s > 0 else 0.0
        out[rank] = NodeTiming(step_time_s=_median(sorted(recent)), compute_time_s=compute)
    return out


def node_timings(ranks: Mapping[int, NodeTiming], node_of: Mapping[int, str]) -> dict[str, NodeTiming]:
    """Per node, its slowest rank's figures (one slow device drags the whole node). The compute time is
    known only when every judged rank of the node reports it."""
    grouped: dict[str, list[NodeTiming]] = {}
    for rank, timing in ranks.items():
        node = node_of.get(rank)
        if node:
            grouped.setdefault(node, []).append(timing)
    out: dict[str, NodeTiming] = {}
    for node, timings in grouped.items():
        computes = [t.compute_time_s for t in timings]
        out[node] = NodeTiming(
            step_time_s=max(t.step_time_s for t in timings),
            compute_time_s=max(computes) if all(c > 0 for c in computes) else 0.0,
        )
    return out


def score_basis(timings: Mapping[str, NodeTiming]) -> ScoreBasis:
    """``compute`` when every node reports its compute time, else ``step``. In synchronous data parallelism
    the collectives make every rank's step as long as the slowest one's, so only the compute time (the step
    minus the wait in collectives) tells the slow node; step intervals tell it only where ranks step on
    their own. Nodes are compared on one basis, never a mix."""
    if timings and all(t.compute_time_s > 0 for t in timings.values()):
        return "compute"
    return "step"


def node_scores(
    timings: Mapping[str, NodeTiming],
    baselines: Mapping[str, float],
    *,
    settings: StragglerSettings | None = None,
) -> dict[str, NodeScore]:
    """Scores every node of ``timings`` against the median of the other nodes (relative) and against its own
    baseline (individual, from ``baselines``: node -> its value on the same basis when it was first judged
    healthy in the round). Only the relative score makes a node slow: when every node slows down together
    (a shared file system, the machine's load) no node is to blame, and the individual scores show it."""
    cfg = settings or StragglerSettings()
    basis = score_basis(timings)

    def value(t: NodeTiming) -> float:
        return t.compute_time_s if basis == "compute" else t.step_time_s

    ordered_nodes = sorted(timings, key=lambda n: (value(timings[n]), n))
    ordered = [value(timings[n]) for n in ordered_nodes]
    scores: dict[str, NodeScore] = {}
    for index, node in enumerate(ordered_nodes):
        mine = ordered[index]
        reference = _median_without(ordered, index) if len(ordered) >= 2 else 0.0
        relative = mine / reference if reference > 0 else 0.0
        baseline = baselines.get(node, 0.0)
        scores[node] = NodeScore(
            node_id=node,
            basis=basis,
            value_s=mine,
            relative=relative,
            reference_s=reference,
            individual=mine / baseline if baseline > 0 else 0.0,
            baseline_s=baseline,
            slow=reference > 0 and relative > cfg.step_factor,
            step_time_s=timings[node].step_time_s,
        )
    return dict(sorted(scores.items()))


def new_baselines(
    scores: Mapping[str, NodeScore], baselines: Mapping[str, float], *, previous: ScoreBasis
) -> dict[str, float]:
    """Baselines after a check: a node without one takes its value from the first check that scores it
    without finding it slow (its first healthy window of the round). When the basis changed since the
    ``previous`` check (the recorders' figures arrived or went) they start afresh: seconds of compute and
    seconds of steps do not compare."""
    same = all(s.basis == previous for s in scores.values())
    kept = {n: b for n, b in baselines.items() if n in scores} if same else {}
    for node, score in scores.items():
        if node not in kept and not score.slow and score.relative > 0 and score.value_s > 0:
            kept[node] = score.value_s
    return kept


def confirm_slow(
    streaks: Mapping[str, int], scores: Mapping[str, NodeScore], *, need: int
) -> tuple[dict[str, int], list[str]]:
    """Checks in a row that found each node slow, and the nodes confirmed by this check (the streak reached
    ``need`` now). A check that finds a node fast, or cannot score it, starts it over: no flapping verdict
    from one slow window."""
    updated = {n: streaks.get(n, 0) + 1 for n, s in scores.items() if s.slow}
    confirmed = sorted(n for n, c in updated.items() if c == need)
    return updated, confirmed


def straggler_state(streak: int, *, need: int) -> StragglerState:
    """``slow`` once confirmed, ``suspect`` while being confirmed, else ``ok``."""
    if streak >= need:
        return "slow"
    return "suspect" if streak > 0 else "ok"


def straggler_reason(score: NodeScore, *, checks: int, factor: float) -> str:
    """One sentence for the event, the eviction and ``/v1/nodes``."""
    what = "compute time per step" if score.basis == "compute" else "step interval"
    own = (
        f"; {score.individual:.2f}x its own baseline {score.baseline_s:.3g}s" if score.individual > 0 else ""
    )
    return (
        f"{score.node_id}'s median {what} {score.value_s:.3g}s is {score.relative:.2f}x the other nodes' "
        f"median {score.reference_s:.3g}s (threshold {factor}x) in {checks} check(s) in a row{own}"
    )
