"""torch.distributed.checkpoint through the flash checkpoint (:mod:`phalanx.checkpoint.dcp`), with real gloo
ranks, a real checkpoint host and real shared memory; no mocks.

The sharded state is FSDP2's: ``fully_shard`` on a CPU DeviceMesh over gloo (torch 2.15 runs FSDP2 on CPU),
a small MLP whose last layer has 3 rows over 2 ranks (uneven shards), with its Adam state (DTensors and a
replicated step count) and plain values beside it. "Bitwise" compares sha256 digests of the tensors' bytes:
each rank's local shards, or, for a world of one, the whole tensors.

Every process of a rank imports torch, which is most of what these tests cost on a small machine: the
tests that read one save share it (:func:`saved`), and a world of one loads in a process of a larger world
before that world forms.

This module is also the ranks' script: ``python -m tests.checkpoint.test_dcp MODE`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from phalanx.api.errors import CheckpointCorruptError
from phalanx.api.ports import free_port
from phalanx.checkpoint import Checkpointer, shm
from phalanx.checkpoint import host as host_mod
from phalanx.checkpoint import storage as storage_lib
from phalanx.checkpoint.dcp import FORMAT, FlashReader, FlashWriter, build_metadata, checkpointer, close
from phalanx.checkpoint.dcp.peers import involving, plan_transfers
from tests import torch_forks
from tests.checkpoint.conftest import SHM, job_segments, worker_env

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = {"step": 2, "note": ("adam", 1.5, None, b"\x00\x01"), "flags": [True, False]}


# ---------------------------------------------------------------------------------------------------
# DCP's metadata from the snapshots' descriptions (pure)


def _chunk(fqn: str, offsets: list[int], sizes: list[int], size: list[int], dtype: str = "float32") -> Any:
    return {
        "fqn": fqn,
        "offsets": offsets,
        "sizes": sizes,
        "size": size,
        "dtype": dtype,
        "requires_grad": False,
        "strides": None,
    }


def _description(
    rank: int, *tensors: Any, values: tuple[str, ...] = (), world: int = 2, round_no: int = 0
) -> Any:
    return {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "round": round_no,
        "planner_data": {"w": ("model", "w")},
        "tensors": list(tensors),
        "values": [{"fqn": v} for v in values],
    }


def test_metadata_maps_every_chunk_and_value_to_the_ranks_holding_it() -> None:
    """Two ranks each hold half of ``w`` and a replica of ``b`` and of a value: DCP's metadata lists each
    chunk once, and ``storage_data`` says who holds it."""
    metadata = build_metadata(
        [
            _description(
                1, _chunk("w", [2, 0], [2, 3], [4, 3]), _chunk("b", [0], [3], [3]), values=("step",)
            ),
            _description(
                0, _chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("b", [0], [3], [3]), values=("step",)
            ),
        ]
    )
    w = metadata.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    assert (w.size, w.properties.dtype) == (torch.Size([4, 3]), torch.float32)
    assert [list(c.offsets) for c in w.chunks] == [[0, 0], [2, 0]]
    assert isinstance(metadata.state_dict_metadata["step"], BytesStorageMetadata)
    holders = metadata.storage_data
    assert holders[MetadataIndex("w", [0, 0])] == [0]
    assert holders[MetadataIndex("w", [2, 0])] == [1]
    assert holders[MetadataIndex("b", [0])] == [0, 1]
    assert holders[MetadataIndex("step")] == [0, 1]
    assert metadata.planner_data == {"w": ("model", "w")}


@pytest.mark.parametrize(
    ("descriptions", "error"),
    [
        ([_description(0, _chunk("w", [0, 0], [2, 3], [4, 3]))], r"the snapshots of ranks \[1\] are missing"),
        (
            [_description(0, _chunk("w", [0, 0], [2, 3], [4, 3])), _description(1)],
            r"w: its chunks hold 6 of its 12 elements",
        ),
        (
            [
                _description(0, _chunk("w", [0, 0], [2, 3], [4, 3])),
                _description(1, _chunk("w", [2, 0], [2, 3], [4, 3], dtype="bfloat16")),
            ],
            r"w: rank 1 saved a torch.bfloat16 tensor",
        ),
        (
            [
                _description(0, _chunk("w", [0, 0], [2, 3], [4, 3])),
                _description(1, _chunk("w", [2, 0], [2, 3], [5, 3])),
            ],
            r"w: rank 1 saved a torch.float32 tensor of size \[5, 3\]",
        ),
        (
            [_description(0, _chunk("w", [0, 0], [4, 3], [4, 3])), _description(1, values=("w",))],
            r"w: one rank saved it as a tensor and rank 1 as a value",
        ),
        ([_description(0), _description(1, round_no=3)], r"different saves"),
        ([_description(0, _chunk("w", [3, 0], [2, 3], [4, 3])), _description(1)], r"lies outside its tensor"),
        ([{**_description(0), "format": "pickle"}, _description(1)], r"not saved by .*FlashWriter"),
    ],
)
def test_metadata_that_does_not_make_one_whole_checkpoint_is_refused(descriptions: Any, error: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=error):
        build_metadata(descriptions)


def test_without_a_lost_node_s_ranks_the_metadata_holds_what_their_replicas_hold() -> None:
    """HSDP: ranks 0 and 1 hold the two halves of ``w``, ranks 2 and 3 replicas of them. With ranks 2 and 3
    lost (``partial``), the metadata is whole from 0 and 1; with 1 and 3 lost, half of ``w`` is held by no
    rank, and the load is refused."""
    halves = [_chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("w", [2, 0], [2, 3], [4, 3])]
    ranks = [_description(r, halves[r % 2], values=("step",), world=4) for r in range(4)]
    metadata = build_metadata([ranks[0], ranks[1]], partial=True)
    assert metadata.storage_data[MetadataIndex("w", [2, 0])] == [1]
    assert metadata.storage_data[MetadataIndex("step")] == [0, 1]
    with pytest.raises(CheckpointCorruptError, match=r"the snapshots of ranks \[2, 3\] are missing"):
        build_metadata([ranks[0], ranks[1]])
    with pytest.raises(CheckpointCorruptError, match=r"w: its chunks hold 6 of its 12 elements"):
        build_metadata([ranks[0], ranks[2]], partial=True)


def test_transfers_come_from_a_holder_other_than_the_rank_spread_over_the_replicas() -> None:
    """Each rank asks for what only others hold: every key comes from a holder other than the asking rank,
    the holder with the fewest sent so far; a key nobody else holds is left for the reader to name; a key
    asked twice travels once. Every rank's part keeps the global numbering and order."""
    a, b, c, v = ("w", (0, 0)), ("w", (2, 0)), ("b", (0,)), ("step", None)
    holders = {a: [0], b: [1], c: [0, 1], v: [0, 1, 3]}
    transfers = plan_transfers({3: [a, b, c, v, a], 2: [a, ("lost", (0,))]}, holders)
    assert transfers == [(0, 0, 2, a), (1, 0, 3, a), (2, 1, 3, b), (3, 1, 3, c), (4, 0, 3, v)]
    assert involving(transfers, 1) == [(2, 1, 3, b), (3, 1, 3, c)]
    assert involving(transfers, 3) == transfers[1:]
    assert plan_transfers({0: [a]}, holders) == []


