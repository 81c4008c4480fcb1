"""A real ``phalanx master`` SIGKILLed while a restart event waits for its root cause and the recovery is in
progress, restarted from its state file: the restart event is there once, and the recovery completes with
the phases of the whole recovery, the dead master's share included."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.master.state.snapshot import EVENT_SEQ_GAP

from .procs import Agent, Master
from .test_master_process import FAST, form_round

pytestmark = pytest.mark.integration


def _saved(state: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(state.read_text()))
    except (OSError, ValueError):  # not written yet
        return {}


def _recovery_metrics(master: Master) -> dict[str, float]:
    text = master.client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "phalanx_recoveries_total":
                out["total"] = s.value
            elif s.name == "phalanx_recovery_last_phase_seconds":
                out[s.labels["phase"]] = s.value
    return out


@pytest.mark.timeout(60)
def test_a_master_killed_with_a_pending_restart_mid_recovery_emits_it_once_and_finishes_the_recovery(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    first = Master(tmp_path, *FAST, state=state)
    a, b = Agent(first, "node-a"), Agent(first, "node-b")
    a.register()
    b.register()
    form_round(a, b)
    a.heartbeat(step=20)
    b.heartbeat(step=20)
    a.fail(rank=0, message="RuntimeError: boom")  # b never reports: the event waits rootcause.SETTLE_S
    failed_by = time.time()
    deadline = time.monotonic() + 1.5
    while not _saved(state).get("pending_restart"):
        assert time.monotonic() < deadline, f"the pending restart was never saved: {_saved(state)}"
        time.sleep(0.02)
    os.kill(first.proc.pid, signal.SIGSTOP)  # frozen: it cannot emit the event between this look and the kill
    saved = _saved(state)
    assert saved["pending_restart"]["node"] == "node-a", "the settling window passed before the kill"
    assert saved["recovery"]["current"]["reformed"] == 0
    ports = first.ports
    first.stop(signal.SIGKILL)

    second = Master(tmp_path, *FAST, state=state, ports=ports)
    try:
        up_at = time.time()
        events = second.events()
        restarts = [e for e in events if e["kind"] == "restart"]
        assert [(e["node"], e["rank"], e["round"]) for e in restarts] == [("node-a", 0, 1)]
        assert restarts[0]["unix"] <= failed_by
        assert restarts[0]["seq"] >= saved["event_seq"] + EVENT_SEQ_GAP
        kinds = [e["kind"] for e in events]
        assert kinds.index("restart") < kinds.index("master_resumed")
        # Saved again at once (well within the heartbeat timeout, after which a lost node would be the
        # next change): a master killed now would not emit it a second time.
        deadline = time.monotonic() + 2
        while _saved(state).get("pending_restart") is not None:
            assert time.monotonic() < deadline, "the resumed master never saved its state"
            time.sleep(0.05)

        a2 = Agent(second, "node-a", incarnation=a.incarnation)
        b2 = Agent(second, "node-b", incarnation=b.incarnation)
        a2.round = b2.round = 1
        ga, _ = form_round(a2, b2)
        assert ga.round == 2
        a2.heartbeat(step=16)  # restored from step 15
        time.sleep(0.2)
        b2.heartbeat(step=20)  # back where training was before the failure
        got = _recovery_metrics(second)
        assert got["total"] == 1
        assert 0 <= got["detect"] < 2.0
        # The recovery began in the dead master: its re-forming spans the kill and the restart.
        assert got["reform"] >= up_at - failed_by
        assert got["restore"] > 0
        assert got["recompute"] >= 0.2
        assert len([e for e in second.events() if e["kind"] == "restart"]) == 1
        assert second.job()["restart_count"] == 1
    finally:
        second.stop(signal.SIGKILL)
