"""State store, log store and the CLI's mapping of flags and environment onto MasterSettings."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from phalanx.api.errors import ConfigError, StateStoreError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.cli import main as cli_main
from phalanx.cli.master import build_settings, register
from phalanx.master.job import Job
from phalanx.master.serve.logstore import MAX_RINGS_PER_NODE, LogStore
from phalanx.master.store.stores import FileStateStore

from .sim import settings


def test_file_state_store_round_trip_atomic_and_private(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path / "sub" / "state.json")
    assert store.load() is None
    store.save({"job_id": "j", "round": {"number": 3}})
    store.save({"job_id": "j", "round": {"number": 4}})
    assert store.load() == {"job_id": "j", "round": {"number": 4}}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["state.json"]  # no temp file left behind
    assert stat.S_IMODE(os.stat(tmp_path / "sub" / "state.json").st_mode) == 0o600
    (tmp_path / "sub" / "state.json").write_text("{not json")
    with pytest.raises(StateStoreError, match="not valid JSON"):
        store.load()


def test_state_of_another_job_is_refused() -> None:
    saved = Job(settings=settings(), now=1.0).durable()
    saved["job_id"] = "other"
    with pytest.raises(StateStoreError, match="belongs to job 'other'"):
        Job(settings=settings(), now=2.0, saved=saved)
    with pytest.raises(StateStoreError, match="malformed"):
        Job(settings=settings(), now=2.0, saved={"job_id": "job"})


def test_log_store_rings_limits_and_file(tmp_path: Path) -> None:
    logs = LogStore(ring_lines=3, max_line_bytes=8, path=tmp_path / "job.log")
    lines = [pb.LogLine(rank=1, text=f"l{i}", unix_ns=(100 + i) * 10**9) for i in range(5)]
    lines.append(pb.LogLine(rank=1, text="forged\nERROR x", unix_ns=200 * 10**9, stream=pb.LOG_STREAM_STDERR))
    logs.add("n0", lines, dropped=2, now=0.0)
    logs.add("n1", [pb.LogLine(rank=0, text="ñ" * 10, unix_ns=150 * 10**9)], dropped=0, now=0.0)
    got = logs.tail(node="n0", rank=1, tail=10)
    assert [g.text for g in got] == ["l3", "l4", "forged\\x0aE"]  # ring of 3, cut to 8 bytes, escaped
    assert logs.tail(node="n1")[0].text == "ñ" * 4
    assert [g.node for g in logs.tail(tail=2)] == ["n1", "n0"]
    assert (logs.lines_total, logs.dropped_total) == (7, 2)
    logs.close()
    text = (tmp_path / "job.log").read_text()
    assert "n0 r1 out| l0" in text
    assert "2 lines dropped" in text
    assert len(text.splitlines()) == 8


def test_a_node_naming_any_rank_makes_a_bounded_number_of_rings() -> None:
    """The rank of a log line is the sender's word: a script with the job token naming a million ranks must
    not grow the master's memory with them. The node keeps its newest rings; other nodes lose nothing."""
    logs = LogStore(ring_lines=2, max_line_bytes=16, path=None)
    logs.add("n1", [pb.LogLine(rank=0, text="kept")], dropped=0, now=1.0)
    named = range(5 * MAX_RINGS_PER_NODE)
    for batch in range(0, len(named), 64):
        logs.add("n0", [pb.LogLine(rank=r, text="x") for r in named[batch : batch + 64]], dropped=0, now=1.0)
    ranks = {r for r in named if logs.tail(node="n0", rank=r)}
    assert len(ranks) == MAX_RINGS_PER_NODE
    assert min(ranks) == len(named) - MAX_RINGS_PER_NODE  # the newest rings stayed
    assert [line.text for line in logs.tail(node="n1")] == ["kept"]
    logs.add("n0", [pb.LogLine(rank=max(ranks), text="again")], dropped=0, now=2.0)  # an existing ring
    assert [line.text for line in logs.tail(node="n0", rank=max(ranks))] == ["x", "again"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["master", *argv])


