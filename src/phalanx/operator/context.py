"""The context of one reconciliation pass: what it observed, and the actions and status it builds up.

Every stage of :func:`phalanx.operator.reconcile.reconcile` takes a :class:`Pass`, reads the observation
from it and adds actions, conditions and status fields to it; :meth:`Pass.finish` turns what changed
into the pass's one status patch. Pure: nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.settings import OperatorSettings
from phalanx.operator.actions import Action, Observed, PatchStatus, PodView
from phalanx.operator.conditions import ConditionType, set_condition

FINISHED_PHASES = elasticjob.FINISHED_PHASES


@dataclass
class Pass:
    observed: Observed
    now: float
    settings: OperatorSettings
    actions: list[Action] = field(default_factory=list)
    out: dict[str, Any] = field(default_factory=dict)
    """The status as this pass leaves it (the fields it set); :meth:`finish` patches those that changed."""

    def __post_init__(self) -> None:
        self.out.setdefault("conditions", list(self.status.get("conditions") or []))

    @property
    def job(self) -> Mapping[str, Any]:
        return self.observed.job

    @property
    def status(self) -> Mapping[str, Any]:
        """The job's status as observed at the start of the pass."""
        return self.job.get("status") or {}

    @property
    def phase(self) -> elasticjob.Phase | None:
        """The job's phase (``status.phase``); None before the first pass wrote one."""
        return elasticjob.phase_of(self.status.get("phase"))

    @property
    def generation(self) -> int:
        return int(self.job["metadata"].get("generation", 1))

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])

    @property
    def pods(self) -> Sequence[PodView]:
        return self.observed.pods

    @property
    def workers(self) -> list[PodView]:
        return [pod for pod in self.observed.pods if pod.role == "worker"]

    @property
    def master_status(self) -> Mapping[str, Any]:
        """``status.master``: the job as its master last reported it."""
        return self.status.get(elasticjob.STATUS_MASTER) or {}

    @property
    def verdict(self) -> elasticjob.Phase | None:
        """The master's phase (``status.master.phase``, in any case); None before it spoke, or for a word that
        is no phase."""
        return elasticjob.phase_of(self.master_status.get(elasticjob.MASTER_PHASE), any_case=True)

    @property
    def refused(self) -> frozenset[str]:
        """Pods the API server refused to create (``status.refusedPods``): asked for again, no replacement."""
        return frozenset(str(n) for n in self.status.get("refusedPods") or [])

    @property
    def conditions(self) -> list[Mapping[str, Any]]:
        """The conditions as this pass left them so far."""
        conditions: list[Mapping[str, Any]] = self.out["conditions"]
        return conditions

    def condition(self, kind: ConditionType, value: bool, reason: str, message: str) -> None:
        """Sets one status condition (its transition time moves only when its status changes)."""
        self.out["conditions"] = set_condition(
            self.out["conditions"], kind=kind, status=value, reason=reason, message=message,
            now=self.now, generation=self.generation,
        )  # fmt: skip

    def finish(self) -> list[Action]:
        """The pass's actions, with one status patch of the fields that changed last (none: no patch)."""
        changed = {k: v for k, v in self.out.items() if self.status.get(k) != v}
        if changed:
            self.actions.append(PatchStatus(changed))
        return self.actions
