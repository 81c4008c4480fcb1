"""torch.distributed.checkpoint (DCP) over the flash checkpoint: :class:`FlashWriter` and :class:`FlashReader`
keep each rank's part of a DCP checkpoint in its node's shared memory, through the process's
:class:`~phalanx.checkpoint.Checkpointer` (the node's checkpoint host persists it in the background)::

    import torch.distributed.checkpoint as dcp
    from phalanx.checkpoint.dcp import FlashReader, FlashWriter

    reader, start = FlashReader(), 0
    if reader.locate() is not None:          # newest step every rank holds: memory, else storage (collective)
        dcp.load(state, storage_reader=reader)
        start = reader.step + 1
    for step in range(start, steps):
        train_one_step()
        dcp.save(state, storage_writer=FlashWriter(step=step, persist=step % 100 == 0))
        # or dcp.async_save(state, storage_writer=FlashWriter(...), process_group=a_gloo_group): it returns
        # once the copy into shared memory is done, and only DCP's planning runs behind training

``dcp.load(state, storage_reader=FlashReader())`` alone also works; it raises CheckpointNotFoundError
(inside DCP's CheckpointException) when no step is held by every rank.

What a rank keeps: every value of its local plan, before DCP's planner deduplicates replicated values (a
plain tensor every data-parallel rank holds) onto one rank, as the Checkpointer keeps a data-parallel
replica on every rank. A restarted rank then reads all it needs from its own snapshot in its node's memory.
Each snapshot describes itself: beside its tensor chunks it holds, in its JSON skeleton, what DCP's global
``Metadata`` needs of it (each chunk's fqn, dtype, global size, offsets and sizes; the fqns of its other
values; the planner's key mapping), so no coordinator writes a global file after the copy.

No pickle crosses a process. torch's FileSystemWriter pickles its metadata and DCP's planner torch.saves
each non-tensor value; here the metadata is JSON, and a non-tensor value is decoded in the process that
saved it (``torch.load(weights_only=True)`` of bytes its own planner made a moment before) and kept as plain
data in the snapshot's skeleton (see :mod:`phalanx.checkpoint.codec`). The loading process torch.saves it
again, in process, for its planner to load. A value the codec cannot represent is refused, naming its key.

Loading: every rank loads its own snapshot of the newest step all ranks hold (``Checkpointer.load``: from
memory when its node kept it, else from storage, checksums verified, a snapshot that fails its check skipped
by every rank). The ranks then all-gather their snapshots' descriptions (JSON bytes in uint8 tensors) and
each builds DCP's ``Metadata``, whose ``storage_data`` maps every chunk and value to the ranks that hold it.
A chunk this rank's snapshot lacks (the world or the sharding changed) is read from a holder's snapshot in
this node's memory, else received from a rank of this world that holds it in memory (``peers``), else read
from storage when the step was persisted; else the load fails, saying which. When no step is held by every
rank (a node replaced, the step never persisted), the newest step the ranks' memories hold whole between them
is loaded, the ranks that lost theirs receiving their parts from the replicas (HSDP, data parallel).

The package's modules: ``writer`` (:class:`FlashWriter`) and ``snapshot`` (what it keeps); ``reader``
(:class:`FlashReader`), ``metadata`` (snapshots' structure and descriptions, and DCP's ``Metadata`` from
them: pure functions), ``collectives`` (the descriptions' all-gather), ``sources`` (other ranks'
snapshots) and ``peers`` (what other nodes' ranks send); ``process`` (the process's Checkpointer).
"""

from __future__ import annotations

from phalanx.checkpoint.dcp.metadata import build_metadata
from phalanx.checkpoint.dcp.process import checkpointer, close
from phalanx.checkpoint.dcp.reader import FlashReader
from phalanx.checkpoint.dcp.snapshot import FORMAT
from phalanx.checkpoint.dcp.writer import FlashWriter

__all__ = ["FORMAT", "FlashReader", "FlashWriter", "build_metadata", "checkpointer", "close"]
