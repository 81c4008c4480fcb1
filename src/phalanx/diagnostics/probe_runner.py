"""Runs a health-probe program in a subprocess and turns whatever happens into measurements; torch-free.

The agent calls :func:`run_probe` when the master sends ``ACTION_KIND_RUN_PROBE``. Contract:

* ``run_probe(kind=..., python=..., args=..., timeout_s=...)`` starts
  ``<python> -m phalanx.diagnostics.probe <kind> <args...>`` in a new session (its own process group),
  waits at most ``timeout_s`` seconds, and always returns a non-empty list of :class:`Measurement`;
  it never raises for anything the probe does. It blocks, so call it from a worker thread.
* The probe prints one JSON line ``{"probe": kind, "measurements": [{peer_node_id, ok, elapsed_s,
  rate, error}, ...]}`` on stdout (``rate`` in TFLOP/s for matmul, GB/s bus bandwidth for all-gather).
  The last such line on stdout is taken, whatever the exit code, because the probe reports its own
  failures (wrong matmul result, missing peer) as ``ok=false`` measurements.
* Without such a line the run fails as a whole: one measurement with ``ok=false``, an empty peer and
  an error naming the cause -- ``timed out after Ns`` (the whole process group is then SIGKILLed, which
  also ends a stopped probe), ``exited with code N`` or ``was killed by signal N`` (with the tail of its
  stderr), or ``printed no result line`` when the output was not a valid result. Only ``json`` parses
  the output; fields are type-checked and error texts truncated to :data:`MAX_ERROR_CHARS`.
* :func:`matmul_args` and :func:`allgather_args` build the argument lists; :func:`to_proto` converts
  the result for ``ReportProbe``; :func:`allgather_timeout_s` is a runner timeout long enough for the
  all-gather probe to report a dead peer itself (which names the peer) before the runner kills it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from phalanx.api.v1 import master_pb2 as pb

ProbeName = Literal["matmul", "allgather"]
PROGRAM = "phalanx.diagnostics.probe"

MAX_ERROR_CHARS = 1000
"""Longest error text kept per measurement (the master refuses more than 4096)."""
MAX_OUTPUT_BYTES = 1 << 20
"""Most output of a probe that is read: its result line is tiny; more than this is garbage."""
_KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class Measurement:
    """One probe measurement, field for field the ``ProbeMeasurement`` protobuf message."""

    peer_node_id: str = ""
    ok: bool = False
    elapsed_s: float = 0.0
    rate: float = 0.0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The JSON form the probe program prints."""
        return asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Measurement:
        """Reads the JSON form, checking types; raises ``ValueError`` on anything unexpected."""
        peer, ok, elapsed, rate, error = (
            data.get("peer_node_id", ""),
            data.get("ok"),
            data.get("elapsed_s", 0.0),
            data.get("rate", 0.0),
            data.get("error", ""),
        )
        if not isinstance(peer, str) or not isinstance(error, str) or not isinstance(ok, bool):
            raise ValueError("peer_node_id and error must be strings and ok a boolean")
        numbers = []
        for value in (elapsed, rate):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"elapsed_s and rate must be finite numbers, got {value!r}")
            numbers.append(float(value))
        return cls(peer_node_id=peer[:253], ok=ok, elapsed_s=numbers[0], rate=numbers[1], error=_clip(error))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def failure(error: str) -> list[Measurement]:
    return [Measurement(ok=False, error=_clip(error))]


def parse_output(stdout: str, *, kind: str) -> list[Measurement] | None:
    """The measurements of the last valid result line for ``kind`` in ``stdout``; None when there is none."""
    for raw_line in reversed(stdout.splitlines()):
        line = raw_line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict) or data.get("probe") != kind:
                continue
            raw = data.get("measurements")
            if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
                continue
            return [Measurement.from_mapping(m) for m in raw]
        except ValueError:  # json.JSONDecodeError is a ValueError, as are the field checks
            continue
    return None


def _stderr_tail(stderr: str, lines: int = 5) -> str:
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(tail)


