"""Status conditions, the Kubernetes way: type/status/reason/message/lastTransitionTime/observedGeneration.

``lastTransitionTime`` changes only when a condition's status flips, so a job that stays Running keeps the
time it started running however often it is reconciled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, get_args

Condition = dict[str, Any]

ConditionType = Literal[
    "Created", "MasterReady", "GangScheduled", "ReplicaFailure", "PodsReady", "Running", "Restarting",
    "Suspended", "Admitted", "Succeeded", "Failed", "ReconcileError",
]  # fmt: skip
"""The conditions an ElasticJob's status carries (the CRD's enum): a misspelt one is a mypy error."""
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)


def rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float:
    """The Unix time of an RFC 3339 timestamp as written by :func:`rfc3339` (or the API server)."""
    return datetime.fromisoformat(text).timestamp()


def get_condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    for c in conditions:
        if c.get("type") == kind:
            return c
    return None


def is_true(conditions: Sequence[Mapping[str, Any]], kind: str) -> bool:
    c = get_condition(conditions, kind)
    return bool(c and c.get("status") == "True")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    *,
    kind: str,  # an ElasticJob's (ConditionType) or a Kueue Workload's
    status: bool,
    reason: str,
    message: str,
    now: float,
    generation: int,
) -> list[Condition]:
    """A new list with condition ``kind`` set; the others are kept as they are, in order."""
    text = "True" if status else "False"
    result: list[Condition] = []
    found = False
    for c in conditions:
        if c.get("type") != kind:
            result.append(dict(c))
            continue
        found = True
        changed = c.get("status") != text
        result.append(
            {
                "type": kind,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": rfc3339(now) if changed else c.get("lastTransitionTime", rfc3339(now)),
                "observedGeneration": generation,
            }
        )
    if not found:
        result.append(
            {
                "type": kind,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": rfc3339(now),
                "observedGeneration": generation,
            }
        )
    return result
