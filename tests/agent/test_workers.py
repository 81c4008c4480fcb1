"""Worker processes through the bootstrap: hand-over, script semantics, output capture, stacks, stopping.
Real processes, no master."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.agent import failures, workers
from phalanx.agent.env import WorkerPaths
from phalanx.agent.zygote import Zygote
from phalanx.diagnostics.classify import FailureClass
from tests.eventually import eventually

pytestmark = pytest.mark.integration


def _paths(tmp: Path, lr: int = 0) -> WorkerPaths:
    d = tmp / f"w{lr}"
    return WorkerPaths(
        beacon=d / "beacon", error_file=d / "error.json", stack_file=d / "stacks.txt",
        regroup_file=d / "regroup.pid", stdout_log=d / "stdout.log", stderr_log=d / "stderr.log",
    )  # fmt: skip


@pytest.fixture(params=["cold", "forked"])
def zygote(request: pytest.FixtureRequest) -> Iterator[Zygote | None]:
    """Each bootstrap test runs with a fresh interpreter for the spare and with one forked by a zygote: the
    script must not tell them apart."""
    if request.param == "cold":
        yield None
        return
    z = Zygote(preimport="json", env=dict(os.environ), agent_pid_var=workers.AGENT_PID_ENV_VAR)
    assert z.wait_ready(30)
    yield z
    z.close()


def _start(
    tmp: Path, body: str, *args: str, env: dict[str, str] | None = None, zygote: Zygote | None = None
) -> tuple[workers.Worker, list]:
    script = tmp / "scripts" / "prog.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(textwrap.dedent(body))
    spec = workers.LaunchSpec(script=str(script), script_args=list(args), preimport="json")
    w = workers.spawn(
        spec, local_rank=0, env={**os.environ, **(env or {})}, cwd=str(tmp), max_line_bytes=100, zygote=zygote
    )
    lines: list = []
    w.hand_over(
        env={"RANK": "5"}, paths=_paths(tmp), rank=5, sink=lambda r, lr, s, t: lines.append((r, lr, s, t))
    )
    return w, lines


def test_runs_the_script_like_python_does(tmp_path: Path, zygote: Zygote | None) -> None:
    w, lines = _start(
        tmp_path,
        """
        import os, sys
        print("name", __name__)
        print("argv", sys.argv[1:], os.path.basename(sys.argv[0]))
        print("path0", sys.path[0])
        print("rank", os.environ["RANK"])
        print("x" * 500)
        print("err", file=sys.stderr)
        """,
        "--lr",
        "0.1",
        zygote=zygote,
    )
    assert w.proc.wait(20) == 0
    w.close_logs()
    out = [t for (_, _, s, t) in lines if s == 1]
    assert out[0] == "name __main__"
    assert out[1] == "argv ['--lr', '0.1'] prog.py"
    assert out[2] == f"path0 {tmp_path / 'scripts'}"
    assert out[3] == "rank 5"
    assert out[4] == "x" * 100  # bounded line length
    assert (5, 0, 2, "err") in lines
    assert "rank 5" in (tmp_path / "w0" / "stdout.log").read_text()
    assert (tmp_path / "w0" / "stderr.log").read_text() == "err\n"


def test_unhandled_exception_exits_1_with_traceback(tmp_path: Path, zygote: Zygote | None) -> None:
    w, _ = _start(tmp_path, "raise ValueError('boom')\n", zygote=zygote)
    assert w.proc.wait(20) == 1
    w.close_logs()
    assert list(w.tail)[-1] == "ValueError: boom"
    assert w.tail[0].startswith("Traceback")


def test_a_spare_imports_what_an_optimizer_imports_before_its_round() -> None:
    """torch.optim imports torch._dynamo when an optimizer is built: seconds a restart would wait for."""
    command = workers.LaunchSpec(script="train.py", script_args=[]).command()
    assert command[command.index("--preimport") + 1].split(",") == ["torch", "torch._dynamo"]


def test_spare_without_hand_over_exits_quietly(tmp_path: Path) -> None:
    spec = workers.LaunchSpec(script="/nonexistent.py", script_args=[], preimport="")
    w = workers.spawn(spec, local_rank=0, env=dict(os.environ), cwd=None, max_line_bytes=100)
    assert w.proc.stdin is not None
    w.proc.stdin.close()
    assert w.proc.wait(20) == 0


def test_stack_dump_and_stop_kills_the_group(tmp_path: Path, zygote: Zygote | None) -> None:
    w, _ = _start(
        tmp_path,
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that ignores SIGTERM gets SIGKILL
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("child", child.pid, flush=True)
        def deep_in_training():
            time.sleep(60)
        deep_in_training()
        """,
        zygote=zygote,
    )
    line = eventually(lambda: next((t for t in w.tail if t.startswith("child")), None), timeout=20)
    child = int(line.split()[1])
    stacks = workers.dump_stacks([w], wait_s=3.0)
    assert "deep_in_training" in stacks[0]
    start = time.monotonic()
    codes = workers.stop([w], grace_period_s=0.5)
    assert codes == {0: -signal.SIGKILL}
    assert time.monotonic() - start < 5
    eventually(
        lambda: (
            not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        ),
        timeout=5,
        what="the worker's child gone with it",
    )