def test_a_writer_refuses_to_be_pickled_into_another_process_naming_the_thread_based_save() -> None:
    """``dcp.async_save(async_checkpointer_type=PROCESS)`` pickles its writer into a process of its own:
    the writer refuses, naming the default thread-based save, instead of copying the state once more."""
    with pytest.raises(TypeError, match=r"does not leave its process: .*AsyncCheckpointerType.THREAD"):
        pickle.dumps(FlashWriter(step=1))


# ---------------------------------------------------------------------------------------------------
# One process: plain values round trip as JSON, and a value that needs pickle is refused


class Unplain:
    """Not plain data: torch.save pickles it, and a weights-only load refuses it."""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_values_round_trip_without_pickle_and_others_are_refused(
    host: host_mod.HostHandle, store: Path
) -> None:
    ckpt = Checkpointer(storage=str(store))
    try:
        saved = {"w": torch.arange(6.0).view(2, 3), "meta": {**PROGRESS, "name": "run-7"}}
        dcp.save(saved, storage_writer=FlashWriter(step=3, checkpointer=ckpt), no_dist=True)
        into = {"w": torch.zeros(2, 3), "meta": {"step": 0, "note": (), "flags": [], "name": ""}}
        reader = FlashReader(checkpointer=ckpt)
        dcp.load(into, storage_reader=reader, no_dist=True)
        assert (reader.step, reader.source) == (3, "memory")
        assert torch.equal(into["w"], saved["w"])
        assert into["meta"] == saved["meta"]
        assert type(into["meta"]["note"]) is tuple
        with pytest.raises(CheckpointException, match=r"odd: only plain values .* without pickle"):
            dcp.save({"odd": Unplain()}, storage_writer=FlashWriter(step=4, checkpointer=ckpt), no_dist=True)
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------------------------------
# Ranks in processes of their own


