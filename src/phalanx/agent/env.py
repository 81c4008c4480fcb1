"""The environment of a worker process: what torchrun sets, plus phalanx's own channels. Pure functions.

The environment comes in two parts because workers may be started before their round is known (warm
spares): :func:`static_env` is fixed for a local rank for the life of the agent and is given when the
process starts; :func:`round_env` carries the round (ranks, store address, restart count) and is handed
over when the round completes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.api import beacon, intervals
from phalanx.api import round as round_file
from phalanx.api.round import RoundInfo


@dataclass(frozen=True, kw_only=True)
class WorkerPaths:
    """Per-worker files of one round."""

    beacon: Path
    error_file: Path
    stack_file: Path
    regroup_file: Path
    stdout_log: Path
    stderr_log: Path
    intervals: Path | None = None
    """The worker's interval ring (:mod:`phalanx.api.intervals`), beside its beacon; None: no recorder."""


FR_ENV, FR_LEGACY_ENV, FR_ENTRIES = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"
"""torch's flight-recorder size, its older name (still read, with a warning), and the agent's default."""


def static_env(
    base: Mapping[str, str],
    *,
    local_rank: int,
    local_world_size: int,
    job_id: str,
    node_id: str,
    instrument: bool = True,
) -> dict[str, str]:
    """The part of a worker's environment that does not depend on the round."""
    env = dict(base)
    if not instrument:
        env[intervals.INSTRUMENT_ENV_VAR] = "0"
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: N processes must not each take all cores
    # NCCL's flight recorder, which a hung rank dumps into its hang evidence (phalanx.intervals); 2000 entries
    # cost a few MiB per process. Set it (by either name) to 0 to turn it off.
    if FR_ENV not in env and FR_LEGACY_ENV not in env:
        env[FR_ENV] = FR_ENTRIES
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "TORCHELASTIC_RUN_ID": job_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "PHALANX_NODE_ID": node_id,
            "PHALANX_JOB_ID": job_id,
            "PYTHONUNBUFFERED": base.get("PYTHONUNBUFFERED", "1"),
        }
    )
    # A token is the agent's business, not the workers'.
    env.pop("PHALANX_TOKEN_FILE", None)
    return env


def round_env(
    info: RoundInfo,
    *,
    local_rank: int,
    role: str,
    max_restarts: int,
    paths: WorkerPaths,
    round_path: Path,
) -> dict[str, str]:
    """The part of a worker's environment that a completed round determines."""
    rank = info.rank(local_rank)
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(info.world_size),
        "GROUP_RANK": str(info.group_rank),
        "GROUP_WORLD_SIZE": str(len(info.members) or 1),
        "ROLE_NAME": role,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "MASTER_ADDR": info.store_host,
        "MASTER_PORT": str(info.store_port),
        "TORCHELASTIC_RESTART_COUNT": str(info.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_ERROR_FILE": str(paths.error_file),
        beacon.ENV_VAR: str(paths.beacon),
        round_file.ENV_VAR: str(round_path),
        round_file.REGROUP_ENV_VAR: str(paths.regroup_file),
    }
    if paths.intervals is not None:
        env[intervals.ENV_VAR] = str(paths.intervals)
    return env


def beacon_path(*, shm_dir: Path, job_id: str, node_id: str, local_rank: int) -> Path:
    """Where a worker's beacon lives; the name is stable so ``phalanx local`` can find it."""
    return shm_dir / f"phalanx-{job_id}-{node_id}-{local_rank}.beacon"


def intervals_path(*, shm_dir: Path, job_id: str, node_id: str, local_rank: int) -> Path:
    """Where a worker's interval ring lives: beside its beacon."""
    return shm_dir / f"phalanx-{job_id}-{node_id}-{local_rank}.intervals"
