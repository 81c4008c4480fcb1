"""The root cause, not its echo, end to end: `phalanx local` runs a real gloo script, one rank gets SIGKILL
mid-training, and its peers fail next with gloo's "Connection closed by peer". The restart event, the
failure report of the node and the master's recorded root cause must name the SIGKILL."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from phalanx.diagnostics.classify import ECHO
from tests.agent.helpers import phalanx_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).with_name("gloo_allreduce.py")
ECHO_FIRST = Path(__file__).with_name("echo_first.py")
BASE = ["--agent-arg=--no-warm-spares", "--agent-arg=--grace-period=1s", "--timeout", "100s"]


def run(tmp: Path, *args: str, steps: int, script: Path = SCRIPT) -> tuple[str, dict[str, Any]]:
    """Runs the job; returns its output and the master's saved state (which holds the root cause)."""
    proc = phalanx_local(
        [*BASE, "--workdir", str(tmp / "wd"), *args, "--", str(script), str(steps)], cwd=tmp, timeout=110
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    state = json.loads((tmp / "wd" / "master-state.json").read_text())
    return out, state


def events(out: str, kind: str) -> list[str]:
    """The messages of the master's events of ``kind`` as `phalanx local` prints them."""
    return [m.group(1) for m in re.finditer(rf"event {kind}\s+(.*)$", out, re.MULTILINE)]


def test_a_sigkilled_rank_is_the_cause_of_its_peers_gloo_errors(tmp_path: Path) -> None:
    # One node, two ranks: rank 1 is SIGKILLed, rank 0 fails next in its all-reduce (the `make demo` case).
    out, state = run(
        tmp_path,
        "--nodes",
        "1",
        "--nproc-per-node",
        "2",
        "--inject",
        "kill-worker@step=3,node=0,rank=1",
        steps=8,
    )
    # Rank 0 did fail on the kill (gloo's "Connection closed/reset by peer" in its error file).
    assert any(ECHO.search(f.read_text()) for f in (tmp_path / "wd").rglob("error.json")), out[-6000:]
    (restart,) = events(out, "restart")
    assert restart.startswith("node-0   worker failure: rank 1 on node-0 SIGKILLed at "), restart
    (failure,) = events(out, "failure")
    assert failure.startswith("node-0   rank 1 on node-0 (killed)"), failure
    root = state["root_cause"]
    assert (root["node_id"], root["rank"], root["failure_class"], root["exit_code"]) == (
        "node-0",
        1,
        "killed",
        -9,
    )


def test_the_kill_revises_the_cause_when_the_echo_reaches_the_master_first(tmp_path: Path) -> None:
    # Two nodes, one rank each; node-1's link to the master goes silent just before its rank is killed and
    # heals 6 s later, so node-0's report of its gloo error arrives first and the restart goes by it.
    # node-1's report then revises the recorded cause, once, without a second restart.
    out, state = run(
        tmp_path,
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--heartbeat-timeout",
        "10s",
        "--inject",
        "partition-node@step=2,node=1,for=6s",
        "--inject",
        "kill-worker@step=4,node=1,rank=0",
        steps=8,
    )
    (restart,) = events(out, "restart")
    assert restart.startswith("node-0   worker failure: rank "), restart
    assert " on node-0 lost its peers first: " in restart, restart
    (revised,) = events(out, "root_cause")
    assert re.match(
        r"node-1   revised: rank \d on node-1 SIGKILLed at .*; rank \d lost its peer after it$", revised
    )
    root = state["root_cause"]
    assert (root["node_id"], root["failure_class"], root["exit_code"]) == ("node-1", "killed", -9)
    assert root["explanation"] == revised.removeprefix("node-1   revised: ")


def test_the_node_reports_a_kill_with_the_echo_that_exited_before_it(tmp_path: Path) -> None:
    # Local rank 0 raises gloo's peer-lost error and exits; local rank 1 is SIGKILLed 0.3 s later. The agent
    # waits for it (an echo is a failure's echo) instead of stopping it, so one report carries both.
    out, state = run(tmp_path, "--nodes", "1", "--nproc-per-node", "2", steps=0, script=ECHO_FIRST)
    agent = (tmp_path / "wd" / "node-0.log").read_text()
    assert re.search(
        r"worker failure: rank (0 exit 1, rank 1 exit -9|1 exit -9, rank 0 exit 1)$", agent, re.M
    )
    (restart,) = events(out, "restart")
    assert restart.startswith("node-0   worker failure: rank 1 on node-0 SIGKILLed at "), restart
    assert restart.endswith("; rank 0 lost its peer after it"), restart
    assert (state["root_cause"]["rank"], state["root_cause"]["exit_code"]) == (1, -9)