def test_stopped_worker_is_killed_without_grace(tmp_path: Path, zygote: Zygote | None) -> None:
    w, _ = _start(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n", zygote=zygote)
    eventually(
        lambda: any(t.startswith("up") for t in w.tail), timeout=20, what="the worker running its script"
    )
    os.kill(w.pid, signal.SIGSTOP)  # only queued when kill returns
    eventually(lambda: workers.is_stopped(w.pid), timeout=10, what="the worker seen stopped")
    assert "stopped" in workers.dump_stacks([w])[0]
    start = time.monotonic()
    assert workers.stop([w], grace_period_s=10.0) == {0: -signal.SIGKILL}
    assert time.monotonic() - start < 3


def test_bootstrap_runs_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import sys\nprint('mod', __name__, sys.argv[1:])\n")
    spec = workers.LaunchSpec(script="mypkg.train", script_args=["a"], module=True, preimport="")
    w = workers.spawn(spec, local_rank=0, env=dict(os.environ), cwd=str(tmp_path), max_line_bytes=100)
    w.hand_over(env={}, paths=_paths(tmp_path), rank=0, sink=lambda *a: None)
    assert w.proc.wait(20) == 0
    w.close_logs()
    assert list(w.tail) == ["mod __main__ ['a']"]
    assert sys.executable


def test_a_rank_that_raised_before_the_stop_reports_its_error_not_the_stop(
    tmp_path: Path, zygote: Zygote | None
) -> None:
    """A worker still tearing down after its exception is stopped by the agent: its error file, written
    before the stop, is the cause. A file written by a SIGTERM handler after the stop is not."""
    record = textwrap.dedent("""
        import json, signal, sys, time
        from pathlib import Path
        def record(message):
            Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
            Path(sys.argv[1]).write_text(json.dumps({"message": {"message": message, "extraInfo": {}}}))
        """)
    raised, _ = _start(
        tmp_path / "raised", record + "record('ValueError: bad batch'); time.sleep(60)\n",
        str(tmp_path / "raised" / "w0" / "error.json"), zygote=zygote,
    )  # fmt: skip
    stopped, _ = _start(
        tmp_path / "stopped",
        record + "signal.signal(signal.SIGTERM, lambda *a: (record('SignalException'), sys.exit(1)))\n"
        "print('handler installed', flush=True)\n"
        "time.sleep(60)\n",
        str(tmp_path / "stopped" / "w0" / "error.json"),
        zygote=zygote,
    )
    eventually(lambda: raised.paths and raised.paths.error_file.exists(), timeout=20)
    eventually(lambda: any("handler installed" in t for t in stopped.tail), timeout=20)
    # Raised *before* the stop, as the file clock tells: a file written in the stop's own clock tick counts as
    # the stop's doing (failures.raised_before), so the stop waits for the file clock to move on.
    assert raised.paths is not None
    written_ns = raised.paths.error_file.stat().st_mtime_ns
    tick = tmp_path / "tick"
    eventually(lambda: tick.write_bytes(b"") == 0 and tick.stat().st_mtime_ns > written_ns, timeout=5)
    marks = failures.mark_stop({0: raised, 1: stopped})
    workers.stop([raised, stopped], grace_period_s=5)
    assert stopped.proc.returncode == 1
    assert stopped.paths is not None
    assert stopped.paths.error_file.exists()
    late = failures.raised_before({0: raised, 1: stopped}, marks)
    assert late == {0: raised}
    entry = failures.worker_failure(
        0, raised, hung=False, reason="", history=None, stopped_after_raising=True
    )
    assert entry.exit_code == -signal.SIGTERM
    assert entry.failure_class == int(FailureClass.USER)
    assert entry.error_message == "ValueError: bad batch"


# The agent's side of a worker's start, run as PID 1 of a PID namespace of its own: in a container the agent
# is the container's command, so every worker's parent is PID 1.
AS_PID_1 = """
import os, sys
from pathlib import Path
from phalanx.agent import workers
from phalanx.agent.env import WorkerPaths

assert os.getpid() == 1, os.getpid()
tmp = Path(sys.argv[1])
spec = workers.LaunchSpec(script=str(tmp / "prog.py"), script_args=[], preimport="json")
w = workers.spawn(spec, local_rank=0, env=dict(os.environ), cwd=str(tmp), max_line_bytes=100)
d = tmp / "w0"
paths = WorkerPaths(
    beacon=d / "beacon", error_file=d / "error.json", stack_file=d / "stacks.txt",
    regroup_file=d / "regroup.pid", stdout_log=d / "stdout.log", stderr_log=d / "stderr.log",
)
lines = []
w.hand_over(env={}, paths=paths, rank=0, sink=lambda r, lr, s, t: lines.append(t))
code = w.proc.wait(60)
w.close_logs(5)
print("exit", code, "lines", lines, flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of its own needs root (CI runs as root)")
def test_a_worker_runs_under_an_agent_that_is_pid_1_as_in_a_container(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text("print('trained', flush=True)\n")
    driver = tmp_path / "agent.py"
    driver.write_text(AS_PID_1)
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(driver), str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exit 0" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "trained" in result.stdout, result.stdout