def run_ranks(handle: host_mod.HostHandle, world: int, *args: str) -> list[dict[str, Any]]:
    """Runs ``world`` gloo ranks of :func:`main`; their JSON results, in rank order."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = worker_env(
            handle,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [sys.executable, "-m", "tests.checkpoint.test_dcp", *args]
        procs.append(torch_forks.popen(cmd, env=env, stdout=subprocess.PIPE, cwd=ROOT))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=100)
            assert proc.returncode == 0, out
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:  # a rank that failed leaves its peers waiting for it
        for proc in procs:
            proc.kill()
            proc.communicate()
    return sorted(results, key=lambda r: int(r["rank"]))


@dataclasses.dataclass(frozen=True)
class Saved:
    """What 2 FSDP2 ranks saved and loaded back (:func:`fsdp`): their job's host, id and storage."""

    host: host_mod.HostHandle
    job_id: str
    store: Path
    ranks: list[dict[str, Any]]  # the ranks' results, in rank order


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """2 FSDP2 ranks save steps 1 and 2, persisted, and load them back, once for the tests that read that
    save: a job, storage and checkpoint host of their own (as the ``job_id``, ``store`` and ``host`` fixtures
    make them), and the check that the job leaves nothing behind in /dev/shm."""
    tmp = tmp_path_factory.mktemp("saved")
    job_id = f"t-{uuid.uuid4().hex[:10]}"
    store, empty = tmp / "store", tmp / "new-node-shm"
    store.mkdir()
    empty.mkdir()
    handle = host_mod.start(job_id=job_id, storage=str(store), keep_last=2, socket_path=tmp / "host.sock")
    try:
        ranks = run_ranks(handle, 2, "fsdp", f"--storage={store}", f"--empty-shm={empty}")
        yield Saved(host=handle, job_id=job_id, store=store, ranks=ranks)
    finally:
        handle.stop()
        left = job_segments(job_id)
        for name in left:
            (shm.private_dir(SHM) / name).unlink(missing_ok=True)
    assert not left, f"shared memory of job {job_id} left behind: {left}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_fsdp2_state_round_trips_bitwise_from_memory_and_from_storage(saved: Saved) -> None:
    """2 ranks save step 1 with ``dcp.save`` and step 2 with ``dcp.async_save`` (both persisted), then load
    into a freshly built, differently trained model: from this node's memory, and as a node without memory
    would, from storage. Each rank's shards and Adam state come back bitwise, with the plain values."""
    for r in saved.ranks:
        assert r["async_blocking_s"] < 30, r
        assert r["memory"] == {
            "step": 2, "source": "memory", "foreign": {}, "reads": 0, "same": True, "progress": True
        }, r  # fmt: skip
        storage = r["storage"]
        assert (storage["step"], storage["source"], storage["same"], storage["progress"]) == (
            2, "storage", True, True
        ), r  # fmt: skip
        assert storage["foreign"] == {}, r
    assert storage_lib.committed_steps(storage_lib.open_storage(str(saved.store))) == [1, 2]


