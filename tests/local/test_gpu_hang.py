"""A device-side hang under ``phalanx local`` with default hang settings, on a real GPU with NCCL
(tests/local/hang_nccl.py): a kernel that spins before an all-reduce stalls the rank's device while its host
blocks in ``.item()``. The agent's verdict says "device side" and names the all-reduce within
max(10 s, 3 x p99 step); the rank's recorder answers with torch's NCCL flight recorder from its watcher
thread; the master keeps both with the failure, ``phalanx timeline`` writes the dump beside the trace, and
training resumes. Skipped, not faked, without a CUDA GPU and NCCL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.helpers import steps
from tests.cli.trace_format import check_trace
from tests.eventually import eventually

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
        reason="needs a CUDA GPU with NCCL",
    ),
]

SCRIPT = Path(__file__).with_name("hang_nccl.py")
TIMEOUT_S = 10.0  # max(10 s, 3 x p99 step) with 0.05 s steps: the default floor
STEPS, SPIN_AT = 80, 30


def run_local(tmp_path: Path, *, steps_total: int, spin_at: int, timeout_s: float) -> dict[str, Any]:
    """Runs the job under ``phalanx local`` until the master keeps a failure with hang evidence, then until
    the job ends. Returns the failure as ``/v1/timeline`` had it, the trace and the files ``phalanx
    timeline`` wrote, the spin's start and ``phalanx local``'s exit and output."""
    workdir, d = tmp_path / "wd", tmp_path / "d"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "local", "--nodes", "1", "--nproc-per-node", "1",
         "--job-id", "gpu-hang", "--workdir", str(workdir), "--timeout", f"{timeout_s:g}s",
         "--agent-arg=--grace-period=2s", "--",
         str(SCRIPT), "--dir", str(d), "--steps", str(steps_total), "--spin-at", str(spin_at)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines: list[str] = []
    try:
        stdout = proc.stdout
        assert stdout is not None

        def master_address() -> str:
            lines.append(stdout.readline())  # blocks for the next line
            found = re.search(r"\(http ([0-9.:]+)\)", lines[-1])
            return f"http://{found[1]}" if found else ""

        url = eventually(
            master_address, timeout=60, what="phalanx local printing its master address", interval=0
        )
        token = (workdir / "token").read_text().strip()

        def hang_failure() -> dict[str, Any] | None:
            assert proc.poll() is None, "phalanx local ended first:\n" + "".join(lines)
            answer = httpx.get(
                f"{url}/v1/timeline",
                params={"window_s": 300},
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            )
            answer.raise_for_status()
            # The failure event holds the evidence (the hang analysis that follows it is a failure too).
            return next((f for f in answer.json()["failures"] if f.get("hang")), None)

        failure = eventually(hang_failure, timeout=120, what="a failure with hang evidence", interval=0.5)
        prefix = tmp_path / "around"
        cli = subprocess.run(
            [sys.executable, "-m", "phalanx", "timeline", "--master", url,
             "--token-file", str(workdir / "token"), "--around", str(failure["id"]), "--window", "60",
             "-o", str(prefix)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stdout + cli.stderr
        rest, _ = proc.communicate(timeout=timeout_s)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {
        "failure": failure,
        "trace": json.loads(prefix.with_name("around.json").read_text()),
        "dumps": sorted(tmp_path.glob("around.flight-*.json")),
        "png": prefix.with_name("around.png"),
        "spin_unix": json.loads((d / "spin.json").read_text())["unix"],
        "steps": steps(d),
        "processes": len(list(d.glob("steps-*.jsonl"))),
        "code": proc.returncode,
        "output": "".join(lines),
    }


def test_a_device_side_hang_is_caught_with_its_nccl_flight_recorder_and_training_resumes(
    tmp_path: Path,
) -> None:
    run = run_local(tmp_path, steps_total=STEPS, spin_at=SPIN_AT, timeout_s=200)
    out, failure = run["output"], run["failure"]
    assert run["code"] == 0, out

    # The verdict: device side, in the all-reduce queued behind the spin, within the timeout.
    (rank,) = failure["hang"]
    assert rank["side"] == "device", failure
    assert rank["collective"]["op"] == "all_reduce", failure
    assert rank["timeout_s"] == pytest.approx(TIMEOUT_S, abs=0.01), failure
    assert re.search(r"hung in all_reduce #\d+ of dp:0 \(device side", failure["message"]), failure
    detected_after = failure["unix"] - run["spin_unix"]
    assert TIMEOUT_S - 0.5 < detected_after < TIMEOUT_S + 4, detected_after
    print(
        f"device-side hang detected {detected_after:.2f} s after the spin was queued (timeout {TIMEOUT_S} s)"
    )

    # torch's own flight recorder, from the watcher thread while the training thread was blocked.
    dump = json.loads(rank["nccl_trace"])
    entries = dump["entries"]
    assert any("all_reduce" in str(e.get("profiling_name", "")) for e in entries), str(dump)[:2000]
    assert not all(e.get("state") == "completed" for e in entries), "the stuck all-reduce is not completed"

    # `phalanx timeline`: a valid trace whose failure carries the evidence, and the dump in a file.
    assert check_trace(run["trace"]) == []
    (instant,) = [
        e for e in run["trace"]["traceEvents"] if e["ph"] == "i" and e["name"].endswith(f"#{failure['id']}")
    ]
    assert instant["args"]["hang"][0]["side"] == "device"
    (dump_file,) = run["dumps"]
    assert dump_file.name == f"around.flight-{failure['id']}-rank0.json"
    assert json.loads(dump_file.read_text()) == dump
    assert run["png"].exists()

    # Training resumed in a new process (a steps file of its own) and finished.
    assert run["processes"] == 2, out
    assert max(e["step"] for e in run["steps"]) == STEPS - 1, out
