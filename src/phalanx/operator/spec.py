"""A typed view of an ElasticJob's spec, and the settings it maps onto.

The API server has already applied the CRD's defaults and validated the spec; :func:`parse_spec` still
fills defaults (from :mod:`phalanx.api.settings`) so that pure code and unit tests can pass partial specs,
and it checks the spec against the settings classes so an object that slipped past admission (an older
CRD) fails with the settings' own message instead of a crash later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.errors import ConfigError
from phalanx.api.settings import (
    DEFAULT_STATUS_PROGRESS_INTERVAL_S,
    PROBE_KINDS,
    CheckpointSettings,
    HangSettings,
    HeartbeatSettings,
    JobPodSettings,
    ProbeSettings,
    RendezvousSettings,
    RestartSettings,
    StragglerSettings,
    parse_duration,
)
from phalanx.operator import resources
from phalanx.operator.admission import (
    CLEAN_POD_POLICIES,
    MAX_DURATIONS,
    MAX_HANG_FACTOR,
    MAX_INTERVAL_STEPS,
    MAX_KEEP_LAST,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_PARALLEL_DEGREE,
    MAX_RESTART_BUDGET,
    MAX_SHARED_MEMORY,
)
from phalanx.operator.gang import Gang
from phalanx.operator.gang import parse as parse_gang
from phalanx.operator.placement import Placement

MAX_TEMPLATE_BYTES = 256 * 1024
"""The largest worker or master template, as compact JSON. The operator builds a Pod from the worker
template for every node (up to :data:`phalanx.operator.workers.MAX_CREATES_PER_PASS` at a time) and the
schema cannot bound a template's lists: without this, one job's 40,000 tolerations cost the operator of
every tenant gigabytes. A real template is a few KiB."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """An ElasticJob's spec with every default filled in."""

    rendezvous: RendezvousSettings
    heartbeat: HeartbeatSettings
    hang: HangSettings
    restart: RestartSettings
    checkpoint: CheckpointSettings
    probes: ProbeSettings = field(default_factory=ProbeSettings)
    """``spec.healthChecks`` as the master's probe settings (off unless ``healthChecks.enabled``)."""
    nproc_per_node: int = 1
    """``spec.nprocPerNode`` resolved: ``auto`` is the first container's GPU limit, else 1."""
    tensor: int = 1
    pipeline: int = 1
    cordon_bad_nodes: bool = False
    clean_pod_policy: str = "Running"
    suspend: bool = False
    """``spec.suspend``: worker Pods are deleted (after the master acknowledged) until it is false again."""
    template: Mapping[str, Any] = field(default_factory=dict)
    master_resources: Mapping[str, Any] = field(default_factory=dict)
    master_template: Mapping[str, Any] = field(default_factory=dict)
    """``spec.master.template``: scheduling, pull secrets, security and resources of the master Pod."""
    status_progress_interval_s: float = DEFAULT_STATUS_PROGRESS_INTERVAL_S
    """``spec.master.statusProgressInterval``: how often at most the master writes the step alone into the
    job's status (other changes go at once)."""
    shared_memory: int | None = None
    """``spec.sharedMemory``: bytes of the memory-backed /dev/shm of the worker Pods; None: not mounted."""
    termination_grace_s: float = RestartSettings().grace_period_s + JobPodSettings().persist_on_exit_s
    """``spec.terminationGracePeriod``: the worker Pods' terminationGracePeriodSeconds."""
    create_refused_timeout_s: float = JobPodSettings().create_refused_timeout_s
    """``spec.createRefusedTimeout``: how long the API server may refuse the job's objects before it fails."""
    active_deadline_s: float | None = None
    """``spec.activeDeadline``: seconds the job may be active (from its start or last resume); None: none."""
    ttl_after_finished_s: float | None = None
    """``spec.ttlAfterFinished``: seconds a finished job is kept, then the operator deletes it; None: kept."""
    gang: Gang | None = None
    """``spec.gangScheduling``: the scheduler and the worker Pods it must place at once; None: off."""
    max_disruptions: int = JobPodSettings().max_disruptions
    """``spec.restart.maxDisruptions``: worker Pods the cluster may end and the operator replace."""
    placement: Mapping[str, Placement] = field(default_factory=dict)  # by pod set: Kueue's admission

    @property
    def min_nodes(self) -> int:
        return self.rendezvous.min_nodes

    @property
    def max_nodes(self) -> int:
        return self.rendezvous.max_nodes

    @property
    def gang_min_nodes(self) -> int | None:
        return self.gang.min_nodes if self.gang else None


