"""The agent's zygote (phalanx.agent.zygote): spares forked from one process that imported once, with real
processes, pipes and signals. The zygote here imports numpy only (not torch), to stay quick."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.agent import workers
from phalanx.agent.env import WorkerPaths
from phalanx.agent.zygote import ForkedProcess, Zygote
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SCRIPT = """
import json, os, sys
import numpy
print(json.dumps({
    "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
    "env": os.environ.get("ZYGOTE_TEST"), "rank": os.environ.get("RANK"),
    "numpy": int(numpy.random.randint(1 << 30)), "numpy_loaded_before": "numpy" in sys.modules,
}), flush=True)
if "--hang" in sys.argv:
    import time
    time.sleep(600)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


FORKED: list[ForkedProcess] = []
"""The spares of the running test, whose pipes are closed at its end (the agent's pumps close them)."""


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote(
        preimport="numpy", env={**os.environ, "ZYGOTE_TEST": "zygote"}, agent_pid_var="PHALANX_AGENT_PID"
    )
    assert z.wait_ready(30), "the zygote did not get ready"
    yield z
    z.close()
    _close_pipes()


def _close_pipes() -> None:
    for proc in FORKED:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    FORKED.clear()


def _spare(z: Zygote, script: Path, *args: str, env: dict[str, str] | None = None) -> ForkedProcess:
    proc = z.fork(["--script", str(script), *args], env={**os.environ, "ZYGOTE_TEST": "spare", **(env or {})})
    FORKED.append(proc)
    return proc


def _hand_over(proc: ForkedProcess, tmp_path: Path, **env: str) -> dict[str, object]:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write((json.dumps({"env": env, "stack_file": str(tmp_path / "stacks.txt")}) + "\n").encode())
    proc.stdin.close()
    return json.loads(proc.stdout.readline())


