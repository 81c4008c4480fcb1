"""Failure classification: exit code + the tail of a worker's output -> a :class:`FailureClass`.

Pure and torch-free, so the agent (and the master, for reports from older agents) can call it. The order
of the checks encodes which evidence wins when several are present: hardware and out-of-memory markers
explain a traceback or a kill that follows them, communication errors explain the Python exception they
surface as, and a plain traceback is the user's own error.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Sequence


class FailureClass(enum.IntEnum):
    """Mirrors ``phalanx.v1.FailureClass`` value for value, so it converts with ``int()``."""

    UNSPECIFIED = 0
    USER = 1
    KILLED = 2
    OOM = 3
    COMM = 4
    HARDWARE = 5
    HANG = 6
    UNKNOWN = 7


_HARDWARE = re.compile(
    r"\bXid\b|\bECC\b|uncorrectable|CUDA error|cudaError|CUBLAS_STATUS_EXECUTION_FAILED|"
    r"device-side assert|GPU is lost|NVLink|unspecified launch failure",
    re.IGNORECASE,
)
_OOM = re.compile(
    r"\bMemoryError\b|Out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|oom-kill",
    re.IGNORECASE,
)
_COMM = re.compile(
    r"\bNCCL\b|\bncclSystemError\b|\bgloo\b|Connection reset by peer|Connection refused|"
    r"Connection closed by peer|"
    r"DistBackendError|DistNetworkError|ProcessGroup\w*|c10d|Broken pipe|timed out after",
)
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)

# 128 + signal number, the code a shell reports for a killed child.
_SIGKILL_CODES = {-int(signal.SIGKILL), 128 + int(signal.SIGKILL)}


def classify(*, exit_code: int, log_tail: Sequence[str], error_message: str = "") -> FailureClass:
    """Classifies one worker failure.

    ``exit_code`` is Popen's: negative for a signal. ``log_tail`` is the last lines of the worker's
    output and ``error_message`` the message of its torch-elastic error file, if it wrote one.
    """
    text = "\n".join([*log_tail, error_message])
    if exit_code == 0:
        return FailureClass.UNSPECIFIED
    if _HARDWARE.search(text):
        return FailureClass.HARDWARE
    if _OOM.search(text):
        return FailureClass.OOM
    if exit_code in _SIGKILL_CODES:
        # A SIGKILL without an OOM marker: killed by a person, a supervisor or the OOM killer silently.
        return FailureClass.KILLED
    if exit_code < 0:
        return FailureClass.KILLED
    if _COMM.search(text):
        return FailureClass.COMM
    if _TRACEBACK.search(text) or error_message:
        return FailureClass.USER
    return FailureClass.UNKNOWN