def _group(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError("expected an object", field=f"spec.{key}")
    return value


def _bounded(seconds: float, path: tuple[str, ...], given: Any) -> float:
    """``seconds`` unless it is above the CRD's limit for that duration (:data:`MAX_DURATIONS`)."""
    limit = MAX_DURATIONS[path]
    if seconds > parse_duration(limit):
        raise ConfigError(f"must be at most {limit}, got {given!r}", field="spec." + ".".join(path))
    return seconds


def _dur(group: Mapping[str, Any], key: str, default: float, where: str) -> float:
    if key not in group:
        return default
    return _bounded(parse_duration(group[key], name=f"spec.{where}.{key}"), (where, key), group[key])


def _optional_dur(spec: Mapping[str, Any], key: str) -> float | None:
    """A run-policy duration of the spec: None when absent, null or ""."""
    value = spec.get(key)
    if value is None or value == "":
        return None
    return _bounded(parse_duration(value, name=f"spec.{key}"), (key,), value)


def _count(group: Mapping[str, Any], key: str, default: int, *, where: str, maximum: int) -> int:
    """A whole number of the spec no greater than ``maximum`` (the CRD's bound; the lower bounds are the
    settings classes' own checks). The operator's memory and API calls grow with these numbers, so an object
    that slipped past admission fails here, alone, with the field named."""
    value = group.get(key, default)
    name = f"spec.{where}.{key}" if where else f"spec.{key}"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"expected a whole number, got {value!r}", field=name)
    try:
        number = int(value)
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"expected a whole number, got {value!r}", field=name) from exc
    if number != value and str(number) != value:  # 2.5 or "2.5": not whole
        raise ConfigError(f"expected a whole number, got {value!r}", field=name)
    if number > maximum:
        raise ConfigError(f"must be at most {maximum}, got {number}", field=name)
    return number


def active_deadline(spec: Mapping[str, Any]) -> float | None:
    """``spec.activeDeadline`` in seconds (None: no deadline); a ConfigError naming the field unless it is a
    duration above 0."""
    seconds = _optional_dur(spec, "activeDeadline")
    if seconds is not None and seconds <= 0:
        raise ConfigError(
            f"must be greater than 0, got {spec['activeDeadline']!r}; leave it out for no deadline",
            field="spec.activeDeadline",
        )
    return seconds


def ttl_after_finished(spec: Mapping[str, Any]) -> float | None:
    """``spec.ttlAfterFinished`` in seconds (None: keep the finished job); a ConfigError naming the field
    unless it is a duration. Read on its own as well: a job that failed for an invalid spec still has one."""
    return _optional_dur(spec, "ttlAfterFinished")


def _factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"expected a number, got {value!r}", field="spec.hang.factor")
    try:
        factor = float(value)
    except ValueError as exc:
        raise ConfigError(f"expected a number, got {value!r}", field="spec.hang.factor") from exc
    if factor > MAX_HANG_FACTOR:
        raise ConfigError(f"must be at most {MAX_HANG_FACTOR}, got {value!r}", field="spec.hang.factor")
    return factor


def _probes(health: Mapping[str, Any]) -> ProbeSettings:
    """``spec.healthChecks`` -> the master's probe settings.

    ``enabled`` turns on both the round right after every completed rendezvous round (a bad node is
    caught as training starts or resumes) and, with ``interval`` above 0, the periodic rounds during
    training.
    """
    default = ProbeSettings()
    enabled = bool(health.get("enabled", default.enabled))
    kinds = health.get("probes", default.kind_names)
    if isinstance(kinds, str) or not isinstance(kinds, list | tuple) or not kinds:
        allowed = ", ".join(PROBE_KINDS)
        raise ConfigError(f"expected a list of one or more of {allowed}", field="spec.healthChecks.probes")
    confirm = health.get("confirmRounds", default.stragglers.confirm_rounds)
    if isinstance(confirm, bool) or not isinstance(confirm, int):
        raise ConfigError(
            f"expected a whole number, got {confirm!r}", field="spec.healthChecks.confirmRounds"
        )
    evict_slow = health.get("evictSlowNodes", default.stragglers.evict_slow_nodes)
    if not isinstance(evict_slow, bool):
        raise ConfigError(
            f"expected true or false, got {evict_slow!r}", field="spec.healthChecks.evictSlowNodes"
        )
    try:
        return ProbeSettings(
            enabled=enabled,
            on_round_complete=enabled,
            interval_s=_dur(health, "interval", default.interval_s, "healthChecks"),
            timeout_s=_dur(health, "timeout", default.timeout_s, "healthChecks"),
            kinds=",".join(str(kind) for kind in kinds),
            stragglers=StragglerSettings(confirm_rounds=confirm, evict_slow_nodes=evict_slow),
        )
    except ConfigError as exc:
        # The settings name their own field (kinds, timeout_s); the user wrote the spec's.
        spec_name = {
            "kinds": "probes",
            "interval_s": "interval",
            "timeout_s": "timeout",
            "confirm_rounds": "confirmRounds",
        }.get(exc.field or "")
        if spec_name is None:
            raise
        message = str(exc).split(": ", 1)[-1]
        raise ConfigError(message, field=f"spec.healthChecks.{spec_name}") from exc


