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
