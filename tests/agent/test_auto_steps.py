"""The steps phalanx-run's instrumentation takes from the optimizer (phalanx.instrument), in a real torch
process: a plain script's steps from its second optimizer step on, and nothing of ours beside the steps of a
script that reports its own, not even for the moment between its first optimizer step and its first report
(after a restart that moment showed step 0 beside the step the script resumed at)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.api import beacon
from tests import torch_forks

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import json, sys
from pathlib import Path
import torch
import phalanx
from phalanx import instrument
from phalanx.api import beacon
assert instrument.install()
reader = beacon.BeaconReader(Path(sys.argv[1]))
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
seen = []
for i in range(3):
    step()
    seen.append(reader.read().step)
    if sys.argv[2] == "reports":
        phalanx.report_step(249 + i)  # a resumed script's own numbering
        seen.append(reader.read().step)
print(json.dumps(seen))
"""


def _beacon_steps(tmp_path: Path, mode: str) -> list[int]:
    path = tmp_path / f"{mode}.beacon"
    beacon.create(path)
    env = {"PHALANX_BEACON_FILE": str(path), "PATH": "/usr/bin:/bin"}
    proc = torch_forks.popen(
        [sys.executable, "-c", SCRIPT, str(path), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return list(json.loads(out.strip().splitlines()[-1]))


def test_a_plain_script_is_seen_from_its_second_optimizer_step(tmp_path: Path) -> None:
    assert _beacon_steps(tmp_path, "plain") == [-1, 1, 2]


def test_a_script_that_reports_its_steps_never_shows_ours(tmp_path: Path) -> None:
    # After each optimizer step, then after the script's own report: never 0, 1 or 2 of our count.
    assert _beacon_steps(tmp_path, "reports") == [-1, 249, 249, 250, 250, 251]