def _copy_rank_slots(job_id: str, rank: int, into: Path) -> Path:
    """A node's memory that kept only ``rank``'s slots: copies of them in a shared-memory root of its own."""
    into.mkdir()
    private = shm.check_private_dir(shm.private_dir(into))
    for slot in range(shm.SLOTS):
        source = shm.slot_path(SHM, job_id, rank, slot)
        shutil.copyfile(source, private / source.name)
        (private / source.name).chmod(0o600)
    return into


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_world_of_another_size_loads_the_chunks_it_lacks(saved: Saved, tmp_path: Path) -> None:
    """2 FSDP2 ranks save (and persist). A world of one loads the whole state into a plain (unsharded)
    model: rank 1's chunks come from its slots in this node's memory; on a node without memory, from
    storage; where neither holds them, the load fails and names rank 1's snapshot. Then 3 FSDP2 ranks load
    it, sharded anew: rank 2, which has no snapshot, reads saved rank 0's shard from storage, and each rank
    reads the chunks its snapshot lacks from this node's memory. (The world of one is the first of the three
    processes, in a process group of its own, before the three form theirs: one process less to start.)"""
    whole = saved.ranks[0]["whole"]
    assert saved.ranks[1]["whole"] == whole
    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    only_rank_0 = _copy_rank_slots(saved.job_id, 0, tmp_path / "rank-0-only")
    store = saved.store
    attempts = [f"--load={store}:", f"--load={store}:{empty}", f"--load=:{only_rank_0}"]
    grown = run_ranks(saved.host, 3, "reshard", *attempts)
    from_memory, from_storage, lacking = grown[0]["loads"]
    assert (from_memory["source"], from_memory["foreign"], from_memory["whole"]) == (
        "memory",
        {"1": "memory"},
        whole,
    )
    assert (from_storage["source"], from_storage["foreign"], from_storage["whole"]) == (
        "storage", {"1": "storage"}, whole
    )  # fmt: skip
    assert lacking["error"] == "CheckpointException", lacking
    assert "the snapshots of ranks [1] are neither in this node's memory nor on storage" in lacking["message"]
    assert [(r["step"], r["source"], r["whole"]) for r in grown] == [
        (2, "memory", whole), (2, "memory", whole), (2, "storage", whole)
    ]  # fmt: skip
    assert [r["foreign"] for r in grown] == [{}, {"0": "memory"}, {"1": "memory"}]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_corrupt_metadata_or_a_missing_chunk_fails_every_rank_clearly(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    """2 ranks persist steps 1 and 2; then rank 1's snapshot of step 2 on storage is damaged in turn, and
    both ranks load as a node without memory would. A description that contradicts rank 0's, a lost
    chunk, a snapshot not written by FlashWriter: every rank raises, naming what is wrong, promptly. Flipped
    data bytes fail the checksum: both ranks skip step 2 and load step 1, bitwise. Then step 3 is saved to
    memory only, rank 1's in another round: the ranks' snapshots of it come from two saves, and the load
    takes step 2 from storage instead of mixing them."""
    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    ranks = run_ranks(host, 2, "corrupt", f"--storage={store}", f"--empty-shm={empty}")
    expected = {
        "bad-size": r"saved a torch.float32 tensor of size \[\d+(, \d+)*\], another a",
        "lost-chunk": r"its chunks hold \d+ of its \d+ elements",
        "not-dcp": r"rank 1: it was not saved by phalanx.checkpoint.dcp.FlashWriter",
    }
    for r in ranks:
        for name, pattern in expected.items():
            got = r[name]
            assert got.get("error") == "CheckpointException", (name, got)
            assert re.search(pattern, got["message"]), (name, got["message"])
            assert got["seconds"] < 30, (name, got)
        assert r["flipped-data"] == {"step": 1, "source": "storage", "same": True}, r
        assert r["mixed-saves"] == {"step": 2, "source": "storage", "same": True}, r


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replaced_node_s_hsdp_ranks_receive_their_shards_from_the_other_replicas_memory(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    """4 HSDP ranks (2 replica groups of 2 shards) save to memory only, never persisting. When the node of
    ranks 2 and 3 is replaced (their memory empty), no step is held by every rank, and storage holds none:
    ranks 0 and 1 load from their memory and send ranks 2 and 3 the shards and values they need, bitwise.
    When both replicas of shard 1 are lost, no step is whole: nothing is loaded, on every rank, promptly."""
    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    ranks = run_ranks(host, 4, "hsdp", f"--storage={store}", f"--empty-shm={empty}")
    replaced = [r["node-replaced"] for r in ranks]
    assert [(r["step"], r["source"], r["same"], r["progress"]) for r in replaced] == [
        (2, "memory", True, True), (2, "memory", True, True), (2, "peer", True, True), (2, "peer", True, True)
    ], replaced  # fmt: skip
    assert [r["foreign"] for r in replaced[:2]] == [{}, {}], replaced
    for r in replaced[2:]:
        assert r["foreign"], r
        assert set(r["foreign"].items()) <= {("0", "peer"), ("1", "peer")}, r
    assert all(r["seconds"] < 30 for r in replaced), replaced
    assert [r["shard-lost"]["step"] for r in ranks] == [None] * 4, ranks
    assert all(r["shard-lost"]["seconds"] < 30 for r in ranks), ranks
    assert storage_lib.committed_steps(storage_lib.open_storage(str(store))) == []


# ---------------------------------------------------------------------------------------------------
# The ranks' script


def _model(*, seed: int, shard: bool, replicas: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The test's model; with ``shard``, FSDP2 over every rank, or with ``replicas`` HSDP: that many replica
    groups, each sharding the model over its ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if shard:
        world = dist.get_world_size()
        mesh = (
            init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
            if replicas > 1
            else init_device_mesh("cpu", (world,))
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))
    return {"model": model_sd, "optim": optim_sd, "progress": {"step": -1, "note": (), "flags": []}}


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer, *, full: bool = False) -> str:
    """sha256 of the model's and optimizer's state: this rank's shards, or with ``full`` whole tensors."""
    h = hashlib.sha256()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key], f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(f"{path}:{local.dtype}:{list(local.shape)}".encode())
            h.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={value!r}".encode())

    state = _state(model, opt, full=full)
    walk({"model": state["model"], "optim": state["optim"]}, "")
    return h.hexdigest()


