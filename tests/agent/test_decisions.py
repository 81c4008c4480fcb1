"""The supervisor's pure decisions, the error-file reader, the worker environment and the flag parser."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from phalanx.agent import config, decisions, env, errorfile
from phalanx.agent.client import backoff_s
from phalanx.agent.link import LogShipper
from phalanx.api.errors import ConfigError
from phalanx.api.round import RoundInfo
from phalanx.api.settings import LogSettings
from phalanx.api.v1 import master_pb2 as pb

Outcome = decisions.Outcome


def test_workers_outcome() -> None:
    assert decisions.workers_outcome({0: None, 1: None}) == (Outcome.RUNNING, [])
    assert decisions.workers_outcome({0: 0, 1: None}) == (Outcome.RUNNING, [])
    assert decisions.workers_outcome({0: 0, 1: 0}) == (Outcome.SUCCEEDED, [])
    assert decisions.workers_outcome({0: None, 1: -9}) == (Outcome.FAILED, [1])
    assert decisions.workers_outcome({0: 1, 1: 0, 2: -9}) == (Outcome.FAILED, [0, 2])


def test_rejoin_mode() -> None:
    regroup = decisions.RejoinMode.REGROUP
    restart = decisions.RejoinMode.RESTART
    assert decisions.rejoin_mode(own_failure=False, regroup_capable=True, workers_alive=True) is regroup
    assert decisions.rejoin_mode(own_failure=True, regroup_capable=True, workers_alive=True) is restart
    assert decisions.rejoin_mode(own_failure=False, regroup_capable=False, workers_alive=True) is restart
    assert decisions.rejoin_mode(own_failure=False, regroup_capable=True, workers_alive=False) is restart


def test_after_failure() -> None:
    rejoin = pb.Action(kind=pb.ACTION_KIND_REJOIN, round=4, reason="restart in place")
    assert decisions.after_failure(rejoin, restarts_used=0, max_restarts=3) == decisions.Next(
        "rejoin", round=4, reason="restart in place"
    )
    spent = decisions.after_failure(rejoin, restarts_used=3, max_restarts=3)
    assert spent.kind == "exit"
    assert spent.exit_code == 1
    assert "--max-restarts=3" in spent.reason
    out = decisions.after_failure(
        pb.Action(kind=pb.ACTION_KIND_EXIT, exit_code=3, reason="evicted"), restarts_used=0, max_restarts=3
    )
    assert out == decisions.Next("exit", exit_code=3, reason="evicted")
    failed = decisions.after_failure(
        pb.Action(kind=pb.ACTION_KIND_EXIT, round=2, exit_code=1, reason="job failed"),
        restarts_used=0,
        max_restarts=3,
    )
    assert failed == decisions.Next("exit", exit_code=1, reason="job failed", job_ended=True)
    assert (
        decisions.after_failure(pb.Action(kind=pb.ACTION_KIND_NONE), restarts_used=0, max_restarts=1).kind
        == "wait"
    )


def test_job_ended_is_an_exit_that_names_the_round_the_job_ended_in() -> None:
    assert decisions.job_ended(pb.Action(kind=pb.ACTION_KIND_EXIT, round=3, exit_code=1))
    assert not decisions.job_ended(pb.Action(kind=pb.ACTION_KIND_EXIT, exit_code=1, reason="evicted: hung"))
    assert not decisions.job_ended(pb.Action(kind=pb.ACTION_KIND_REJOIN, round=3))


def test_is_new_rejoin() -> None:
    assert decisions.is_new_rejoin(pb.Action(kind=pb.ACTION_KIND_REJOIN, round=5), current_round=4)
    assert not decisions.is_new_rejoin(pb.Action(kind=pb.ACTION_KIND_REJOIN, round=4), current_round=4)
    assert not decisions.is_new_rejoin(pb.Action(kind=pb.ACTION_KIND_EXIT, round=5), current_round=4)


def test_refill_due() -> None:
    assert not decisions.refill_due(spares=2, wanted=2, since_handover_s=100, workers_stepped=True)
    assert not decisions.refill_due(spares=0, wanted=2, since_handover_s=1, workers_stepped=False)
    assert decisions.refill_due(spares=0, wanted=2, since_handover_s=1, workers_stepped=True)
    assert decisions.refill_due(spares=1, wanted=2, since_handover_s=6, workers_stepped=False)


def test_backoff_grows_and_is_jittered() -> None:
    rng = random.Random(0)
    values = [backoff_s(a, rng=rng) for a in range(12)]
    assert all(0.1 <= v <= 5.0 for v in values)
    assert values[-1] > values[0]
    assert len(set(values)) == len(values)


def test_errorfile_parses_torch_elastic_format() -> None:
    text = json.dumps(
        {
            "message": {
                "message": "ValueError: bad batch",
                "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"},
            }
        }
    )
    report = errorfile.parse(text)
    assert report == errorfile.ErrorReport("ValueError: bad batch", "Traceback ...", 1_700_000_000 * 10**9)
    assert errorfile.parse("not json") is None
    assert errorfile.parse("[1]") is None
    assert errorfile.read(Path("/nonexistent/error.json")) is None


def test_worker_env_has_what_torchrun_sets(tmp_path: Path) -> None:
    info = RoundInfo(
        round=3,
        group_rank=1,
        rank_offset=2,
        world_size=6,
        local_world_size=2,
        store_host="10.0.0.1",
        store_port=29511,
        restart_count=2,
        members=["a", "b", "c"],
    )
    paths = env.WorkerPaths(
        beacon=tmp_path / "b",
        error_file=tmp_path / "e",
        stack_file=tmp_path / "s",
        regroup_file=tmp_path / "g",
        stdout_log=tmp_path / "o",
        stderr_log=tmp_path / "r",
    )
    static = env.static_env(
        {"PATH": "/bin", "PHALANX_TOKEN_FILE": "/secret"},
        local_rank=1,
        local_world_size=2,
        job_id="j",
        node_id="n",
    )
    assert static["OMP_NUM_THREADS"] == "1"
    assert "PHALANX_TOKEN_FILE" not in static
    assert (
        env.static_env({"OMP_NUM_THREADS": "4"}, local_rank=0, local_world_size=1, job_id="j", node_id="n")[
            "OMP_NUM_THREADS"
        ]
        == "4"
    )
    full = {
        **static,
        **env.round_env(
            info,
            local_rank=1,
            role="trainer",
            max_restarts=3,
            paths=paths,
            round_path=tmp_path / "round.json",
        ),
    }
    expected = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6",
        "ROLE_NAME": "trainer",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "j",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "e"),
        "PHALANX_BEACON_FILE": str(tmp_path / "b"),
        "PHALANX_ROUND_FILE": str(tmp_path / "round.json"),
        "PHALANX_REGROUP_FILE": str(tmp_path / "g"),
        "PHALANX_NODE_ID": "n",
        "PHALANX_JOB_ID": "j",
    }
    assert {k: full[k] for k in expected} == expected


def test_config_accepts_torchrun_flags() -> None:
    cfg = config.parse(
        [
            "--nnodes",
            "1:3",
            "--nproc_per_node",
            "2",
            "--max-restarts",
            "5",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "h:1",
            "--rdzv-id",
            "job1",
            "--node-rank",
            "0",
            "--master-port",
            "1234",
            "--tee",
            "3",
            "--redirects",
            "3",
            "--start-method",
            "spawn",
            "--role",
            "r",
            "--monitor-interval",
            "0.5",
            "train.py",
            "--lr",
            "0.1",
        ],
        {"PHALANX_TOKEN_FILE": "/t", "PHALANX_NODE_ID": "n7"},
    )
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.max_restarts) == (1, 3, 2, 5)
    assert (cfg.master_addr, cfg.job_id, cfg.node_id, cfg.token_file) == ("h:1", "job1", "n7", "/t")
    assert cfg.script == "train.py"
    assert cfg.script_args == ["--lr", "0.1"]
    assert cfg.monitor_interval_s == 0.5
    assert len(cfg.notes) == 2  # --node-rank and --master-port are ignored with a note
    mod = config.parse(["--standalone", "-m", "pkg.train", "x"], {})
    assert mod.module
    assert mod.standalone
    assert (mod.min_nodes, mod.max_nodes) == (1, 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["train.py"],
        ["--standalone", "--nnodes", "3:2", "t.py"],
        ["--standalone", "--nproc-per-node", "0", "t"],
    ],
)
def test_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        config.parse(argv, {})


def test_log_shipper_rate_limits_and_counts_drops() -> None:
    now = [0.0]
    shipper = LogShipper(LogSettings(max_lines_per_s=10, max_line_bytes=8), clock=lambda: now[0])
    for i in range(25):
        shipper.offer(rank=0, local_rank=0, stream=1, text=f"line {i} is long")
    batch, dropped = shipper.take()
    assert len(batch) == 10
    assert dropped == 15
    assert batch[0].text == "line 0 i"
    now[0] = 1.0
    shipper.offer(rank=0, local_rank=0, stream=1, text="later")
    assert [line.text for line in shipper.take()[0]] == ["later"]


class _ScriptedMaster:
    """Answers heartbeats from a script and records the acks they carried (pure logic: no socket)."""

    def __init__(self, answers: list[list[pb.Action]]) -> None:
        self.answers = answers
        self.acks: list[int] = []

    def heartbeat(self, req: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse:
        self.acks.append(req.acked_seq)
        return pb.HeartbeatResponse(actions=self.answers.pop(0), round=1)


def test_link_carries_out_each_one_shot_action_once_and_acknowledges_it() -> None:
    from phalanx.agent.link import Link

    dump = pb.Action(kind=pb.ACTION_KIND_DUMP_STACKS, round=1, seq=7)
    probe = pb.Action(kind=pb.ACTION_KIND_RUN_PROBE, round=1, seq=8)
    rejoin = pb.Action(kind=pb.ACTION_KIND_REJOIN, round=2)
    master = _ScriptedMaster([[dump], [dump, probe, rejoin], [rejoin], []])
    link = Link(
        client=master,  # type: ignore[arg-type]
        node_id="n",
        incarnation="i",
        interval_s=1.0,
        shipper=LogShipper(LogSettings()),
        reregister=lambda: None,
    )
    for _ in range(3):
        link.beat_now()
    queued = [link.actions.get_nowait() for _ in range(link.actions.qsize())]
    # The repeated DUMP_STACKS (our ack had not reached the master) is not carried out twice; REJOIN,
    # which has no seq, is passed on each time (the supervisor treats a repeat of a round as a no-op).
    assert [(a.kind, a.seq) for a in queued] == [
        (pb.ACTION_KIND_DUMP_STACKS, 7),
        (pb.ACTION_KIND_RUN_PROBE, 8),
        (pb.ACTION_KIND_REJOIN, 0),
        (pb.ACTION_KIND_REJOIN, 0),
    ]
    assert master.acks == [0, 7, 8]
    link.forget_acks()  # registered again with a master that lost its state: seqs start afresh
    link.beat_now()
    assert master.acks[-1] == 0


def test_a_leaving_link_says_so_and_does_not_register_again() -> None:
    import threading

    from phalanx.agent.client import UnknownNodeError
    from phalanx.agent.link import Link

    states: list[int] = []
    registered: list[str] = []
    held, release = threading.Event(), threading.Event()

    class Forgetting:
        """Holds the heartbeat thread's call; on the last heartbeat (LEAVING) it forgets the node, so the
        held call then ends in "not found", as it does when a suspended master forgets a leaving node."""

        def heartbeat(self, req: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse:
            states.append(req.state)
            if req.state == pb.NODE_STATE_LEAVING:
                return pb.HeartbeatResponse(round=1)
            held.set()
            release.wait(5)
            raise UnknownNodeError("not_found")

    link = Link(
        client=Forgetting(),  # type: ignore[arg-type]
        node_id="n",
        incarnation="i",
        interval_s=0.05,
        shipper=LogShipper(LogSettings()),
        reregister=lambda: registered.append("again"),
    )
    link.streaming = False  # the fake serves Heartbeat calls only, as a master without HeartbeatStream
    thread = threading.Thread(target=link.run, daemon=True)
    thread.start()
    assert held.wait(5)
    link.leave()
    release.set()
    thread.join(5)
    assert not thread.is_alive()
    assert pb.NODE_STATE_LEAVING in states
    assert registered == [], "a leaving agent registered again with the master that forgot it"


def test_heartbeat_slack_follows_the_slowest_recent_round_trip() -> None:
    from phalanx.agent.link import HEARTBEAT_TIMEOUT_S, MAX_HEARTBEAT_SLACK_S, heartbeat_slack

    assert heartbeat_slack([]) == HEARTBEAT_TIMEOUT_S
    assert heartbeat_slack([0.001, 0.002]) == HEARTBEAT_TIMEOUT_S  # a good network keeps the default
    assert heartbeat_slack([0.001, 2.4, 0.5]) == pytest.approx(7.2)  # 1.2 s each way
    assert heartbeat_slack([60.0]) == MAX_HEARTBEAT_SLACK_S


def test_client_deadlines_stretch_on_late_calls_and_shrink_on_fast_ones() -> None:
    import grpc

    from phalanx.agent.client import MAX_STRETCH, MasterClient, MasterUnavailableError

    class Late(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self) -> str:
            return "Deadline Exceeded"

    deadlines: list[float] = []

    def late(request: object, *, metadata: object, timeout: float) -> object:
        deadlines.append(timeout)
        raise Late()

    def fast(request: object, *, metadata: object, timeout: float) -> object:
        deadlines.append(timeout)
        return "answer"

    client = MasterClient(address="127.0.0.1:1", token="t")  # no call reaches the channel
    try:
        for _ in range(4):
            with pytest.raises(MasterUnavailableError):
                client._call(late, None, None, base=5.0)
        assert deadlines == [5.0, 10.0, 20.0, 20.0]
        assert client.stretch == MAX_STRETCH
        assert client._call(fast, None, 2.0, base=2.0) == "answer"  # an explicit deadline is left alone
        assert client.stretch == MAX_STRETCH
        for _ in range(3):
            client._call(fast, None, None, base=5.0)
        assert deadlines[-3:] == [20.0, 10.0, 5.0]
        assert client.stretch == 1.0
        with pytest.raises(MasterUnavailableError):
            client._call(late, None, 3.0, base=3.0)  # a caller's own deadline: its lateness is its business
        assert client.stretch == 1.0
    finally:
        client.close()


def test_every_agent_setting_is_read_from_its_variable_and_a_flag_wins() -> None:
    """One table (``AgentSettings``): its variables give what flags do not, and a flag wins."""
    env = {
        "PHALANX_MASTER_ADDR": "m:1",
        "PHALANX_NPROC_PER_NODE": "3",
        "PHALANX_MAX_RESTARTS": "2",
        "PHALANX_GRACE_PERIOD_S": "7s",
        "PHALANX_HANG_IDLE_FLOOR_S": "20s",
        "PHALANX_WARM_SPARES": "false",
    }

    def picked(cfg: config.AgentConfig) -> tuple[object, ...]:
        return (
            cfg.master_addr, cfg.nproc_per_node, cfg.max_restarts, cfg.grace_period_s, cfg.hang.idle_floor_s,
            cfg.warm_spares,
        )  # fmt: skip

    assert picked(config.parse(["t.py"], env)) == ("m:1", 3, 2, 7.0, 20.0, False)
    flags = ["--rdzv-endpoint", "o:2", "--nproc-per-node", "1", "--max-restarts", "0", "--grace-period", "1s"]
    assert picked(config.parse([*flags, "--hang-idle-floor", "5s", "t.py"], env)) == (
        "o:2",
        1,
        0,
        1.0,
        5.0,
        False,
    )
    assert picked(config.parse(["--standalone", "t.py"], {})) == ("", 1, 0, 5.0, 60.0, True)
    with pytest.raises(ConfigError, match="warm_spares: expected true or false"):
        config.parse(["t.py"], {**env, "PHALANX_WARM_SPARES": "maybe"})


def test_a_flags_help_is_its_settings_fields_doc() -> None:
    text = " ".join(config.build_parser().format_help().split())
    for name in ("master_addr", "grace_period_s", "hang.floor_s", "checkpoint.keep_last"):
        assert " ".join(config._doc(name).split()) in text, name