def test_a_forked_spare_runs_the_script_in_its_own_session_with_its_own_environment(
    zygote: Zygote, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _spare(zygote, script, "--lr", "3", env={"EXIT_CODE": "7"})
    seen = _hand_over(proc, tmp_path, RANK="5")
    assert seen["pid"] == proc.pid
    assert seen["pgid"] == proc.pid  # its own process group, like Popen's session
    assert seen["ppid"] == zygote.proc.pid
    assert seen["argv"] == [str(script), "--lr", "3"]
    assert (seen["env"], seen["rank"]) == ("spare", "5")  # the request's environment, then the round's
    assert seen["numpy_loaded_before"] is True  # imported once, in the zygote
    assert proc.wait(10) == 7  # the zygote reaps it and reports its exit code


def test_spares_do_not_share_numpy_s_random_state(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    draws = {_hand_over(_spare(zygote, script), tmp_path)["numpy"] for _ in range(3)}
    assert len(draws) == 3


def test_a_spare_killed_by_a_signal_reports_it_like_popen(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _spare(zygote, script, "--hang")
    _hand_over(proc, tmp_path)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


def test_a_spare_never_handed_over_ends_quietly(zygote: Zygote, tmp_path: Path) -> None:
    proc = _spare(zygote, tmp_path / "never-run.py")
    assert proc.stdin is not None
    proc.stdin.close()  # end of input without a round: the spare is not needed
    assert proc.wait(10) == 0


def test_a_dead_zygote_takes_its_spares_with_it_and_the_agent_learns_they_ended(
    zygote: Zygote, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _spare(zygote, script, "--hang")
    _hand_over(proc, tmp_path)
    zygote.proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    assert not zygote.ready()
    with pytest.raises(OSError, match="zygote"):
        _spare(zygote, script)


def test_a_killed_agent_takes_the_zygote_and_its_spares_with_it(tmp_path: Path) -> None:
    """A node's agent SIGKILLed: the zygote (its child) and the spares (the zygote's) die with it."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    pids = tmp_path / "pids.json"
    agent_code = f"""
import json, os, sys, time
from pathlib import Path
from phalanx.agent.zygote import Zygote
z = Zygote(preimport="", env=dict(os.environ), agent_pid_var="PHALANX_AGENT_PID")
assert z.wait_ready(30)
p = z.fork(["--script", {str(script)!r}, "--hang"], env=dict(os.environ))
p.stdin.write(b'{{"env": {{}}, "stack_file": "{tmp_path / "stacks.txt"}"}}\\n')
p.stdin.close()
p.stdout.readline()
Path({str(pids)!r}).write_text(json.dumps([z.proc.pid, p.pid]))
time.sleep(600)
"""
    agent = subprocess.Popen([sys.executable, "-c", agent_code])
    try:
        eventually(lambda: pids.exists() and pids.read_text(), timeout=30, what="the agent's spare started")
        zygote_pid, spare_pid = json.loads(pids.read_text())
        agent.kill()
        agent.wait(10)
        eventually(lambda: not _alive(zygote_pid) and not _alive(spare_pid), timeout=10, what="both ended")
    finally:
        agent.kill()


def test_a_malformed_request_gets_an_error_and_the_zygote_goes_on(zygote: Zygote, tmp_path: Path) -> None:
    zygote._sock.send(b"not json")  # and no descriptors: a request from something that is not the agent
    assert zygote._replies.get(timeout=10) == {"error": "malformed fork request"}
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _spare(zygote, script)
    assert _hand_over(proc, tmp_path)["pid"] == proc.pid


def test_workers_spawn_forks_from_the_zygote_and_stop_reaches_the_forked_worker(
    zygote: Zygote, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    spec = workers.LaunchSpec(script=str(script), script_args=["--hang"])
    started = time.monotonic()
    w = workers.spawn(
        spec,
        local_rank=0,
        env=dict(os.environ),
        max_line_bytes=4096,
        ready_file=tmp_path / "ready",
        zygote=zygote,
    )
    eventually(w.ready, timeout=10, what="the forked spare is ready")
    assert time.monotonic() - started < 5  # nothing to import: the zygote did it
    assert isinstance(w.proc, ForkedProcess)
    paths = WorkerPaths(
        beacon=tmp_path / "beacon",
        error_file=tmp_path / "error.json",
        stack_file=tmp_path / "stacks.txt",
        regroup_file=tmp_path / "regroup.pid",
        stdout_log=tmp_path / "stdout.log",
        stderr_log=tmp_path / "stderr.log",
    )
    lines: list[str] = []
    w.hand_over(env={"RANK": "0"}, paths=paths, rank=0, sink=lambda *line: lines.append(line[3]))
    eventually(lambda: lines, timeout=10, what="the worker's first line")
    assert json.loads(lines[0])["pid"] == w.pid
    assert workers.stop([w], grace_period_s=1.0) == {0: -signal.SIGTERM}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_zygote_whose_imports_initialised_cuda_never_gets_ready(tmp_path: Path) -> None:
    """A forked child of a process that initialised the CUDA driver cannot use CUDA; even
    ``torch.cuda.is_available()`` does that (on a machine without a GPU too). Such a zygote must not fork
    workers: it ends, and the agent starts its spares cold."""
    (tmp_path / "checks_cuda_at_import.py").write_text("import torch\ntorch.cuda.is_available()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    z = Zygote(preimport="torch,checks_cuda_at_import", env=env, agent_pid_var="PHALANX_AGENT_PID")
    try:
        assert not z.wait_ready(60)
        assert z.proc.wait(10) != 0
    finally:
        z.close()


def test_a_forked_worker_shows_its_script_in_its_command_line_and_the_zygote_does_not_pass_for_one(
    tmp_path: Path,
) -> None:
    """`ps` and `pgrep -f train.py` find the workers by their script, as under torchrun (a spare's command
    line is the zygote's); a training process is one whose stdin is /dev/null (handed its round), which the
    zygote's (its socket) is not."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    target = ["--script", str(script), "--hang"]
    z = Zygote(preimport="", env=dict(os.environ), agent_pid_var="PHALANX_AGENT_PID", target=target)
    try:
        assert z.wait_ready(30)
        proc = z.fork(target, env=dict(os.environ))
        FORKED.append(proc)
        _hand_over(proc, tmp_path)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert [str(script).encode(), b"--hang"] == cmdline[-3:-1]
        assert os.readlink(f"/proc/{proc.pid}/fd/0") == "/dev/null"
        assert os.readlink(f"/proc/{z.proc.pid}/fd/0").startswith("socket:")
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        z.close()
        _close_pipes()