def _load_into_fresh(reader: FlashReader, expected: str, *, replicas: int = 1) -> dict[str, Any]:
    """Loads into a model built and trained otherwise; what came back, and whether it is ``expected``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _model(seed=1, shard=True, replicas=replicas)
    _train(model, opt, 7)
    state = _state(model, opt)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {
        "step": reader.step,
        "source": reader.source,
        "foreign": reader.foreign,
        "reads": reader.last_load.get("storage_reads"),
        "same": _digest(model, opt) == expected,
        "progress": state["progress"] == PROGRESS,
    }


def fsdp(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Saves steps 1 (dcp.save) and 2 (dcp.async_save), persisted; then loads them back from memory and
    from storage (a Checkpointer looking at an empty shared-memory root)."""
    import torch.distributed as dist

    model, opt = _model(seed=0, shard=True)
    _train(model, opt, 1)
    dcp.save(
        {**_state(model, opt), "progress": {**PROGRESS, "step": 1}},
        storage_writer=FlashWriter(step=1, persist=True),
    )
    _train(model, opt, 2)
    group = dist.new_group(backend="gloo")  # async_save's collectives run beside the training thread's
    started = time.perf_counter()
    pending = dcp.async_save(
        {**_state(model, opt), "progress": PROGRESS},
        storage_writer=FlashWriter(step=2, persist=True),
        process_group=group,
    )
    blocking = time.perf_counter() - started
    pending.result()  # type: ignore[union-attr]
    checkpointer().wait()
    result: dict[str, Any] = {"async_blocking_s": blocking, "whole": _digest(model, opt, full=True)}
    expected = _digest(model, opt)
    result["memory"] = _load_into_fresh(FlashReader(), expected)
    new_node = Checkpointer(storage=args.storage, shm_dir=args.empty_shm)
    result["storage"] = _load_into_fresh(FlashReader(checkpointer=new_node), expected)
    new_node.close()
    dist.barrier()
    close()
    return result