def _shared_memory(spec: Mapping[str, Any], nproc: int, container: Mapping[str, Any]) -> int | None:
    """``spec.sharedMemory`` -> bytes of /dev/shm (None: disabled). The default is
    :attr:`JobPodSettings.shared_memory_per_process_mib` per process, capped at the memory limit."""
    group, default = _group(spec, "sharedMemory"), JobPodSettings()
    enabled = group.get("enabled", default.shared_memory)
    if not isinstance(enabled, bool):
        raise ConfigError(f"expected true or false, got {enabled!r}", field="spec.sharedMemory.enabled")
    if not enabled:
        return None
    where = "spec.template.spec.containers[0]"
    if group.get("sizeLimit") in (None, ""):
        return resources.default_shared_memory(
            nproc, container, per_process_mib=default.shared_memory_per_process_mib, field=where
        )
    size = int(resources.parse_quantity(group["sizeLimit"], field="spec.sharedMemory.sizeLimit"))
    ceiling = int(resources.parse_quantity(MAX_SHARED_MEMORY, field="MAX_SHARED_MEMORY"))
    if size > ceiling:
        raise ConfigError(
            f"must be at most {MAX_SHARED_MEMORY}, got {group['sizeLimit']!r}",
            field="spec.sharedMemory.sizeLimit",
        )
    floor = int(resources.parse_quantity(resources.MIN_SHARED_MEMORY, field="MIN_SHARED_MEMORY"))
    if size < floor:
        raise ConfigError(
            f"must be at least {resources.MIN_SHARED_MEMORY} (a container has that much /dev/shm without "
            f"the volume), got {group['sizeLimit']!r}; set enabled: false for no volume",
            field="spec.sharedMemory.sizeLimit",
        )
    limit = resources.memory_limit(container, field=where)
    if limit is not None and size > limit:
        raise ConfigError(
            f"{group['sizeLimit']} is more than the first container's memory limit "
            f"({container['resources']['limits']['memory']}): pages in /dev/shm count against that "
            "limit, so the container would be OOM-killed before /dev/shm is full; raise the limit or lower "
            "sizeLimit",
            field="spec.sharedMemory.sizeLimit",
        )
    return size


def _termination_grace(spec: Mapping[str, Any], restart: RestartSettings) -> float:
    """``spec.terminationGracePeriod``, by default restart.gracePeriod plus
    :attr:`JobPodSettings.persist_on_exit_s`; it must leave time to persist after the workers stopped."""
    grace = _optional_dur(spec, "terminationGracePeriod")
    if grace is None:
        return restart.grace_period_s + JobPodSettings().persist_on_exit_s
    if grace <= restart.grace_period_s:
        raise ConfigError(
            f"must be longer than restart.gracePeriod ({restart.grace_period_s:g}s), got "
            f"{spec['terminationGracePeriod']!r}: an agent first stops its workers (up to gracePeriod), then "
            "persists the newest in-memory snapshot in the time left",
            field="spec.terminationGracePeriod",
        )
    return grace


def _create_refused_timeout(spec: Mapping[str, Any]) -> float:
    seconds = _optional_dur(spec, "createRefusedTimeout")
    if seconds is None:
        return JobPodSettings().create_refused_timeout_s
    if seconds <= 0:
        raise ConfigError(
            f"must be greater than 0, got {spec['createRefusedTimeout']!r}", field="spec.createRefusedTimeout"
        )
    return seconds


