"""The writer: :class:`FlashWriter` copies this rank's part of a DCP checkpoint into its flash checkpoint
slot, through the process's Checkpointer; nothing else is written (every snapshot describes itself)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint.dcp.process import checkpointer, warn
from phalanx.checkpoint.dcp.snapshot import FORMAT, check_plan_kept, entries, kept_indices
from phalanx.checkpoint.engine import Checkpointer, current_round


class FlashWriter(StorageWriter, AsyncStager):
    """A DCP storage writer that copies this rank's part of the checkpoint of ``step`` into its flash
    checkpoint slot; with ``persist`` the node's checkpoint host then writes it to storage in the background
    (a persist the host cannot take is a warning: the snapshot is in memory and the next persist retries;
    ``checkpointer().wait()`` raises what finally failed). One writer per save.

    ``dcp.save`` copies in :meth:`write_data`, after DCP's planning. ``dcp.async_save`` calls :meth:`stage`
    on the training thread, which copies the state into shared memory and returns: the DCP planning that
    follows on DCP's thread reads no tensor data. Give ``async_save`` a process group of its own (torch's
    advice for any async save: its collectives then never interleave with training's). Only the default
    thread-based async save is supported; the state must be planned as DefaultSavePlanner plans it.
    """

    _synchronize_after_execute = False  # stage() returns once the snapshot is complete in memory

    def __init__(self, step: int, *, persist: bool = False, checkpointer: Checkpointer | None = None) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"FlashWriter: step must be a non-negative int, not {step!r}")
        self.step = step
        self.persist = persist
        self._given = checkpointer
        self._local_plan: SavePlan | None = None
        self._kept: set[MetadataIndex] | None = None  # what the snapshot holds, once it is saved
        self._saver_rank = -1
        self.seconds: float | None = None
        """How long the copy into shared memory (with its preparation) took: what training waited."""

    def _checkpointer(self) -> Checkpointer:
        return self._given if self._given is not None else checkpointer()

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise ValueError(
                "FlashWriter names its checkpoint by step=, not checkpoint_id: pass no checkpoint_id"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked from a checkpoint_id: a FlashWriter is passed explicitly

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError("FlashWriter needs DCP's collectives (use_collectives=True)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable:
            raise CheckpointError(
                "FlashWriter needs each rank's local plan, which DCP's plan caching withholds: save with "
                "DefaultSavePlanner(enable_plan_caching=False)"
            )
        self._local_plan = plan  # before deduplication: every value this rank holds, replicas included
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s staging: plans this rank's values as DefaultSavePlanner does and copies them
        into shared memory, on the caller's thread. The state dict is returned as it is: the save that runs
        behind training only plans with it (shapes and placements), and :meth:`write_data` reads nothing."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
        plan = planner.create_local_plan()
        self._save(plan.items, planner.resolve_data, plan.planner_data)
        return state_dict

    def __reduce__(self) -> Any:
        # dcp.async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS) pickles the writer and the
        # state into a process of its own. Nothing would be gained: stage() has copied the state into shared
        # memory on the training thread by then, and persisting runs in the node's checkpoint host already;
        # the state would only be copied once more, into that process. Refused where it happens, by name.
        raise TypeError(
            "a FlashWriter does not leave its process: use dcp.async_save's default thread-based "
            "checkpointer (AsyncCheckpointerType.THREAD); persisting runs in the node's checkpoint host"
        )

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is done."""

    def close(self) -> None:
        """Nothing to release: the slots belong to the process's Checkpointer."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._kept is None:  # dcp.save: nothing staged, the copy happens here
            local = self._local_plan if self._local_plan is not None else plan
            self._save(local.items, planner.resolve_data, local.planner_data)
        assert self._kept is not None
        check_plan_kept(plan, self._kept)
        results = [
            WriteResult(
                index=item.index, size_in_bytes=item.tensor_storage_size() or 0, storage_data=self._saver_rank
            )
            for item in plan.items
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: every rank's snapshot describes itself, and the reader gathers them."""

    def _save(
        self, items: Iterable[WriteItem], resolve: Callable[[WriteItem], Any], planner_data: Any
    ) -> None:
        if self._kept is not None:
            raise CheckpointError(f"this FlashWriter saved step {self.step} already: make one per save")
        started = time.perf_counter()
        ckpt = self._checkpointer()
        tensors, values = entries(items, resolve)
        snapshot = {
            "format": FORMAT,
            "rank": ckpt.rank,
            "world_size": ckpt.world_size,
            "round": current_round(),
            "planner_data": planner_data,
            "tensors": tensors,
            "values": values,
        }
        try:
            ckpt.save(self.step, snapshot, persist=self.persist)
        except PersistError as exc:
            # Raised after the copy: the snapshot is in memory, and the next persist retries.
            warn(f"step {self.step} is in memory but was not persisted: {exc}")
        self._kept = kept_indices(tensors, values)
        self._saver_rank = ckpt.rank
        self.seconds = time.perf_counter() - started
