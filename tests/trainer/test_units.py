"""Pure pieces of the trainer: mesh layout, recovery planning, batch splitting, stage split, round file
watching, the checkpoint seam and the public surface. No processes, no sockets."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import phalanx.trainer
from phalanx.api import round as round_file
from phalanx.api.errors import CheckpointNotFoundError, ConfigError, RendezvousTimeoutError
from phalanx.trainer.checkpointing import FileCheckpoint, shard_key
from phalanx.trainer.elastic import checkpoint_action
from phalanx.trainer.engine import split_batch
from phalanx.trainer.membership import RoundSource
from phalanx.trainer.mesh import Coord, ParallelConfig, coord_of, group_ranks, rank_of
from phalanx.trainer.model import stage_layers
from phalanx.trainer.recovery import NO_STATE, Action, Row, decode, encode, plan_recovery
from phalanx.trainer.watchdog import RoundWatch


def test_mesh_layout_keeps_tensor_groups_consecutive_and_replicas_contiguous() -> None:
    config = ParallelConfig(tensor=2, pipeline=2)
    groups = group_ranks(config=config, world_size=8)
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pipeline"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        assert rank_of(coord_of(rank, config=config), config=config) == rank
    assert coord_of(6, config=config) == Coord(data=1, pipeline=1, tensor=0)


def test_data_degree_follows_world_size_and_rejects_partial_replicas() -> None:
    config = ParallelConfig(tensor=2, pipeline=2)
    assert config.data(12) == 3
    with pytest.raises(ConfigError, match="not a multiple"):
        config.data(6)
    with pytest.raises(ConfigError):
        ParallelConfig(tensor=0)


def test_plan_fresh_start_and_checkpoint_load() -> None:
    dp = ParallelConfig()
    fresh = [Row(step=NO_STATE)] * 3
    assert plan_recovery(fresh, config=dp).action is Action.CONTINUE
    with_ckpt = [Row(step=NO_STATE, checkpoints=(20, 15)), Row(step=NO_STATE, checkpoints=(25, 20))]
    plan = plan_recovery(with_ckpt, config=dp)
    assert (plan.action, plan.step) == (Action.LOAD, 20)


def test_plan_survivors_keep_state_and_joiner_receives_it() -> None:
    plan = plan_recovery([Row(step=40), Row(step=40)], config=ParallelConfig())
    assert (plan.action, plan.step) == (Action.CONTINUE, 40)
    plan = plan_recovery([Row(step=40), Row(step=40), Row(step=NO_STATE)], config=ParallelConfig())
    assert plan.action is Action.BROADCAST
    assert plan.receivers == frozenset({2})
    assert plan.sources == {0: 0}


def test_plan_survivor_that_missed_the_last_step_is_brought_forward() -> None:
    plan = plan_recovery([Row(step=40), Row(step=41)], config=ParallelConfig())
    assert (plan.action, plan.step, plan.receivers, plan.sources) == (Action.BROADCAST, 41, {0}, {0: 1})


def test_plan_loads_in_place_when_a_whole_shard_is_lost_and_restarts_without_a_checkpoint() -> None:
    # TP=2, PP=2, one replica: ranks 2 and 3 (stage 1) are fresh replacements.
    config = ParallelConfig(tensor=2, pipeline=2)
    rows = [Row(step=22, checkpoints=(20, 15)), Row(step=22, checkpoints=(20, 15))]
    rows += [Row(step=NO_STATE, checkpoints=(20, 15)), Row(step=NO_STATE, checkpoints=(15,))]
    plan = plan_recovery(rows, config=config)
    assert (plan.action, plan.step) == (Action.LOAD, 15)  # the newest step every rank can load
    assert (
        plan.reason
        == "no replica left of (pipeline 1, tensor 0), (pipeline 1, tensor 1); every rank loads step 15"
    )
    bare = [Row(step=22), Row(step=22), Row(step=NO_STATE), Row(step=NO_STATE)]
    plan = plan_recovery(bare, config=config)
    assert plan.action is Action.RESTART
    assert plan.reason.endswith("(pipeline 1, tensor 1), and no checkpoint to load")


def test_plan_loads_or_restarts_when_shards_disagree_on_the_step() -> None:
    rows = [Row(step=22, checkpoints=(20,)), Row(step=23, checkpoints=(20,))]
    assert plan_recovery(rows, config=ParallelConfig(tensor=2)).action is Action.LOAD
    rows = [Row(step=22), Row(step=23)]
    assert plan_recovery(rows, config=ParallelConfig(tensor=2)).action is Action.RESTART


def test_rows_round_trip_through_fixed_width_integers() -> None:
    row = Row(step=7, checkpoints=(9, 3, 5, 1, 2))
    encoded = encode(row)
    assert len(encoded) == 5
    assert decode(encoded) == Row(step=7, checkpoints=(9, 5, 3, 2))
    assert decode(encode(Row(step=NO_STATE))) == Row(step=NO_STATE)


def test_split_batch_weights_sum_to_one_for_any_data_degree() -> None:
    tokens = torch.arange(10 * 5).view(10, 5)
    for data in (1, 2, 3, 4):
        parts = [split_batch(tokens, data_rank=r, data_size=data, micro_batches=2) for r in range(data)]
        assert sum(mb.weight for p in parts for mb in p) == pytest.approx(1.0)
        rows = torch.cat([mb.inputs for p in parts for mb in p])
        assert torch.equal(rows, tokens[:, :-1])
    mb = split_batch(tokens, data_rank=0, data_size=1, micro_batches=1)[0]
    assert torch.equal(mb.targets, tokens[:, 1:])


def test_stage_layers_cover_every_layer_once() -> None:
    for layers, stages in ((4, 2), (5, 2), (7, 3), (2, 2)):
        got = [list(stage_layers(layers=layers, stages=stages, stage=s)) for s in range(stages)]
        assert [i for g in got for i in g] == list(range(layers))
    with pytest.raises(ConfigError):
        stage_layers(layers=1, stages=2, stage=0)


def _info(round_no: int, port: int) -> round_file.RoundInfo:
    return round_file.RoundInfo(
        round=round_no, group_rank=1, rank_offset=2, world_size=4, local_world_size=2,
        store_host="127.0.0.1", store_port=port,
    )  # fmt: skip


def test_round_source_notices_rewrites_and_waits_for_newer(tmp_path: Path) -> None:
    path = tmp_path / "round.json"
    source = RoundSource(path, local_rank=1)
    assert source.elastic
    assert source.current() is None
    round_file.write(path, _info(1, 1000))
    spec = source.current()
    assert spec is not None
    assert (spec.round, spec.rank, spec.world_size, spec.store_port) == (1, 3, 4, 1000)
    assert not source.changed()
    round_file.write(path, _info(2, 1001))
    assert source.changed()
    assert source.wait_newer(1, timeout_s=1).store_port == 1001
    with pytest.raises(RendezvousTimeoutError):
        source.wait_newer(2, timeout_s=0.05)


def test_round_watch_aborts_a_step_once_a_newer_round_is_written(tmp_path: Path) -> None:
    path = tmp_path / "round.json"
    round_file.write(path, _info(1, 1000))
    source = RoundSource(path, local_rank=1)
    spec = source.current()
    assert spec is not None
    aborted = threading.Event()
    watch = RoundWatch(changed=lambda: source.newer_than(spec.round), abort=aborted.set, poll_s=0.01)
    try:
        with watch:  # a step during which nothing changes
            round_file.write(path, _info(1, 1000))  # rewritten, same round: not a reason to abort
            time.sleep(0.1)  # a negative check: ten polls of the watch, none of which may abort
        assert not aborted.is_set()
        round_file.write(path, _info(2, 1001))
        time.sleep(0.1)  # a negative check: no watch runs between steps, so ten poll periods abort nothing
        assert not aborted.is_set()  # between steps the trainer's own loop notices the round
        with watch:  # a step stuck in a collective when the agent writes the new round
            assert aborted.wait(5)
        assert watch.aborted == 1
    finally:
        watch.close()
    assert source.changed()  # the watch never marks the round seen: the trainer's loop reads it


def test_file_checkpoint_round_trip_and_retention(tmp_path: Path) -> None:
    store = FileCheckpoint(tmp_path, keep=2)
    key = shard_key(pipeline=1, tensor=0)
    for step in (5, 10, 15):
        store.save(step=step, key=key, tensors={"w": torch.full((2,), float(step))})
    assert store.steps(key=key) == [15, 10]
    assert torch.equal(store.load(step=10, key=key)["w"], torch.full((2,), 10.0))
    with pytest.raises(CheckpointNotFoundError):
        store.load(step=5, key=key)
    assert store.steps(key="pp9-tp9") == []


def test_public_surface_is_what_all_says() -> None:
    for name in phalanx.trainer.__all__:
        assert hasattr(phalanx.trainer, name), name
    public = {n for n in vars(phalanx.trainer) if not n.startswith("_")}
    modules = {"checkpointing", "comm", "data_parallel", "elastic", "engine", "flash", "layers", "membership",
               "mesh", "model", "optim", "pipeline", "recovery", "watchdog", "annotations"}  # fmt: skip
    assert public - modules == set(phalanx.trainer.__all__)


def test_adamw_matches_torch_adamw() -> None:
    from phalanx.trainer.optim import AdamW

    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt_ours = AdamW([ours], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    opt_theirs = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(5, 3, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert opt_ours.steps.item() == 5


def test_checkpoint_memory_is_readied_after_the_first_step_that_does_not_save() -> None:
    actions = []
    prepared = False
    for step in range(1, 11):
        action = checkpoint_action(step=step, every=4, prepared=prepared)
        prepared = prepared or bool(action)
        actions.append(action)
    assert actions == ["prepare", "", "", "save", "", "", "", "save", "", ""]
    assert checkpoint_action(step=1, every=1, prepared=False) == "save"  # saving every step: no prepare
    assert checkpoint_action(step=3, every=0, prepared=False) == ""  # checkpointing off