def _rendezvous(nodes: Mapping[str, Any]) -> RendezvousSettings:
    default = RendezvousSettings()
    min_nodes = _count(nodes, "min", 1, where="nodes", maximum=MAX_NODES)
    return RendezvousSettings(
        min_nodes=min_nodes,
        max_nodes=_count(nodes, "max", min_nodes, where="nodes", maximum=MAX_NODES),
        unit=_count(nodes, "unit", 1, where="nodes", maximum=MAX_NODES),
        last_call_s=_dur(nodes, "lastCall", default.last_call_s, "nodes"),
        min_nodes_timeout_s=_dur(nodes, "minNodesTimeout", default.min_nodes_timeout_s, "nodes"),
    )


def _heartbeat(hb: Mapping[str, Any]) -> HeartbeatSettings:
    default = HeartbeatSettings()
    return HeartbeatSettings(
        interval_s=_dur(hb, "interval", default.interval_s, "heartbeat"),
        timeout_s=_dur(hb, "timeout", default.timeout_s, "heartbeat"),
    )


def _hang(hg: Mapping[str, Any]) -> HangSettings:
    default = HangSettings()
    return HangSettings(
        enabled=bool(hg.get("enabled", default.enabled)),
        instrument=bool(hg.get("instrument", default.instrument)),
        floor_s=_dur(hg, "floor", default.floor_s, "hang"),
        idle_floor_s=_dur(hg, "idleFloor", default.idle_floor_s, "hang"),
        stopped_s=_dur(hg, "stopped", default.stopped_s, "hang"),
        factor=_factor(hg.get("factor", default.factor)),
        startup_s=_dur(hg, "startup", default.startup_s, "hang"),
    )


def _restart(rs: Mapping[str, Any]) -> RestartSettings:
    default = RestartSettings()
    return RestartSettings(
        max_restarts=_count(
            rs, "maxRestarts", default.max_restarts, where="restart", maximum=MAX_RESTART_BUDGET
        ),
        max_evictions=_count(
            rs, "maxEvictions", default.max_evictions, where="restart", maximum=MAX_RESTART_BUDGET
        ),
        grace_period_s=_dur(rs, "gracePeriod", default.grace_period_s, "restart"),
    )


def _checkpoint(ck: Mapping[str, Any]) -> CheckpointSettings:
    default = CheckpointSettings()
    steps = MAX_INTERVAL_STEPS
    return CheckpointSettings(
        memory_interval_steps=_count(
            ck, "memoryIntervalSteps", default.memory_interval_steps, where="checkpoint", maximum=steps
        ),
        persist_interval_steps=_count(
            ck, "persistIntervalSteps", default.persist_interval_steps, where="checkpoint", maximum=steps
        ),
        storage_path=str(ck.get("storagePath", default.storage_path)),
        keep_last=_count(ck, "keepLast", default.keep_last, where="checkpoint", maximum=MAX_KEEP_LAST),
    )


def _clean_pod_policy(spec: Mapping[str, Any]) -> str:
    policy = str(spec.get("cleanPodPolicy", "Running"))
    if policy not in CLEAN_POD_POLICIES:
        raise ConfigError(
            f"must be one of {', '.join(CLEAN_POD_POLICIES)}, got {policy!r}", field="cleanPodPolicy"
        )
    return policy


def _suspend(spec: Mapping[str, Any]) -> bool:
    suspend = spec.get("suspend", False)
    if not isinstance(suspend, bool):  # bool("false") would suspend the job
        raise ConfigError(f"expected true or false, got {suspend!r}", field="spec.suspend")
    return suspend


def _check_template_sizes(spec: Mapping[str, Any]) -> None:
    master = spec.get("master")
    templates = {
        "spec.template": spec.get("template"),
        "spec.master.template": master.get("template") if isinstance(master, Mapping) else None,
    }
    for where, template in templates.items():
        size = len(json.dumps(template or {}, separators=(",", ":"), default=str))
        if size > MAX_TEMPLATE_BYTES:
            raise ConfigError(
                f"is {size // 1024} KiB as JSON, at most {MAX_TEMPLATE_BYTES // 1024} KiB: a Pod is built "
                "from it for every node; put large data in a ConfigMap or Secret the Pod mounts",
                field=where,
            )


