"""Which node a hang counts against (``hang.blame``): the node the evidence singles out, or none (pure); and
the evidence as the agent reads it from a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from phalanx.agent import workers
from phalanx.diagnostics import hang, rootcause
from tests.eventually import eventually

TWO = ["node-0", "node-1"]


def test_a_stopped_rank_singles_out_its_node_whoever_reported() -> None:
    states = {"node-0": {0: "S"}, "node-1": {1: "T"}}
    assert hang.stopped_ranks(states) == {"node-1": [1]}
    found = hang.blame(members=TWO, stopped=hang.stopped_ranks(states))
    assert found.node == "node-1"
    assert "rank(s) 1 on node-1 stopped" in found.why
    # A tracer's stop ("t") holds the rank up as well; sleeping, running and I/O states do not.
    assert hang.stopped_ranks({"a": {0: "t", 1: "D"}, "b": {2: "R", 3: "S", 4: ""}}) == {"a": [0]}


def test_a_stopped_rank_outranks_the_suspects_and_the_stacks() -> None:
    found = hang.blame(members=TWO, stopped={"node-1": [1]}, suspect_nodes=["node-0"], odd_nodes=["node-0"])
    assert found.node == "node-1"


def test_suspects_then_odd_stacks_when_no_rank_is_stopped() -> None:
    assert hang.blame(members=TWO, stopped={}, suspect_nodes=["node-1"], odd_nodes=["node-0"]).node == (
        "node-1"
    )
    assert hang.blame(members=TWO, stopped={}, odd_nodes=["node-0"]).node == "node-0"
    # Ranks stopped on two nodes single out neither: the next evidence decides.
    both = {"node-0": [0], "node-1": [1]}
    assert hang.blame(members=TWO, stopped=both, suspect_nodes=["node-1"]).node == "node-1"


def test_nobody_when_the_evidence_names_no_single_node() -> None:
    """The gap this closes: two nodes, no recorder, stacks that tie. Whoever reported first is not charged."""
    found = hang.blame(members=TWO, stopped={})
    assert found == hang.Blame(
        "", "no evidence singles out a node (no rank found stopped, no suspect, no odd stack)"
    )
    assert hang.blame(members=TWO, stopped={}, suspect_nodes=TWO, odd_nodes=TWO).node == ""
    several = hang.blame(members=[*TWO, "node-2"], stopped={"node-0": [0], "node-2": [2]})
    assert (several.node, "ranks stopped on node-0, node-2" in several.why) == ("", True)
    # A node that is not (or no longer) a member of the round is never charged.
    assert hang.blame(members=TWO, stopped={"node-7": [3]}).node == ""


def test_the_only_node_of_a_round_is_charged_on_evidence_only() -> None:
    """A round of one node: a slow teardown taken for a hang, or a deadlock in the script, is no evidence
    against the machine (a replacement would not fix it); its stopped rank is."""
    assert hang.blame(members=["node-0"], stopped={}).node == ""
    assert hang.blame(members=["node-0"], stopped={"node-0": [0]}).node == "node-0"


def test_the_agent_reads_a_stopped_worker_from_proc() -> None:
    """The evidence itself, from a real process: sleeping, then SIGSTOPped, then gone. Its command name holds
    ``) T `` so that a parser splitting at the first parenthesis would read a wrong state."""
    code = (
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b'w) T (x', 0, 0, 0); print(1, flush=True); "
        "time.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # named, and about to sleep
        eventually(lambda: workers.process_state(proc.pid) == "S", timeout=5, what="asleep")
        os.kill(proc.pid, signal.SIGSTOP)
        eventually(lambda: workers.process_state(proc.pid) == "T", timeout=5, what="stopped")
        assert hang.stopped_ranks({"node-1": {1: workers.process_state(proc.pid)}}) == {"node-1": [1]}
        os.kill(proc.pid, signal.SIGCONT)
        eventually(lambda: workers.process_state(proc.pid) == "S", timeout=5, what="resumed")
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert workers.process_state(proc.pid) == ""


def test_a_hung_rank_that_raised_on_its_peers_loss_is_an_echo_not_the_root_cause() -> None:
    """Seen in the real test: node-1's stopped rank was evicted at its report; node-0's agent, which found its
    own rank hung at the same moment, reported it with the error file the rank wrote once node-1's was killed
    (gloo's reset), dated in whole seconds, so before node-1's verdict. It is the echo, not the root cause."""

    class Rec:
        def __init__(self, node_id: str, rank: int, message: str, unix: float) -> None:
            self.node_id, self.rank, self.message, self.unix = node_id, rank, message, unix
            self.exit_code, self.failure_class = 0, "hang"

    stopped = Rec("node-1", 0, "rank 0 hung: no progress past step 20 for 2.1s (timeout 2.0s)", 35.4)
    reset = "RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error 127.0.0.1: Connection reset by peer"
    victim = Rec("node-0", 1, reset, 35.0)
    assert rootcause.tier("hang", reset) == 2
    assert rootcause.pick([stopped, victim]) is stopped
