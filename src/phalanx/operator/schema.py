"""Building blocks of the ElasticJob's OpenAPI schema (:mod:`phalanx.operator.crd`).

Spec fields that map onto a :mod:`phalanx.api.settings` field take their description and default from that
field (:data:`SETTINGS_FIELDS`, read by :func:`setting_prop`), so ``--help``, environment variables and the
CRD never disagree. Every helper returns a new dict each call: the YAML then has no aliases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.api import settings as s
from phalanx.operator.admission import DURATION_RE, MAX_DURATIONS, duration_limit

SETTINGS_FIELDS: dict[tuple[str, ...], tuple[type, str]] = {
    ("nodes", "min"): (s.RendezvousSettings, "min_nodes"),
    ("nodes", "max"): (s.RendezvousSettings, "max_nodes"),
    ("nodes", "unit"): (s.RendezvousSettings, "unit"),
    ("nodes", "lastCall"): (s.RendezvousSettings, "last_call_s"),
    ("nodes", "minNodesTimeout"): (s.RendezvousSettings, "min_nodes_timeout_s"),
    ("nprocPerNode",): (s.AgentSettings, "nproc_per_node"),
    ("restart", "maxRestarts"): (s.RestartSettings, "max_restarts"),
    ("restart", "maxEvictions"): (s.RestartSettings, "max_evictions"),
    ("restart", "maxDisruptions"): (s.JobPodSettings, "max_disruptions"),
    ("restart", "gracePeriod"): (s.RestartSettings, "grace_period_s"),
    ("heartbeat", "interval"): (s.HeartbeatSettings, "interval_s"),
    ("heartbeat", "timeout"): (s.HeartbeatSettings, "timeout_s"),
    ("hang", "enabled"): (s.HangSettings, "enabled"),
    ("hang", "instrument"): (s.HangSettings, "instrument"),
    ("hang", "floor"): (s.HangSettings, "floor_s"),
    ("hang", "idleFloor"): (s.HangSettings, "idle_floor_s"),
    ("hang", "stopped"): (s.HangSettings, "stopped_s"),
    ("hang", "factor"): (s.HangSettings, "factor"),
    ("hang", "startup"): (s.HangSettings, "startup_s"),
    ("checkpoint", "memoryIntervalSteps"): (s.CheckpointSettings, "memory_interval_steps"),
    ("checkpoint", "persistIntervalSteps"): (s.CheckpointSettings, "persist_interval_steps"),
    ("checkpoint", "storagePath"): (s.CheckpointSettings, "storage_path"),
    ("checkpoint", "keepLast"): (s.CheckpointSettings, "keep_last"),
    ("healthChecks", "interval"): (s.ProbeSettings, "interval_s"),
    ("healthChecks", "timeout"): (s.ProbeSettings, "timeout_s"),
    ("healthChecks", "confirmRounds"): (s.StragglerSettings, "confirm_rounds"),
    ("healthChecks", "evictSlowNodes"): (s.StragglerSettings, "evict_slow_nodes"),
    ("sharedMemory", "enabled"): (s.JobPodSettings, "shared_memory"),
    ("createRefusedTimeout",): (s.JobPodSettings, "create_refused_timeout_s"),
    ("master", "statusProgressInterval"): (s.MasterSettings, "status_progress_interval_s"),
}
"""CRD spec path -> (settings class, field). The single mapping between the spec and the settings."""


def quantity() -> dict[str, Any]:
    """A Kubernetes quantity (``8``, ``"16Gi"``), a new dict each time (the YAML then has no aliases)."""
    return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}


def settings_field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name}")


def format_duration(seconds: float) -> str:
    """Formats seconds in the Go duration form the CRD uses (``"10s"``, ``"500ms"``, ``"10m"``)."""
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes // 60}h" if minutes % 60 == 0 else f"{minutes}m"
    return f"{seconds:g}s"


def setting_prop(path: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """A schema property for a spec field that maps onto a settings field."""
    cls, name = SETTINGS_FIELDS[path]
    f = settings_field(cls, name)
    doc = str(f.metadata.get("doc", ""))
    prop: dict[str, Any]
    if name.endswith("_s"):
        prop = duration_prop(doc, path=path)
        prop["default"] = format_duration(float(f.default))  # type: ignore[arg-type]
    elif isinstance(f.default, bool):
        prop = {"type": "boolean", "description": doc, "default": f.default}
    elif isinstance(f.default, int):
        prop = {"type": "integer", "format": "int32", "description": doc, "default": f.default}
    elif isinstance(f.default, float):
        prop = {"type": "number", "description": doc, "default": f.default}
    else:
        prop = {"type": "string", "description": doc, "default": f.default}
    unit = f.metadata.get("unit")
    if unit and unit != "s":
        prop["description"] += f" Unit: {unit}."
    prop.update(extra)
    return prop


def duration_prop(doc: str, *, path: tuple[str, ...]) -> dict[str, Any]:
    limit = MAX_DURATIONS[path]
    return {
        "type": "string",
        "description": f"{doc} A duration such as 500ms, 30s, 2m or 1h; at most {limit}.",
        "maxLength": 32,
        "x-kubernetes-validations": [
            {
                "rule": f"self.matches('{DURATION_RE}')",
                "message": "must be a duration such as 500ms, 30s, 2m or 1h",
            },
            duration_limit(path, empty_ok=False),
        ],
    }


def optional_duration(doc: str, *, path: tuple[str, ...], positive: bool = False) -> dict[str, Any]:
    """A run-policy duration without a default: absent or "" means not set. The syntax rule is the one of
    every duration; the rule for > 0 passes a value that is no duration (CEL's ``||`` is true when either
    side is, even if the other errs), so such a value gets the syntax message only."""
    prop = duration_prop(doc, path=path)
    prop["x-kubernetes-validations"] = [
        {
            "rule": f"self == '' || self.matches('{DURATION_RE}')",
            "message": "must be a duration such as 500ms, 30s, 2m or 1h",
        },
        duration_limit(path, empty_ok=True),
    ]
    if positive:
        prop["x-kubernetes-validations"].append(
            {
                "rule": f"self == '' || !self.matches('{DURATION_RE}') || duration(self) > duration('0s')",
                "message": "must be greater than 0; leave it out for no deadline",
            }
        )
    return prop


def object_prop(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    schema = {"type": "object", "description": description, "properties": properties, **extra}
    if schema.get("default") == {}:
        # The API server validates a default as given (nested defaults are not applied to it), so an
        # omitted group defaults to the full set of its fields' defaults.
        schema["default"] = {k: v["default"] for k, v in properties.items() if "default" in v}
    return schema


def int_prop(
    description: str, *, default: int | None = None, minimum: int | None = None, maximum: int | None = None
) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "integer", "format": "int32", "description": description}
    if default is not None:
        prop["default"] = default
    if minimum is not None:
        prop["minimum"] = minimum
    if maximum is not None:
        prop["maximum"] = maximum
    return prop


def kept(description: str, kind: str = "object") -> dict[str, Any]:
    """A Kubernetes type kept as given (the API server validates it when the Pod is created)."""
    if kind == "array":
        items = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "array", "description": description, "items": items}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def string_map() -> dict[str, Any]:
    return {"type": "object", "additionalProperties": {"type": "string"}}
