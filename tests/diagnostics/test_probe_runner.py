"""The probe runner against real probe processes and real misbehaving programs.

The misbehaving "interpreters" are small executables the runner starts like any Python: one stops itself
with SIGSTOP, one prints garbage, one crashes. They are real processes; nothing is patched.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.probe_runner import (
    MAX_ERROR_CHARS,
    Measurement,
    allgather_args,
    allgather_timeout_s,
    matmul_args,
    parse_output,
    run_probe,
    to_proto,
)
from tests.eventually import eventually


def fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- real probe processes --------------------------------------------------------------------------------


@pytest.mark.integration
def test_matmul_probe_reports_positive_tflops_and_ok() -> None:
    [m] = run_probe(
        kind="matmul", python=sys.executable, args=matmul_args(seconds=0.5, size=512), timeout_s=60
    )
    assert m.ok, m.error
    assert m.error == ""
    assert m.peer_node_id == ""
    assert 0.4 <= m.elapsed_s < 5
    # A 2-core CPU does roughly 0.01-0.2 TFLOP/s in fp32; anything in (0, 100) is a sane measurement.
    assert 1e-4 < m.rate < 100, m.rate


@pytest.mark.integration
def test_matmul_probe_with_injected_bit_flip_reports_wrong_result() -> None:
    [m] = run_probe(
        kind="matmul",
        python=sys.executable,
        args=[*matmul_args(seconds=0.2, size=256), "--inject-error"],
        timeout_s=60,
    )
    assert not m.ok
    assert "wrong matmul result" in m.error or "inf or NaN" in m.error
    assert "silent data corruption" in m.error or "inf or NaN" in m.error
    assert m.rate > 0  # the speed was measured; the result is what is wrong


@pytest.mark.integration
def test_cuda_probe_without_cuda_reports_a_clear_failure() -> None:
    [m] = run_probe(
        kind="matmul",
        python=sys.executable,
        args=matmul_args(seconds=0.1, device="cuda"),
        timeout_s=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert not m.ok
    assert m.error == "CUDA is not available on this node"


@pytest.mark.integration
def test_bad_arguments_give_the_exit_code_and_stderr() -> None:
    [m] = run_probe(kind="matmul", python=sys.executable, args=["--seconds", "-1"], timeout_s=60)
    assert not m.ok
    assert m.error.startswith("matmul probe exited with code 2: ")
    assert "--seconds must be positive" in m.error


@pytest.mark.integration
def test_hanging_probe_is_killed_at_the_timeout() -> None:
    # Rank 1 of a group whose rank 0 never serves the store waits for it far longer than the runner allows.
    args = allgather_args(
        rank=1, node_ids=["a", "b"], store_host="127.0.0.1", store_port=9, seconds=1, timeout_s=120
    )
    start = time.monotonic()
    [m] = run_probe(kind="allgather", python=sys.executable, args=args, timeout_s=8)
    took = time.monotonic() - start
    assert not m.ok
    assert m.error == "allgather probe timed out after 8s and was killed"
    assert 8 <= took < 15


# -- misbehaving programs --------------------------------------------------------------------------------


def test_stopped_probe_and_its_children_are_killed_at_the_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    # A helper child in the same group, then the probe stops itself (SIGSTOP cannot be caught).
    python = fake_python(tmp_path, f"sleep 300 & echo $! > {marker}\nkill -STOP $$")
    start = time.monotonic()
    [m] = run_probe(kind="matmul", python=python, args=[], timeout_s=1.0)
    assert time.monotonic() - start < 8
    assert m == Measurement(ok=False, error="matmul probe timed out after 1s and was killed")
    child = int(marker.read_text())
    # A killed child of a killed shell is reparented and reaped by init: gone, or a zombie until then.
    eventually(lambda: _gone_or_zombie(child), timeout=5, what=f"helper {child} gone after the timeout")


def test_garbage_output_is_a_failure_that_quotes_it(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "Segmentation fault? {not json"; echo \'{"probe": "matmul"}\'')
    [m] = run_probe(kind="matmul", python=python, args=[], timeout_s=10)
    assert not m.ok
    assert m.error.startswith("matmul probe printed no result line: Segmentation fault? {not json")


def test_crash_without_output_reports_code_and_stderr_tail(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "Traceback" >&2; echo "RuntimeError: CUDA error: ECC" >&2; exit 3')
    [m] = run_probe(kind="matmul", python=python, args=[], timeout_s=10)
    assert m == Measurement(
        ok=False, error="matmul probe exited with code 3: Traceback | RuntimeError: CUDA error: ECC"
    )


def test_killed_by_signal_is_named(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "kill -KILL $$")
    [m] = run_probe(kind="matmul", python=python, args=[], timeout_s=10)
    assert m.error == "matmul probe was killed by signal 9: no error output"


def test_missing_interpreter_is_a_failure_not_an_exception(tmp_path: Path) -> None:
    [m] = run_probe(kind="matmul", python=str(tmp_path / "nope"), args=[], timeout_s=10)
    assert not m.ok
    assert "could not be started" in m.error


def test_result_line_is_taken_even_after_noise_and_with_a_nonzero_exit(tmp_path: Path) -> None:
    line = json.dumps({"probe": "matmul", "measurements": [{"ok": True, "elapsed_s": 1, "rate": 2.5}]})
    python = fake_python(tmp_path, f"echo 'NCCL INFO hello'; echo '{line}'; echo 'bye'; exit 1")
    assert run_probe(kind="matmul", python=python, args=[], timeout_s=10) == [
        Measurement(ok=True, elapsed_s=1.0, rate=2.5)
    ]


# -- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        '{"probe": "allgather", "measurements": [{"ok": true}]}',  # another probe's line
        '{"probe": "matmul", "measurements": []}',
        '{"probe": "matmul", "measurements": [{"ok": "yes"}]}',
        '{"probe": "matmul", "measurements": [{"ok": true, "rate": NaN}]}',
        '{"probe": "matmul", "measurements": [{"ok": true, "rate": "fast"}]}',
        '{"probe": "matmul", "measurements": [{"ok": true, "peer_node_id": 3}]}',
        '{"probe": "matmul", "measurements": [[1]]}',
        '["probe", "matmul"]',
        '{"probe": "matmul", "measurements": [{"ok": true}',
    ],
)
def test_invalid_result_lines_are_rejected(line: str) -> None:
    assert parse_output(line, kind="matmul") is None


def test_long_errors_are_truncated_for_the_master() -> None:
    line = json.dumps({"probe": "matmul", "measurements": [{"ok": False, "error": "x" * 10_000}]})
    [m] = parse_output(line, kind="matmul") or []
    assert len(m.error) == MAX_ERROR_CHARS


def test_to_proto_keeps_every_field() -> None:
    ms = [Measurement(peer_node_id="b", ok=True, elapsed_s=1.5, rate=3.25), Measurement(error="boom")]
    assert to_proto(ms) == [
        pb.ProbeMeasurement(peer_node_id="b", ok=True, elapsed_s=1.5, rate=3.25),
        pb.ProbeMeasurement(ok=False, error="boom"),
    ]


def test_runner_and_analysis_do_not_import_torch() -> None:
    """The agent imports these; torch must not come along, even transitively."""
    code = (
        "import sys, phalanx.diagnostics.probe_runner, phalanx.diagnostics.stragglers,"
        " phalanx.diagnostics.warm_probes;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_allgather_runner_timeout_outlasts_the_probes_own_watchdog() -> None:
    # The probe's watchdog fires at seconds + timeout_s * (3 + pairs) with at most two pairs per rank.
    assert allgather_timeout_s(seconds=2, timeout_s=30, startup_s=0) > 2 + 30 * 5


def _gone_or_zombie(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] == "Z"
