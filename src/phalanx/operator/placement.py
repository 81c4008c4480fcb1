"""Where a queue's admission puts a job's Pods: the node labels and tolerations of the ResourceFlavors Kueue
assigned to a pod set (:mod:`phalanx.operator.kueue`), added to every Pod of that set when it is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Placement:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


def place(pod_spec: dict[str, Any], placement: Placement | None) -> None:
    """Puts a Pod where its pod set was admitted: the admission's node labels win over the template's (as
    Kueue's own jobs get them), its tolerations are added to the template's."""
    if placement is None:
        return
    if placement.node_selector:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **placement.node_selector}
    added = [dict(t) for t in placement.tolerations if t not in (pod_spec.get("tolerations") or [])]
    if added:
        pod_spec["tolerations"] = [*(pod_spec.get("tolerations") or []), *added]