def test_flags_and_environment_map_onto_settings() -> None:
    env = {
        "PHALANX_HEARTBEAT_TIMEOUT_S": "5s",
        "PHALANX_RESTART_MAX_RESTARTS": "9",
        "PHALANX_JOB_ID": "from-env",
    }
    args = parse(
        "--job-id", "j1", "--nodes", "2:4", "--unit", "2", "--max-restarts", "7", "--last-call", "500ms"
    )
    s = build_settings(args, env)
    assert s.job_id == "j1"  # the flag wins over the environment
    assert (s.rendezvous.min_nodes, s.rendezvous.max_nodes, s.rendezvous.unit) == (2, 4, 2)
    assert s.rendezvous.last_call_s == 0.5
    assert s.heartbeat.timeout_s == 5.0
    assert s.restart.max_restarts == 7
    assert s.state_path == ""
    s2 = build_settings(parse("--heartbeat-timeout", "2", "--heartbeat-interval", "1", "--state", "/x"), env)
    assert (s2.job_id, s2.heartbeat.timeout_s, s2.state_path, s2.restart.max_restarts) == (
        "from-env",
        2.0,
        "/x",
        9,
    )
    with pytest.raises(ConfigError, match="timeout_s"):
        build_settings(parse("--job-id", "j", "--heartbeat-timeout", "1"), {})
    with pytest.raises(ConfigError, match="nodes"):
        build_settings(parse("--job-id", "j", "--nodes", "3:1"), {})


def test_cli_refuses_to_start_without_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(["master", "--job-id", "j1"]) == 1
    assert "token" in capsys.readouterr().err
    (tmp_path / "t").write_text("two words")
    assert cli_main.main(["master", "--job-id", "j1", "--token-file", str(tmp_path / "t")]) == 1


def test_a_short_token_is_refused_naming_the_setting_never_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "t").write_text("fifteen-chars-x\n")  # 15 characters: one short of the minimum
    assert cli_main.main(["master", "--job-id", "j1", "--token-file", str(tmp_path / "t")]) == 1
    err = capsys.readouterr().err
    assert "token_file: " in err
    assert "at least 16 characters" in err
    assert "fifteen-chars-x" not in err
    (tmp_path / "m").write_text("short-metrics")
    (tmp_path / "t").write_text("sixteen-chars-ok")
    argv = ["master", "--job-id", "j1", "--token-file", str(tmp_path / "t")]
    assert cli_main.main([*argv, "--metrics-token-file", str(tmp_path / "m")]) == 1
    assert "metrics_token_file" in capsys.readouterr().err


def test_run_master_itself_refuses_a_short_token() -> None:
    import asyncio

    from phalanx.api.settings import MasterSettings
    from phalanx.master.serve.server import run_master
    from phalanx.master.store.stores import MemoryStateStore, NullStatusSink

    with pytest.raises(ConfigError, match=r"^token_file: .*at least 16"):
        asyncio.run(
            run_master(
                MasterSettings(job_id="j"), token="short", store=MemoryStateStore(), sink=NullStatusSink()
            )
        )


def test_the_job_log_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        logs = LogStore(ring_lines=3, max_line_bytes=80, path=tmp_path / "logs" / "job.log")
        logs.add("n0", [pb.LogLine(rank=0, text="secret data")], dropped=0, now=1.0)
        logs.close()
        older = tmp_path / "older.log"  # left world-readable by an older version
        older.write_text("x\n")
        older.chmod(0o644)
        again = LogStore(ring_lines=3, max_line_bytes=80, path=older)
        again.add("n0", [pb.LogLine(rank=0, text="more")], dropped=0, now=1.0)
        again.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "logs").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "logs" / "job.log").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(older).st_mode) == 0o600
    assert older.read_text().endswith("r0 out| more\n")