def _first_container(spec: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(the worker template, its first container: the one that runs phalanx-run)."""
    template = spec.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise ConfigError("the worker template needs at least one container", field="spec.template")
    return template, containers[0]


def _nproc(spec: Mapping[str, Any], container: Mapping[str, Any]) -> int:
    where = "spec.template.spec.containers[0]"
    nproc = resources.nproc_per_node(spec.get("nprocPerNode", 1), container, field=where)
    if nproc > MAX_NPROC_PER_NODE:
        raise ConfigError(f"must be at most {MAX_NPROC_PER_NODE}, got {nproc}", field="spec.nprocPerNode")
    return nproc


def _parallelism(par: Mapping[str, Any], *, nproc: int, unit: int) -> tuple[int, int]:
    """(tensor, pipeline) degrees; their product divides the ranks of one unit of nodes."""
    tensor = _count(par, "tensor", 1, where="parallelism", maximum=MAX_PARALLEL_DEGREE)
    pipeline = _count(par, "pipeline", 1, where="parallelism", maximum=MAX_PARALLEL_DEGREE)
    if tensor < 1 or pipeline < 1:
        raise ConfigError(f"degrees must be at least 1, got {tensor} x {pipeline}", field="spec.parallelism")
    if (nproc * unit) % (tensor * pipeline):
        raise ConfigError(
            f"parallelism.tensor x parallelism.pipeline ({tensor} x {pipeline}) must divide nprocPerNode x "
            f"nodes.unit ({nproc} x {unit}), so that every model replica fits in one unit of "
            "nodes",
            field="spec.parallelism",
        )
    return tensor, pipeline


def parse_spec(spec: Mapping[str, Any]) -> JobSpec:
    """Builds a :class:`JobSpec` from an ElasticJob's ``spec``; raises ConfigError naming the field. The
    checks run in a fixed order, so a spec with several mistakes always names the same one first."""
    _check_template_sizes(spec)  # first: nothing else walks a template too large to handle
    nodes = _group(spec, "nodes")
    try:
        rendezvous = _rendezvous(nodes)
        heartbeat = _heartbeat(_group(spec, "heartbeat"))
        hang = _hang(_group(spec, "hang"))
        restart = _restart(_group(spec, "restart"))
        checkpoint = _checkpoint(_group(spec, "checkpoint"))
        probes = _probes(_group(spec, "healthChecks"))
    except ConfigError as exc:
        raise ConfigError(f"invalid ElasticJob spec: {exc}") from exc
    par = _group(spec, "parallelism")
    policy = _clean_pod_policy(spec)
    suspend = _suspend(spec)
    deadline = active_deadline(spec)
    ttl = ttl_after_finished(spec)
    gang = parse_gang(spec, min_nodes=rendezvous.min_nodes, max_nodes=rendezvous.max_nodes)
    template, container = _first_container(spec)
    nproc = _nproc(spec, container)
    tensor, pipeline = _parallelism(par, nproc=nproc, unit=rendezvous.unit)
    master = _group(spec, "master")
    return JobSpec(
        rendezvous=rendezvous,
        heartbeat=heartbeat,
        hang=hang,
        restart=restart,
        checkpoint=checkpoint,
        probes=probes,
        nproc_per_node=nproc,
        tensor=tensor,
        pipeline=pipeline,
        cordon_bad_nodes=bool(spec.get("cordonBadNodes", False)),
        clean_pod_policy=policy,
        suspend=suspend,
        template=template,
        master_resources=(master.get("resources") or {}),
        master_template=(master.get("template") or {}),
        status_progress_interval_s=_dur(
            master, "statusProgressInterval", DEFAULT_STATUS_PROGRESS_INTERVAL_S, "master"
        ),
        shared_memory=_shared_memory(spec, nproc, container),
        termination_grace_s=_termination_grace(spec, restart),
        create_refused_timeout_s=_create_refused_timeout(spec),
        active_deadline_s=deadline,
        ttl_after_finished_s=ttl,
        gang=gang,
        max_disruptions=_max_disruptions(_group(spec, "restart")),
    )


def _max_disruptions(rs: Mapping[str, Any]) -> int:
    default = JobPodSettings().max_disruptions
    number = _count(rs, "maxDisruptions", default, where="restart", maximum=MAX_RESTART_BUDGET)
    if number < 0:
        raise ConfigError(f"cannot be negative, got {number}", field="spec.restart.maxDisruptions")
    return number
