"""One rank of the pipeline-recording test: a two-stage phalanx trainer pipeline (1F1B, two micro-batches)
with the interval recorder on. After one full step, stage 0 stalls before the next one (a host-side stall,
as a data loader that hangs would cause): stage 1 enters its receive and waits. Stage 0 then reads both
ranks' rings while stage 1 is really blocked in the other process, prints what a hang verdict and the
master's suspect rule make of them, and resumes so that both ranks finish."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
import phalanx.intervals
from phalanx.api import intervals as ring
from phalanx.api.interval_tracker import Tracker
from phalanx.api.settings import HangSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.trainer.engine import Engine
from phalanx.trainer.mesh import Mesh, ParallelConfig
from phalanx.trainer.model import GPTConfig

STALL_S = 1.5


def activity(path: Path) -> pb.RankActivity:
    tracker = Tracker()
    tracker.feed(ring.RingReader(path).read())
    return tracker.activity()


def main() -> None:
    dist.init_process_group("gloo")
    assert phalanx.intervals.enable() is not None
    rank = dist.get_rank()
    mesh = Mesh(ParallelConfig(pipeline=2), rank=rank, world_size=2)
    model = GPTConfig(layers=2, hidden=16, heads=2, vocab=16, seq_len=4)
    engine = Engine(model=model, mesh=mesh, seed=1, micro_batches=2)
    tokens = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    engine.forward_backward(tokens)
    phalanx.report_step(0)
    out: dict[str, object] = {"rank": rank}
    if rank == 0:
        time.sleep(STALL_S)  # stage 1 is in its first receive of step 1 by now
        template = os.environ["PHALANX_TEST_RING_TEMPLATE"]
        acts = {r: activity(Path(template + str(r))) for r in range(2)}
        waiting = acts[1]
        out["current"] = {"name": waiting.current.name, "group": waiting.current.group}
        out["entered"] = {r: dict(a.entered) for r, a in acts.items()}
        suspects = hang.find_suspects(acts)
        out["suspects"] = suspects.ranks if suspects else []
        out["suspects_text"] = suspects.describe() if suspects else ""
        history = hang.RankHistory(started_at=0.0, last_step=0, last_change_at=0.0)
        settings = HangSettings(floor_s=0.5, idle_floor_s=60.0, factor=1.0)
        verdict = hang.evidence_verdict(
            history,
            settings,
            now=STALL_S,
            activity=waiting,
            now_unix_ns=time.time_ns(),
        )
        out["verdict"] = hang.describe(1, verdict) if verdict.hung else ""
    engine.forward_backward(tokens)
    phalanx.report_step(1)
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
