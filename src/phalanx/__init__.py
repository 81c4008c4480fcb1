"""phalanx keeps large PyTorch training jobs alive through failures, on Kubernetes and on one machine.

The API a training script touches at the top level is :func:`report_step`; the flash checkpoint lives in
:mod:`phalanx.checkpoint` and the parallel trainer in :mod:`phalanx.trainer`.
"""

from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"
__all__ = ["__version__", "report_step"]

_writer: object | None = None
_disabled = False
_step_recorder: object | None = None
"""The interval recorder when :func:`phalanx.intervals.enable` turned it on: it records each step boundary."""


def report_step(step: int) -> None:
    """Publishes the training step this process just completed to its node agent.

    The agent uses it for hang detection and progress reporting; with the interval recorder on
    (:func:`phalanx.intervals.enable`) it also records the step boundary there. Outside ``phalanx-run`` (no
    beacon in the environment) it is a no-op costing one boolean check.
    """
    global _writer, _disabled
    if _disabled:
        return
    if _writer is None:
        path = os.environ.get("PHALANX_BEACON_FILE")
        if not path:
            _disabled = True
            return
        from phalanx.api.beacon import BeaconWriter

        try:
            _writer = BeaconWriter(Path(path))
        except OSError:
            _disabled = True  # the agent went away; training must not fail because of a beacon
            return
    _writer.write(step)  # type: ignore[attr-defined]
    if _step_recorder is not None:
        _step_recorder.step(step)  # type: ignore[attr-defined]
