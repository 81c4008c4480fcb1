"""Objects the API server refuses to create, and what the job says about them.

A Pod may be refused for good reasons a person must act on: a namespace's Pod Security level (Forbidden),
a ResourceQuota (Forbidden, "exceeded quota"), a template the API server finds invalid (Invalid). The
operator does not guess at it: the refusal sets the job's ``ReplicaFailure`` condition (reason
``FailedCreate``, as a ReplicaSet's) with the API server's own message, and one Warning Event per distinct
message, counted up rather than repeated (see :mod:`phalanx.operator.events`). A refused worker Pod is asked
for again under the same name each pass, so it is no replacement and spends no eviction budget; once
everything the job needs exists the condition turns False. A refusal that lasts longer than
``spec.createRefusedTimeout`` fails the job (reason ``FailedCreate``) instead of looping forever.

Codes the API server may recover from by itself (timeouts, 5xx, 429 throttling, 409 conflicts) are not
refusals: the next pass simply tries again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.operator.conditions import ConditionType, set_condition

CONDITION: ConditionType = "ReplicaFailure"
REASON = "FailedCreate"
REFUSED_CODES = (400, 403, 422)
"""Bad request, Forbidden (admission, RBAC, quota) and Invalid: the same request fails the same way."""
MAX_MESSAGE = 4096


@dataclass(frozen=True)
class Refusal:
    """One create the API server refused."""

    kind: str
    name: str
    code: int
    message: str
    """The API server's own message (its Status object's ``message``)."""

    @property
    def text(self) -> str:
        return f"cannot create {self.kind} {self.name}: {self.message}"


def is_refusal(code: int | None) -> bool:
    return code in REFUSED_CODES


def api_message(body: str | bytes | None, *, fallback: str) -> str:
    """The ``message`` of a Kubernetes Status body, else ``fallback`` (the HTTP reason)."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if body:
        try:
            status = json.loads(body)
        except ValueError:
            return body[:MAX_MESSAGE]
        if isinstance(status, Mapping) and status.get("message"):
            return str(status["message"])[:MAX_MESSAGE]
    return fallback


def refused_status(
    status: Mapping[str, Any], refusals: Sequence[Refusal], *, now: float, generation: int
) -> dict[str, Any]:
    """The status fields that record ``refusals``: the ReplicaFailure condition (its transition time kept
    while it stays True: the timeout counts from the first refusal) and ``refusedPods``."""
    message = "; ".join(r.text for r in refusals)[:MAX_MESSAGE]
    conditions = set_condition(
        status.get("conditions") or [], kind=CONDITION, status=True, reason=REASON, message=message,
        now=now, generation=generation,
    )  # fmt: skip
    pods = sorted({r.name for r in refusals if r.kind == "Pod"})
    return {"conditions": conditions, "refusedPods": pods}
