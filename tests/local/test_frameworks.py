"""The frameworks people train with, unmodified, under `phalanx local` with default settings: an FSDP2
loop (tests/local/plain_ddp.py --wrap fsdp2) and a Hugging Face Trainer loop (tests/local/plain_trainer.py).
Neither imports phalanx. Each reports its steps (from its optimizer), and a SIGSTOPped rank is caught within
max(10 s, 3 x p99 step), blamed on its node, and training goes on to the end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.agent.helpers import STANDS_FOR_ANY_HANG, phalanx_local, steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]

HERE = Path(__file__).parent
TIMEOUT_S = 10.0  # max(10 s, 3 x p99 step): the default floor for these short steps
SCRIPTS = {
    "fsdp2": [str(HERE / "plain_ddp.py"), "--wrap", "fsdp2", "--steps", "60", "--step-time", "0.1"],
    "trainer": [str(HERE / "plain_trainer.py"), "--steps", "240", "--step-time", "0.05"],
}


@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_a_stopped_rank_of_an_unmodified_framework_loop_is_caught(framework: str, tmp_path: Path) -> None:
    summary, d = tmp_path / "summary.json", tmp_path / "d"
    proc = phalanx_local(
        [
            "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "2", "--nproc-per-node", "1",
            "--inject", "hang-worker@step=15,node=1,rank=0",
            STANDS_FOR_ANY_HANG,
            "--", *SCRIPTS[framework], "--dir", str(d),
        ],
        cwd=tmp_path,
        timeout=190,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert summary.exists(), out
    s = json.loads(summary.read_text())
    assert proc.returncode == 0, out
    assert s["exit"] == "succeeded", s
    assert s["steps_completed"] >= 15, s  # the optimizer's steps reached the launcher

    (f,) = s["failures"]
    assert f["kind"] == "hang-worker"
    assert f["detected_at"] is not None, out
    assert TIMEOUT_S - 0.5 < f["detected_at"] - f["injected_at"] < TIMEOUT_S + 5, f
    assert f["recovered_at"] is not None, s
    blamed = re.findall(r"event hang_analysis .*counted against (node-\d)", out)
    assert blamed, out
    assert blamed[0] == "node-1", out
    last = max(e["step"] for e in steps(d))
    assert last == int(SCRIPTS[framework][SCRIPTS[framework].index("--steps") + 1]) - 1, last
