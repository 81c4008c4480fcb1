"""The round file: how a node agent tells its running workers about a new rendezvous round.

Workers started by ``phalanx-run`` find the path in ``PHALANX_ROUND_FILE``. The agent rewrites the file
atomically (write to a temporary file, then rename) whenever a round completes. A worker that can re-form
its process groups in-process (``phalanx.trainer``) announces this by calling :func:`announce_regroup`;
for such workers the agent, on a membership change, keeps the processes alive and only rewrites this file,
instead of stopping and restarting them. Workers of plain torchrun scripts never read it.

The file is JSON (never pickle): a :class:`RoundInfo`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV_VAR = "PHALANX_ROUND_FILE"
REGROUP_ENV_VAR = "PHALANX_REGROUP_FILE"


@dataclass(frozen=True, kw_only=True)
class RoundInfo:
    """One completed rendezvous round as seen by one node."""

    round: int
    """Round number; strictly increasing within a job."""
    group_rank: int
    """Index of this node in the round (GROUP_RANK)."""
    rank_offset: int
    """Global rank of this node's local rank 0; a worker's rank is rank_offset + local_rank."""
    world_size: int
    """Processes in the round (WORLD_SIZE)."""
    local_world_size: int
    """Processes on this node (LOCAL_WORLD_SIZE)."""
    store_host: str
    """MASTER_ADDR of the round: where global rank 0 serves the c10d store."""
    store_port: int
    """MASTER_PORT of the round; fresh for every round so no stale store is ever reused."""
    restart_count: int = 0
    """TORCHELASTIC_RESTART_COUNT of the round."""
    members: list[str] = field(default_factory=list)
    """Node ids in group-rank order."""
    joined: list[str] = field(default_factory=list)
    """Node ids that were not members of the previous round (they need state from a peer)."""
    store_key: str = ""
    """The secret prefix of the store's keys in this round (:func:`phalanx.api.auth.store_key`): the store
    authenticates nobody, and keys no stranger can name are keys no stranger can forge. "": none."""

    def rank(self, local_rank: int) -> int:
        return self.rank_offset + local_rank


def write(path: Path, info: RoundInfo) -> None:
    """Written owner-only (it holds the round's store key), then renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(info)))
    tmp.replace(path)


def read(path: Path) -> RoundInfo | None:
    """The current round, or None while the file does not exist yet."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return RoundInfo(**data)


def announce_regroup(path: Path | None = None) -> bool:
    """Called by a worker that re-forms its groups in-process; returns False outside phalanx-run."""
    target = path or (Path(os.environ[REGROUP_ENV_VAR]) if os.environ.get(REGROUP_ENV_VAR) else None)
    if target is None:
        return False
    target.write_text(str(os.getpid()))
    return True
