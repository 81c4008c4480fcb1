"""Flash checkpoint: shared-memory snapshots that block training only for a memory copy, a background
persister, storage backends and the commit protocol.

Training processes use :class:`Checkpointer` and :class:`ElasticDistributedSampler` (both import torch,
lazily: importing this package does not). The node agent uses :mod:`phalanx.checkpoint.host`, which is
torch-free::

    ckpt = Checkpointer(storage="/ckpt")           # ranks and the host come from the environment
    loaded = ckpt.load()                           # newest step all ranks hold: memory, else storage
                                                   # (DDP: load(replicated=True), any rank's will do)
    start = loaded[0] + 1 if loaded else 0
    for step in range(start, steps):
        train_one_step()
        try:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                             "sampler": sampler.state_dict()}, persist=step % 100 == 0)
        except PersistError:                       # the host could not take it: the snapshot is in
            log.warning(...)                       # memory, and the next persist tries again
    ckpt.wait()                                    # PersistError if persisting failed

Modules: ``shm`` (slot layout and seqlock header), ``storage`` (storage interface, POSIX directory,
commit protocol, retention), ``s3`` (S3 storage), ``persister`` (slot to safetensors), ``host`` (starting
and stopping the per-node owner process), ``server`` (that process's request handling and persist loop),
``messages`` (its typed requests and replies), ``protocol`` (its socket), ``connection`` (a training
process's connection to it), ``persist_queue`` (a training process's persist requests), ``report``
(ReportCheckpoint to the master) are torch-free; ``codec``, ``slots``, ``engine``, ``structure``,
``restore`` and ``sampler`` run in training processes, and so does ``dcp``: a torch.distributed.checkpoint
storage writer and reader over the Checkpointer (``dcp.save(state, storage_writer=FlashWriter(step=s))``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.api.errors import PersistError

__all__ = ["CheckpointWarning", "Checkpointer", "ElasticDistributedSampler", "PersistError"]

if TYPE_CHECKING:
    from phalanx.checkpoint.engine import Checkpointer
    from phalanx.checkpoint.restore import CheckpointWarning
    from phalanx.checkpoint.sampler import ElasticDistributedSampler

_LAZY = {
    "Checkpointer": "phalanx.checkpoint.engine",
    "CheckpointWarning": "phalanx.checkpoint.restore",
    "ElasticDistributedSampler": "phalanx.checkpoint.sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
