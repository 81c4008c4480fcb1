"""The process's Checkpointer, shared by every :class:`~phalanx.checkpoint.dcp.FlashWriter` and
:class:`~phalanx.checkpoint.dcp.FlashReader` not given one; and the warning (logged, and a CheckpointWarning)
they give when a save or a load goes on past a problem: a persist the host did not take, a snapshot
skipped."""

from __future__ import annotations

import logging
import threading
import warnings

from phalanx.checkpoint.engine import Checkpointer
from phalanx.checkpoint.restore import CheckpointWarning

log = logging.getLogger("phalanx.checkpoint")

_shared_lock = threading.Lock()
_shared: Checkpointer | None = None


def checkpointer() -> Checkpointer:
    """The process's Checkpointer, which :class:`FlashWriter` and :class:`FlashReader` use unless given one:
    made on first use from the environment (ranks, the node's checkpoint host and its storage). At the end of
    training, its ``wait()`` raises PersistError if persisting failed; then :func:`close`."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Checkpointer()
        return _shared


def close() -> None:
    """Closes the process's Checkpointer (see :func:`checkpointer`), if one was made: the next use makes
    another."""
    global _shared
    with _shared_lock:
        shared, _shared = _shared, None
    if shared is not None:
        shared.close()


def warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=3)