def hsdp(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """4 ranks, HSDP (2 replica groups of 2 shards: ranks 0 and 1, ranks 2 and 3), save steps 1 and 2 to
    memory only. Then they load twice, some ranks as a new node without memory would (a Checkpointer looking
    at an empty shared-memory root): ranks 2 and 3 (a replaced node); then ranks 1 and 3 (both replicas of
    shard 1)."""
    model, opt = _model(seed=0, shard=True, replicas=2)
    _train(model, opt, 1)
    dcp.save({**_state(model, opt), "progress": {**PROGRESS, "step": 1}}, storage_writer=FlashWriter(step=1))
    _train(model, opt, 2)
    dcp.save({**_state(model, opt), "progress": PROGRESS}, storage_writer=FlashWriter(step=2))
    checkpointer().wait()
    expected = _digest(model, opt)
    result: dict[str, Any] = {}
    for name, lost in (("node-replaced", {2, 3}), ("shard-lost", {1, 3})):
        new_node = Checkpointer(storage=args.storage, shm_dir=args.empty_shm) if rank in lost else None
        reader = FlashReader(checkpointer=new_node)
        started = time.perf_counter()
        if reader.locate() is None:
            result[name] = {"step": None}
        else:
            result[name] = _load_into_fresh(reader, expected, replicas=2)
        result[name]["seconds"] = time.perf_counter() - started
        if new_node is not None:
            new_node.close()
    close()
    return result


def whole(args: argparse.Namespace) -> dict[str, Any]:
    """A world of one loads what 2 FSDP2 ranks saved into a plain model, once per ``--load STORAGE:SHM_DIR``
    (empty: none, this node's memory): the digest of its whole state, or the error. Run by :func:`main`
    before this process joins its world, as rank 0 of a world of one."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    loads = []
    for spec in args.load:
        location, shm_dir = spec.split(":")
        model, opt = _model(seed=1, shard=False)
        _train(model, opt, 7)
        ckpt = Checkpointer(storage=location, shm_dir=shm_dir or None)
        reader = FlashReader(checkpointer=ckpt)
        state = _state(model, opt)
        try:
            dcp.load(state, storage_reader=reader)
        except CheckpointException as exc:
            loads.append({"error": type(exc).__name__, "message": str(exc)})
            continue
        finally:
            ckpt.close()
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loads.append(
            {
                "step": reader.step,
                "source": reader.source,
                "foreign": {str(rank): where for rank, where in reader.foreign.items()},
                "whole": _digest(model, opt, full=True),
            }
        )
    return {"loads": loads}


def reshard(args: argparse.Namespace) -> dict[str, Any]:
    """This world's FSDP2 ranks load what another world saved: the digest of the whole state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _model(seed=1, shard=True)
    _train(model, opt, 7)
    state = _state(model, opt)
    reader = FlashReader()
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result = {
        "step": reader.step,
        "source": reader.source,
        "foreign": {str(rank): where for rank, where in reader.foreign.items()},
        "whole": _digest(model, opt, full=True),
    }
    close()
    return result


def _skeleton_get(node: dict[str, Any], key: str) -> Any:
    """The value under ``key`` of a dict in a codec skeleton (``{"D": [[key node, value node], ...]}``)."""
    ((_, pairs),) = node.items()
    return next(value for k, value in pairs if k == {"v": key})


def _damage(store: str, change: str) -> str:
    """Damages rank 1's snapshot of step 2 on storage; returns what to put back."""
    if change == "flipped-data":
        path = Path(store) / storage_lib.shard_file(2, 1)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        original = path.read_bytes()
        path.write_bytes(bytes(data))
        return original.hex()
    path = Path(store) / storage_lib.manifest_file(2, 1)
    original = path.read_text()
    manifest = json.loads(original)
    skeleton = manifest["meta"]["skeleton"]
    chunks = _skeleton_get(skeleton, "tensors")["L"]
    if change == "bad-size":
        _skeleton_get(chunks[0], "size")["L"][0]["v"] += 1
    elif change == "lost-chunk":
        chunks.pop()
    elif change == "not-dcp":
        _skeleton_get(skeleton, "format")["v"] = "something-else/1"
    path.write_text(json.dumps(manifest))
    return original


def _undamage(store: str, change: str, original: str) -> None:
    if change == "flipped-data":
        (Path(store) / storage_lib.shard_file(2, 1)).write_bytes(bytes.fromhex(original))
    else:
        (Path(store) / storage_lib.manifest_file(2, 1)).write_text(original)


def corrupt(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """See :func:`test_corrupt_metadata_or_a_missing_chunk_fails_every_rank_clearly`."""
    import torch.distributed as dist

    model, opt = _model(seed=0, shard=True)
    digests = {}
    for step in (1, 2):
        _train(model, opt, step)
        dcp.save(
            {**_state(model, opt), "progress": PROGRESS}, storage_writer=FlashWriter(step=step, persist=True)
        )
        digests[step] = _digest(model, opt)
    checkpointer().wait()
    close()
    dist.barrier()  # every rank's shards are persisted: the steps are committed
    result: dict[str, Any] = {}
    for change in ("bad-size", "lost-chunk", "not-dcp", "flipped-data"):
        original = _damage(args.storage, change) if rank == 0 else ""
        dist.barrier()
        new_node = Checkpointer(storage=args.storage, shm_dir=args.empty_shm)
        started = time.monotonic()
        try:
            reader = FlashReader(checkpointer=new_node)
            got = _load_into_fresh(reader, digests[1])
            result[change] = {k: got[k] for k in ("step", "source", "same")}
        except CheckpointException as exc:
            result[change] = {"error": type(exc).__name__, "message": str(exc)}
        result[change]["seconds"] = time.monotonic() - started
        if change == "flipped-data":
            del result[change]["seconds"]
        new_node.close()
        dist.barrier()
        if rank == 0:
            _undamage(args.storage, change, original)
        dist.barrier()
    # Step 3 in memory only, rank 1's saved in another round (as when a rank killed while it copied a step
    # keeps that step of an earlier round): never mixed, the load falls back to storage's newest step.
    _train(model, opt, 3)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    dcp.save({**_state(model, opt), "progress": PROGRESS}, storage_writer=FlashWriter(step=3))
    got = _load_into_fresh(FlashReader(), digests[2])
    result["mixed-saves"] = {k: got[k] for k in ("step", "source", "same")}
    close()
    return result


def _as_a_world_of_one(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`whole`, in a process group of this process alone and with the environment of a world of one
    (which the Checkpointer reads), both undone after."""
    import torch.distributed as dist

    world = {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return whole(args)
    finally:
        dist.destroy_process_group()
        os.environ.update(world)


def main() -> int:
    """``fsdp``, ``reshard``, ``corrupt`` or ``hsdp`` (see the functions of those names); with ``--load``,
    rank 0 first loads as a world of one (:func:`whole`). Prints one JSON line."""
    import warnings

    import torch.distributed as dist

    from phalanx.checkpoint import CheckpointWarning

    warnings.simplefilter("ignore", CheckpointWarning)  # the skipped step is what the test looks at
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fsdp", "reshard", "corrupt", "hsdp"])
    parser.add_argument("--storage", default="")
    parser.add_argument("--empty-shm", default="")
    parser.add_argument("--load", action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    loads = _as_a_world_of_one(args) if args.load and os.environ["RANK"] == "0" else {}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.mode == "fsdp":
        result = fsdp(args, rank)
    elif args.mode == "reshard":
        result = reshard(args)
    elif args.mode == "hsdp":
        result = hsdp(args, rank)
    else:
        result = corrupt(args, rank)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, **loads, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
