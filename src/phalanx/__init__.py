"""phalanx keeps large PyTorch training jobs alive through failures, on Kubernetes and on one machine.

The API a training script touches at the top level is :func:`report_step`; the flash checkpoint lives in
:mod:`phalanx.checkpoint` and the parallel trainer in :mod:`phalanx.trainer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "report_step"]

_writer: Any = None
"""The beacon's writer (``phalanx.api.beacon.BeaconWriter``), opened at the first step or announcement."""
_disabled = False
_step_recorder: object | None = None
"""The interval recorder when :func:`phalanx.intervals.enable` turned it on: it records each step boundary."""
_reports_itself = False
"""Whether the script called :func:`report_step`: the automatic steps (:mod:`phalanx.instrument`) stop."""


def report_step(step: int) -> None:
    """Publishes the training step this process just completed to its node agent.

    The agent uses it for hang detection and progress reporting; with the interval recorder on
    (:func:`phalanx.intervals.enable`) it also records the step boundary there. Outside ``phalanx-run`` (no
    beacon in the environment) it is a no-op costing one boolean check. A script that calls it keeps its own
    step numbers: the ones ``phalanx-run`` takes from the optimizer stop (:mod:`phalanx.instrument`).
    """
    global _reports_itself
    _reports_itself = True
    _publish(step)


def auto_step(step: int) -> None:
    """A step :mod:`phalanx.instrument` took from the optimizer: published unless the script reports steps."""
    if not _reports_itself:
        _publish(step)


def announce() -> None:
    """Writes the beacon at step -1 before any step: the agent and the fault injector learn the pid."""
    if _open_beacon():
        _writer.write(-1)


def _open_beacon() -> bool:
    global _writer, _disabled
    if _writer is not None:
        return True
    if _disabled:
        return False
    path = os.environ.get("PHALANX_BEACON_FILE")
    if not path:
        _disabled = True
        return False
    from phalanx.api.beacon import BeaconWriter

    try:
        _writer = BeaconWriter(Path(path))
    except OSError:
        _disabled = True  # the agent went away; training must not fail because of a beacon
        return False
    return True


def _publish(step: int) -> None:
    if _writer is None and not _open_beacon():
        return
    _writer.write(step)
    if _step_recorder is not None:
        _step_recorder.step(step)  # type: ignore[attr-defined]
