"""Field checks for agent requests: malformed requests get INVALID_ARGUMENT before they touch the job.

The checks bound everything an agent controls (ids, counts, sizes), so one broken or hostile agent cannot
make the master keep unbounded state. gRPC's own receive limit (``max_request_bytes``) caps the size of
a whole request before it is even parsed.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.errors import RequestError
from phalanx.master.state.beat import BeatRanks, read_ranks

__all__ = ["validate", "validate_heartbeat"]

_NODE_ID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
MAX_NPROC = 1024
MAX_RANKS = 4096
MAX_LINES = 20_000
MAX_STACKS_BYTES = limits.MAX_STACKS_CHARS
MAX_HELD_STEPS = 64  # a node keeps two snapshots per rank; a few more leave room for other layouts


def _node(node_id: str, incarnation: str) -> None:
    if not node_id:
        raise RequestError("node_id is empty")
    if not _NODE_ID.fullmatch(node_id):
        raise RequestError(f"node_id {node_id[:64]!r} is not 1-253 letters, digits, '.', '_' or '-'")
    if not incarnation or len(incarnation) > 128:
        raise RequestError("incarnation must be 1-128 characters")


def _round(value: int) -> None:
    if value < 0:
        raise RequestError(f"round cannot be negative, got {value}")


def _nproc(value: int) -> None:
    if not 1 <= value <= MAX_NPROC:
        raise RequestError(f"nproc_per_node must be between 1 and {MAX_NPROC}, got {value}")


def _wait(value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"wait_s must be a finite number >= 0, got {value}")


def _count(name: str, items: Any, limit: int) -> None:
    if len(items) > limit:
        raise RequestError(f"too many {name}: {len(items)} (at most {limit})")


_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


@functools.cache
def _has_floats(desc: Descriptor) -> bool:
    """Whether messages of ``desc`` hold a float anywhere (so a ReportLogs of 20,000 lines is not walked)."""
    return any(
        f.type in _FLOATS or (f.type == FieldDescriptor.TYPE_MESSAGE and _has_floats(f.message_type))
        for f in desc.fields
    )


# How _finite reads a field: a float, repeated floats, a message, repeated messages, a map of floats, a map
# of messages.
_FLOAT, _FLOATS_REPEATED, _MESSAGE, _MESSAGES, _MAP_FLOATS, _MAP_MESSAGES = range(6)


@functools.cache
def _float_plan(desc: Descriptor) -> tuple[tuple[str, int], ...]:
    """The fields of ``desc`` that :func:`_finite` reads, and how: its float fields and its message fields
    (maps included) that hold a float somewhere. Worked out once per message type, so that checking a
    heartbeat reads a handful of fields instead of listing every field of every rank."""
    plan: list[tuple[str, int]] = []
    for f in desc.fields:
        if f.type in _FLOATS:
            plan.append((f.name, _FLOATS_REPEATED if f.is_repeated else _FLOAT))
        elif f.type == FieldDescriptor.TYPE_MESSAGE and (sub := f.message_type) and _has_floats(sub):
            if sub.GetOptions().map_entry:
                value = sub.fields_by_name["value"]
                plan.append((f.name, _MAP_FLOATS if value.type in _FLOATS else _MAP_MESSAGES))
            else:
                plan.append((f.name, _MESSAGES if f.is_repeated else _MESSAGE))
    return tuple(plan)


_Path = tuple[Any, str, Any] | None
"""Where a nested message sits: (its parent's path, field name, index or key), spelled out only for an
error (formatting a path for every rank of every heartbeat would cost more than the check)."""


def _spell(path: _Path) -> str:
    if path is None:
        return ""
    parent, name, at = path
    return f"{_spell(parent)}{name}{'' if at is None else f'[{at!r}]'}."


def _finite(message: Message, path: _Path = None) -> None:
    """Every float field of ``message``, nested ones included, is finite: nan slips past every bound check
    and then breaks what the number feeds (medians, the JSON of the HTTP API, the state file)."""
    for name, how in _float_plan(message.DESCRIPTOR):
        if how == _FLOAT:
            value = getattr(message, name)
            if not math.isfinite(value):
                raise RequestError(f"{_spell(path)}{name} must be a finite number, got {value!r}"[:200])
        elif how == _MESSAGES:
            for i, item in enumerate(getattr(message, name)):
                _finite(item, (path, name, i))
        elif how == _MESSAGE:
            if message.HasField(name):
                _finite(getattr(message, name), (path, name, None))
        elif how == _FLOATS_REPEATED:
            values = getattr(message, name)
            if not all(math.isfinite(v) for v in values):
                raise RequestError(f"{_spell(path)}{name} must be a finite number, got {values!r}"[:200])
        else:
            entries = getattr(message, name)
            for key in entries:
                if how == _MAP_MESSAGES:
                    _finite(entries[key], (path, name, key))
                elif not math.isfinite(entries[key]):
                    raise RequestError(f"{_spell(path)}{name}[{key!r}] must be a finite number"[:200])


def validate_heartbeat(request: pb.HeartbeatRequest) -> BeatRanks:
    """:func:`validate` of a heartbeat, which returns its ranks as read: the check of their numbers is the
    one pass over them the job takes too (see :mod:`phalanx.master.state.beat`)."""
    _node(request.node_id, request.incarnation)
    _round(request.round)
    _count("ranks", request.ranks, MAX_RANKS)
    _wait(request.wait_s)
    return read_ranks(request)


def validate(request: Any) -> None:
    """Raises :class:`RequestError` when a request is malformed."""
    if isinstance(request, pb.HeartbeatRequest):
        validate_heartbeat(request)
        return
    if _has_floats(request.DESCRIPTOR):
        _finite(request)
    if isinstance(request, pb.RegisterNodeRequest):
        _node(request.node_id, request.incarnation)
        _nproc(request.nproc_per_node)
        if not request.job_id:
            raise RequestError("job_id is empty")
        for name in ("host", "machine", "agent_version"):
            if len(getattr(request, name)) > 253:
                raise RequestError(f"{name} is longer than 253 characters")
        return
    _node(request.node_id, request.incarnation)
    if isinstance(request, pb.JoinRendezvousRequest):
        _nproc(request.nproc_per_node)
        if not request.store_host or len(request.store_host) > 253:
            raise RequestError("store_host must be 1-253 characters")
        if not 1 <= request.store_port <= 65535:
            raise RequestError(f"store_port must be between 1 and 65535, got {request.store_port}")
        _round(request.last_round)
    elif isinstance(request, pb.GetRendezvousRequest):
        _round(request.round)
        _wait(request.wait_s)
    elif isinstance(request, pb.ReportFailureRequest):
        _round(request.round)
        _count("failures", request.failures, MAX_RANKS)
    elif isinstance(request, pb.ReportCompletionRequest):
        _round(request.round)
    elif isinstance(request, pb.ReportLogsRequest):
        _count("lines", request.lines, MAX_LINES)
        if request.dropped < 0:
            raise RequestError(f"dropped cannot be negative, got {request.dropped}")
    elif isinstance(request, pb.ReportCheckpointRequest):
        if request.step < 0:
            raise RequestError(f"step cannot be negative, got {request.step}")
        _count("ranks", request.ranks, MAX_RANKS)
        if request.state == pb.CHECKPOINT_STATE_PERSISTED and not 1 <= request.world_size <= 1 << 20:
            raise RequestError(f"world_size must be positive for a persisted step, got {request.world_size}")
        if any(r < 0 for r in request.ranks):
            raise RequestError("ranks cannot be negative")
        _round(request.round)
        if len(request.held_steps) > MAX_HELD_STEPS or any(s < 0 for s in request.held_steps):
            raise RequestError(f"held_steps must be at most {MAX_HELD_STEPS} steps >= 0")
    elif isinstance(request, pb.ReportProbeRequest):
        if request.probe not in (pb.PROBE_KIND_MATMUL, pb.PROBE_KIND_ALLGATHER):
            raise RequestError(f"probe must be a known probe kind, got {request.probe}")
        _count("measurements", request.measurements, MAX_RANKS)
        if any(len(m.error) > 4096 or len(m.peer_node_id) > 253 for m in request.measurements):
            raise RequestError("a probe measurement's error or peer_node_id is too long")
        if request.probe_round < 0:
            raise RequestError(f"probe_round cannot be negative, got {request.probe_round}")
        # The analysis takes medians of the rates: NaN or infinity would poison every verdict.
        if any(not (math.isfinite(m.rate) and m.rate >= 0) for m in request.measurements):
            raise RequestError("a probe measurement's rate must be a finite number >= 0")
    elif isinstance(request, pb.ReportStacksRequest):
        _round(request.round)
        _count("ranks", request.ranks, MAX_RANKS)
        if sum(len(r.stacks) for r in request.ranks) > MAX_STACKS_BYTES:
            raise RequestError(f"stacks exceed {MAX_STACKS_BYTES} bytes")
