"""torch.distributed.checkpoint through the flash checkpoint, under the real agent: `phalanx local` runs
examples/dcp_train.py (FSDP2 on CPU over gloo, ``dcp.save`` with ``FlashWriter`` every step), one worker is
SIGKILLed, and the restarted ranks restore the newest step every rank holds from the node's shared memory,
bitwise, without reading storage; the job then ends in the state of a run that never failed: the script's
last incarnation trains a fresh model through every step in one go, without checkpoints, and logs what it
ends with (the batches depend on the step only), so no second, fault-free job is needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phalanx.checkpoint import shm
from tests.agent.helpers import ROOT, phalanx_local

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "dcp_train.py"
STEPS = 16
KILL_AT = 6  # 9 steps of 0.05 s or more after it, while phalanx local looks at the steps every 0.05 s


def _run(tmp: Path, name: str, *faults: str) -> tuple[dict[str, Any], dict[int, list[dict[str, Any]]]]:
    """One run of the example on one node of 2 ranks; its summary and each rank's digest log (with the
    digest of an unbroken run's final state)."""
    digests = tmp / f"{name}-digests"
    digests.mkdir()
    summary = tmp / f"{name}-summary.json"
    proc = phalanx_local(
        [
            "--nodes", "1", "--nproc-per-node", "2", "--workdir", str(tmp / name), "--timeout", "150s",
            "--summary-json", str(summary), f"--agent-arg=--checkpoint-dir={tmp / f'{name}-ckpt'}", *faults,
            "--", str(EXAMPLE), "--steps", str(STEPS), "--persist-every", "0", "--step-time", "0.05",
            "--digest-dir", str(digests), "--unbroken-digest",
        ],
        cwd=tmp,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    logs = {
        rank: [json.loads(line) for line in (digests / f"rank{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }
    return json.loads(summary.read_text()), logs


def _job_leftovers(job_id: str) -> list[Path]:
    private = shm.private_dir(Path("/dev/shm"))
    return [p for p in private.iterdir() if job_id in p.name] if private.is_dir() else []


def test_restarted_fsdp2_ranks_restore_the_newest_step_from_memory_bitwise(tmp_path: Path) -> None:
    summary, logs = _run(tmp_path, "faulty", "--inject", f"kill-worker@step={KILL_AT},node=0,rank=1")
    assert summary["exit"] == "succeeded", summary
    (fault,) = summary["failures"]
    assert (fault["kind"], fault["action"]) == ("kill-worker", "workers restarted (round 2)"), fault
    assert fault["steps_lost"] <= 1, fault  # the step in flight at most
    for rank, log in logs.items():
        (load,) = [e for e in log if "loaded" in e]
        assert (load["restart"], load["source"], load["storage_reads"]) == (1, "memory", 0), load
        # The kill lands once rank 1 reported step 6: every rank saved step 5, and maybe 6.
        assert load["loaded"] in (KILL_AT - 1, KILL_AT), load
        (saved,) = [e for e in log if e.get("step") == load["loaded"] and e["restart"] == 0]
        assert load["digest"] == saved["digest"], (rank, load, saved)  # restored bitwise
        after = [e["step"] for e in log if "step" in e and e["restart"] == 1]
        assert after == list(range(load["loaded"] + 1, STEPS)), (rank, after)
        (final,) = [e for e in log if e.get("step") == STEPS - 1]
        (unbroken,) = [e for e in log if "unbroken" in e]
        assert unbroken["restart"] == 1, unbroken  # the incarnation that resumed, at its end
        assert final["digest"] == unbroken["unbroken"], rank  # as if nothing had failed
    assert not _job_leftovers(summary["job_id"]), _job_leftovers(summary["job_id"])
