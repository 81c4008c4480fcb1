"""Probes forked from the warm probe server: the real server process, real probes, real kills.

Every test marks its server with an environment variable, so it can check that nothing it started (the
server, a forked probe) outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from phalanx.agent.bootstrap import AGENT_PID_ENV_VAR
from phalanx.agent.zygote import Zygote
from phalanx.diagnostics.probe_runner import allgather_args, matmul_args, run_probe
from phalanx.diagnostics.warm_probes import SERVER, ServerProcess, WarmProbes
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``mark``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                environ = (proc / "environ").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if mark.encode() in environ and state != "Z":
                pids.append(int(proc.name))
    return pids


@pytest.fixture
def warm() -> Iterator[WarmProbes]:
    mark = f"PHALANX_TEST_MARK=warm-{uuid.uuid4().hex}"
    name, value = mark.split("=", 1)
    probes = WarmProbes(env={**os.environ, name: value})
    yield probes
    probes.close()
    eventually(lambda: not marked(mark), timeout=10, what="every process of the warm probes gone")


def lonely_allgather() -> list[str]:
    """Rank 1 of a group whose rank 0 never serves the store: it waits far longer than any timeout here."""
    return allgather_args(
        rank=1, node_ids=["a", "b"], store_host="127.0.0.1", store_port=9, seconds=1, timeout_s=120
    )


def test_probes_share_one_server_and_measure_as_cold_ones(warm: WarmProbes) -> None:
    assert warm.server_pid is None  # started at the first probe, not before
    first = warm.run(kind="matmul", args=matmul_args(seconds=0.3, size=256), timeout_s=60)
    server = warm.server_pid
    second = warm.run(kind="matmul", args=matmul_args(seconds=0.3, size=256), timeout_s=60)
    assert first is not None
    assert second is not None
    for [m] in (first, second):
        assert m.ok, m.error
        assert 1e-4 < m.rate < 100
    assert server is not None
    assert warm.server_pid == server  # the second probe was forked from the same server


def test_a_forked_probe_still_detects_a_wrong_result(warm: WarmProbes) -> None:
    measured = warm.run(
        kind="matmul", args=[*matmul_args(seconds=0.2, size=256), "--inject-error"], timeout_s=60
    )
    assert measured is not None
    [m] = measured
    assert not m.ok
    assert "silent data corruption" in m.error or "inf or NaN" in m.error


def test_bad_arguments_fail_as_they_do_cold(warm: WarmProbes) -> None:
    measured = warm.run(kind="matmul", args=["--seconds", "-1"], timeout_s=60)
    assert measured is not None
    [cold] = run_probe(kind="matmul", python=sys.executable, args=["--seconds", "-1"], timeout_s=60)
    [m] = measured
    assert not m.ok
    assert m.error == cold.error
    assert m.error.startswith("matmul probe exited with code 2: ")


def test_a_timeout_kills_the_probe_and_the_server_serves_the_next(warm: WarmProbes) -> None:
    # The server is started (torch imported) first: on a loaded machine the import alone may take longer
    # than the probe's 6 s, which kills the starting server instead, a case of its own.
    assert warm.run(kind="matmul", args=matmul_args(seconds=0.1, size=64), timeout_s=60) is not None
    server = warm.server_pid
    assert server is not None
    start = time.monotonic()
    measured = warm.run(kind="allgather", args=lonely_allgather(), timeout_s=6)
    assert time.monotonic() - start < 15
    assert measured is not None
    assert [m.error for m in measured] == ["allgather probe timed out after 6s and was killed"]
    assert warm.server_pid == server  # the forked probe was killed, not the server
    after = warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60)
    assert after is not None
    assert after[0].ok, after[0].error
    assert warm.server_pid == server


def test_a_killed_server_is_replaced_at_the_next_probe(warm: WarmProbes) -> None:
    assert warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60) is not None
    server = warm.server_pid
    assert server is not None
    os.kill(server, signal.SIGKILL)
    measured = warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60)
    assert measured is not None
    assert measured[0].ok, measured[0].error
    assert warm.server_pid not in (None, server)


def lonely_allgather_under_way(
    warm: WarmProbes, *, timeout_s: float
) -> tuple[threading.Thread, list[object]]:
    """Starts :func:`lonely_allgather` on a thread and returns once its child runs: the thread, and the
    list its measurements will be in."""
    kills: list[Callable[[], None]] = []
    result: list[object] = []
    thread = threading.Thread(
        target=lambda: result.append(
            warm.run(kind="allgather", args=lonely_allgather(), timeout_s=timeout_s, started=kills.append)
        )
    )
    thread.start()
    # The server imports torch first: seen to take over 30 s on the loaded 2-core machine.
    eventually(lambda: kills, timeout=60, what="the probe started", interval=0.01)
    return thread, result


def test_a_server_killed_during_a_probe_loses_that_probe_and_its_child(warm: WarmProbes) -> None:
    thread, result = lonely_allgather_under_way(warm, timeout_s=60)
    server = warm.server_pid
    assert server is not None
    os.kill(server, signal.SIGKILL)
    thread.join(20)
    [measured] = result
    assert measured is not None
    assert [m.error for m in measured] == ["allgather probe lost: the probe server ended while it ran"]
    # The fixture checks that the forked probe, in a session of its own, did not outlive its server.


def test_close_ends_the_server_and_later_probes_go_cold(warm: WarmProbes) -> None:
    assert warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60) is not None
    server = warm.server_pid
    assert server is not None
    warm.close()
    assert warm.server_pid is None
    assert warm.run(kind="matmul", args=matmul_args(seconds=0.2), timeout_s=60) is None


@pytest.mark.parametrize("python", ["/nonexistent/python", "/bin/false"])
def test_a_server_that_cannot_start_sends_the_probe_cold(python: str) -> None:
    warm = WarmProbes(python=python)
    try:
        assert warm.run(kind="matmul", args=matmul_args(seconds=0.2), timeout_s=30) is None
    finally:
        warm.close()


def test_the_server_refuses_a_malformed_request_and_serves_the_next(tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    good = {"argv": ["matmul", *matmul_args(seconds=0.2, size=128)], "stdout": str(out), "stderr": str(err)}
    requests = [
        "not json",
        json.dumps({"argv": "matmul"}),
        json.dumps({"argv": ["matmul"]}),
        json.dumps(good),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", SERVER],
        input="\n".join(requests) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [next(iter(r)) for r in replies] == ["error", "error", "error", "started", "exited"]
    assert "bad request" in replies[0]["error"]
    assert replies[3]["started"] == replies[4]["exited"]
    assert replies[4]["code"] == 0
    [line] = out.read_text().splitlines()
    assert json.loads(line)["measurements"][0]["ok"] is True


def test_a_server_stopped_during_a_probe_is_replaced(warm: WarmProbes) -> None:
    """SIGSTOP the server while its probe runs: the probe times out and is killed, the stopped server
    cannot report it, so it is not trusted with the next probe; a new server takes that one."""
    # Started first: a run's timeout counts the server's start (its torch import, over 10 s under load).
    assert warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60) is not None
    thread, result = lonely_allgather_under_way(warm, timeout_s=10)
    stopped = warm.server_pid
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    thread.join(40)
    [measured] = result
    assert measured is not None
    assert [m.error for m in measured] == ["allgather probe timed out after 10s and was killed"]
    after = warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60)
    assert after is not None
    assert after[0].ok, after[0].error
    assert warm.server_pid not in (None, stopped)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_server_forked_from_the_agents_zygote_serves_and_is_replaced_by_another_fork() -> None:
    """The agent's probes fork their server from its zygote (torch imported once per node, not twice): the
    same probes, and a killed server is replaced by a new fork. Without a ready zygote, one of its own."""
    zygote = Zygote(preimport="torch", env=os.environ, agent_pid_var=AGENT_PID_ENV_VAR)
    forked: list[int] = []

    def fork(env: Mapping[str, str] | None) -> ServerProcess | None:
        if not zygote.ready():
            return None
        proc = zygote.fork_probe_server(env if env is not None else os.environ)
        forked.append(proc.pid)
        return proc

    warm = WarmProbes(env=dict(os.environ), fork=fork)
    try:
        assert zygote.wait_ready(60), "the zygote did not get ready"
        for _ in range(2):  # the second time, from a new fork: the first server was killed
            measured = warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60)
            assert measured is not None
            assert measured[0].ok, measured[0].error
            server = warm.server_pid
            assert server is not None
            assert server == forked[-1]
            assert _parent(server) == zygote.proc.pid
            os.kill(server, signal.SIGKILL)
        assert len(forked) == 2
        zygote.close()
        measured = warm.run(kind="matmul", args=matmul_args(seconds=0.2, size=256), timeout_s=60)
        assert measured is not None
        assert measured[0].ok, measured[0].error
        server = warm.server_pid
        assert server is not None
        assert _parent(server) == os.getpid()  # no zygote: a server of its own
        assert len(forked) == 2
    finally:
        warm.close()
        zygote.close()