def run_probe(
    *,
    kind: ProbeName,
    python: str,
    args: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    started: Callable[[Callable[[], None]], None] | None = None,
) -> list[Measurement]:
    """Runs one probe program to completion or timeout; see the module docstring for the contract.
    ``started`` gets a function that kills the probe's process group, as soon as the probe runs."""
    command = [python, "-m", PROGRAM, kind, *args]
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a timeout kills helpers too
            env=dict(env) if env is not None else None,
        )
    except OSError as exc:
        return failure(f"{kind} probe could not be started with {python}: {exc}")
    if started is not None:
        started(lambda: stop(proc))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return failure(f"{kind} probe timed out after {timeout_s:g}s and was killed")
    return outcome(kind, out=out, err=err, code=proc.returncode)


def outcome(kind: str, *, out: bytes, err: bytes, code: int) -> list[Measurement]:
    """What a finished probe program measured, from its output and exit code (negative: a signal)."""
    stdout = out[-MAX_OUTPUT_BYTES:].decode("utf-8", errors="replace")
    stderr = err[-MAX_OUTPUT_BYTES:].decode("utf-8", errors="replace")
    measurements = parse_output(stdout, kind=kind)
    if measurements is not None:
        return measurements
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if code == 0:
        return failure(f"{kind} probe printed no result line: {_short(stdout) or 'no output'}")
    return failure(f"{kind} probe {how}: {_stderr_tail(stderr) or 'no error output'}")


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILLs a running probe's process group, from any thread; :func:`run_probe` then reports it failed.
    For the agent's shutdown: a probe in its own session would otherwise outlive its agent."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILLs the probe's process group (SIGKILL also ends stopped processes) and reaps the probe."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        # A helper that left the group still holds the pipes open; stop waiting for them.
        proc.kill()
        proc.wait(timeout=_KILL_WAIT_S)


def matmul_args(*, seconds: float = 2.0, size: int = 0, device: str = "") -> list[str]:
    """Arguments for the matmul probe; ``size=0`` and ``device=""`` take the probe's defaults."""
    args = ["--seconds", f"{seconds:g}"]
    if size:
        args += ["--size", str(size)]
    if device:
        args += ["--device", device]
    return args


def allgather_args(
    *,
    rank: int,
    node_ids: Sequence[str],
    store_host: str,
    store_port: int,
    nbytes: int = 16 << 20,
    seconds: float = 2.0,
    pairs: bool = True,
    backend: str = "gloo",
    timeout_s: float = 30.0,
) -> list[str]:
    """Arguments for the all-gather probe of group ``node_ids`` (this node is ``node_ids[rank]``).

    Rank 0 serves the rendezvous store at ``store_host:store_port``; the others connect to it.
    """
    args = [
        "--rank",
        str(rank),
        "--world-size",
        str(len(node_ids)),
        "--store",
        f"{store_host}:{store_port}",
        "--node-ids",
        ",".join(node_ids),
        "--bytes",
        str(nbytes),
        "--seconds",
        f"{seconds:g}",
        "--backend",
        backend,
        "--timeout-s",
        f"{timeout_s:g}",
    ]
    return [*args, "--pairs"] if pairs else args


def allgather_timeout_s(*, seconds: float, timeout_s: float, startup_s: float = 60.0) -> float:
    """Runner timeout for an all-gather probe: its own worst case (store, presence wait, two pairs and
    the hand-over, each bounded by ``timeout_s``) plus ``startup_s`` for importing torch."""
    return seconds + 6 * timeout_s + startup_s


def to_proto(measurements: Sequence[Measurement]) -> list[pb.ProbeMeasurement]:
    """The measurements as ``ProbeMeasurement`` messages for ``ReportProbeRequest``."""
    return [
        pb.ProbeMeasurement(
            peer_node_id=m.peer_node_id, ok=m.ok, elapsed_s=m.elapsed_s, rate=m.rate, error=m.error
        )
        for m in measurements
    ]
