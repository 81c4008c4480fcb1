"""Resource arithmetic of the worker Pods: Kubernetes quantities, the GPU count of a container, the
processes per node it implies, and the size of the ``/dev/shm`` the flash checkpoint needs.

Pure functions; the CRD's CEL rules check the same things at admission (with the API server's own quantity
library), these check an object that slipped past an older CRD and compute what admission cannot.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from phalanx.api.errors import ConfigError

GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource the NVIDIA device plugin advertises; ``nprocPerNode: auto`` counts it."""
AUTO = "auto"

MIB = 1 << 20
SLOTS_PER_RANK = 2
"""Slots the flash checkpoint keeps per rank in /dev/shm (phalanx.checkpoint.shm.SLOTS): a save writes the
slot not holding the newest complete snapshot, so a crash mid-save never loses the last good one."""
SLOT_GROWTH = 1.1
"""Headroom a slot is allocated with (phalanx.checkpoint.slots.GROWTH), so a slightly larger state does
not reallocate."""
MIN_SHARED_MEMORY = "64Mi"
"""Smallest ``sharedMemory.sizeLimit`` admitted: a container runtime gives a container 64Mi of /dev/shm
without any volume, so a smaller emptyDir would only take memory away."""

_SUFFIXES = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
}  # fmt: skip
_QUANTITY = re.compile(
    r"^([+]?[0-9]+(?:[.][0-9]*)?|[+]?[.][0-9]+)([eE][-+]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
)


def parse_quantity(value: Any, *, field: str) -> Decimal:
    """A Kubernetes resource quantity (``8``, ``"16Gi"``, ``"1.5G"``, ``"500m"``) as a number of units;
    a ConfigError naming ``field`` when it is none (or negative: no resource here can be)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"expected a quantity such as 16Gi, got {value!r}", field=field)
    text = str(value).strip()
    if text.endswith("m") and not text.endswith("Mi"):  # milli: only CPU uses it, never a size
        number, suffix = text[:-1], "m"
    else:
        match = _QUANTITY.match(text)
        if not match:
            raise ConfigError(f"expected a quantity such as 16Gi, got {value!r}", field=field)
        number, suffix = match.group(1), match.group(2) or ""
    try:
        amount = Decimal(number)
    except InvalidOperation as exc:
        raise ConfigError(f"expected a quantity such as 16Gi, got {value!r}", field=field) from exc
    if suffix == "m":
        return amount / 1000
    if suffix[:1] in ("e", "E") and suffix not in _SUFFIXES:
        return amount * Decimal(10) ** int(suffix[1:])
    return amount * _SUFFIXES[suffix]


def format_mib(size: int) -> str:
    """Bytes as the quantity a person writes: ``16Gi`` when whole gibibytes, else ``...Mi`` (rounded up)."""
    mib = -(-size // MIB)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def _limits(container: Mapping[str, Any]) -> Mapping[str, Any]:
    resources = container.get("resources") or {}
    limits = resources.get("limits") if isinstance(resources, Mapping) else None
    return limits if isinstance(limits, Mapping) else {}


def gpu_limit(container: Mapping[str, Any], *, field: str) -> int | None:
    """The container's ``nvidia.com/gpu`` limit (None without one). Extended resources are whole numbers
    and are asked for in limits (a request, if any, must equal the limit)."""
    limits = _limits(container)
    if GPU_RESOURCE not in limits:
        return None
    count = parse_quantity(limits[GPU_RESOURCE], field=f"{field}.resources.limits[{GPU_RESOURCE}]")
    if count != count.to_integral_value():
        raise ConfigError(
            f"must be a whole number of GPUs, got {limits[GPU_RESOURCE]!r}",
            field=f"{field}.resources.limits[{GPU_RESOURCE}]",
        )
    return int(count)


def memory_limit(container: Mapping[str, Any], *, field: str) -> int | None:
    """The container's memory limit in bytes (None without one)."""
    limits = _limits(container)
    if "memory" not in limits:
        return None
    return int(parse_quantity(limits["memory"], field=f"{field}.resources.limits.memory"))


def nproc_per_node(value: Any, container: Mapping[str, Any], *, field: str) -> int:
    """``spec.nprocPerNode``: a number, or ``auto`` for one process per GPU of the first container (1
    without GPUs). A number above the container's GPU limit is refused: those processes would have no GPU
    of their own (``LOCAL_RANK`` >= ``torch.cuda.device_count()``)."""
    gpus = gpu_limit(container, field=field)
    if value == AUTO:
        return gpus if gpus else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"expected a whole number from 1, or {AUTO}, got {value!r}", field="spec.nprocPerNode"
        )
    if gpus is not None and value > gpus:
        raise ConfigError(
            f"{value} processes per node but the first container's {GPU_RESOURCE} limit is {gpus}: every "
            f"process needs a GPU of its own; set nprocPerNode to at most {gpus}, or to {AUTO}",
            field="spec.nprocPerNode",
        )
    return value


def default_shared_memory(
    nproc: int, container: Mapping[str, Any], *, per_process_mib: int, field: str
) -> int:
    """``sharedMemory.sizeLimit`` when the spec gives none: ``per_process_mib`` per training process, but
    never more than the container's memory limit (pages in /dev/shm count against it, so a larger volume
    could never be filled: the container would be OOM-killed first)."""
    size = nproc * per_process_mib * MIB
    limit = memory_limit(container, field=field)
    return min(size, limit) if limit is not None else size


def state_fits(shared_memory: int, nproc: int) -> int:
    """The largest checkpointed state per rank that ``shared_memory`` bytes hold: every rank's two slots,
    each allocated with :data:`SLOT_GROWTH` headroom (headers and metadata are a few KiB, ignored here)."""
    return int(shared_memory / (nproc * SLOTS_PER_RANK * SLOT_GROWTH))


def shared_memory_exhausted(reason: str) -> bool:
    """Whether a failure reason is a flash-checkpoint save that did not fit in /dev/shm: the checkpoint
    host's and the training process's messages both say "cannot allocate ... shared memory"."""
    text = reason.lower()
    return "cannot allocate" in text and "shared memory" in text
