"""Where a worker learns its rank, world and store address: the agent's round file, or torchrun's env.

Under ``phalanx-run`` in regroup mode the agent rewrites ``PHALANX_ROUND_FILE`` (atomic rename) on every
membership change while the worker keeps running; :meth:`RoundSource.changed` notices that with one
``stat`` per step (the inode changes on every rename). Under plain torchrun the environment fixes the
round for the life of the process and nothing ever changes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.api import round as round_file
from phalanx.api.errors import ConfigError, RendezvousTimeoutError


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """What one worker needs to join one round's process group."""

    round: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    joined: tuple[str, ...] = ()
    store_key: str = ""
    """The secret prefix of the round's store keys (the round file's); "": none."""


class RoundSource:
    """The current round of this worker, from the round file when there is one, else from the env."""

    def __init__(self, path: Path | None = None, *, local_rank: int | None = None) -> None:
        env_path = os.environ.get(round_file.ENV_VAR)
        self.path = path or (Path(env_path) if env_path else None)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self._seen: tuple[int, int, int] | None = None

    @property
    def elastic(self) -> bool:
        """Whether rounds can change under this process (a round file exists)."""
        return self.path is not None

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> RoundSpec | None:
        """The round as written now; None while the agent has not written one yet."""
        if self.path is None:
            return _from_env()
        self._seen = self._stat()
        info = round_file.read(self.path)
        if info is None:
            return None
        return RoundSpec(
            round=info.round,
            rank=info.rank(self.local_rank),
            world_size=info.world_size,
            store_host=info.store_host,
            store_port=info.store_port,
            joined=tuple(info.joined),
            store_key=info.store_key,
        )

    def changed(self) -> bool:
        """Cheap check (one stat) whether the file was rewritten since the last :meth:`current`."""
        return self.path is not None and self._stat() != self._seen

    def newer_than(self, round_no: int) -> bool:
        """Whether the file now holds a round after ``round_no``; reads it only when :meth:`changed`, and
        leaves it unseen (safe from another thread while the owner trains)."""
        if not self.changed():
            return False
        assert self.path is not None
        info = round_file.read(self.path)
        return info is not None and info.round > round_no

    def wait_newer(self, than: int, *, timeout_s: float, poll_s: float = 0.01) -> RoundSpec:
        """Blocks until a round newer than ``than`` is written."""
        deadline = time.monotonic() + timeout_s
        while True:
            spec = self.current()
            if spec is not None and spec.round > than:
                return spec
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"no round after {than} arrived within {timeout_s:.0f} s; restarting the worker"
                )
            time.sleep(poll_s)


def _from_env() -> RoundSpec:
    try:
        return RoundSpec(
            round=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            store_host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ.get("MASTER_PORT", "0")),
        )
    except ValueError as exc:
        raise ConfigError("RANK, WORLD_SIZE and MASTER_PORT must be integers") from exc
