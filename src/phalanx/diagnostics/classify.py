"""Failure classification: exit code + the tail of a worker's output -> a :class:`FailureClass`.

Pure and torch-free, so the agent (and the master, for reports from older agents) can call it. The order
of the checks encodes which evidence wins when several are present: hardware and out-of-memory markers
explain a traceback or a kill that follows them, communication errors explain the Python exception they
surface as, and a plain traceback is the user's own error.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from phalanx.api.failures import FailureClass

__all__ = ["ECHO", "ECHO_MARKERS", "FailureClass", "classify"]


_HARDWARE = re.compile(
    r"\bXid\b|\bECC\b|uncorrectable|CUDA error|cudaError|CUBLAS_STATUS_EXECUTION_FAILED|"
    r"device-side assert|GPU is lost|NVLink|unspecified launch failure",
    re.IGNORECASE,
)
_OOM = re.compile(
    r"\bMemoryError\b|Out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|oom-kill",
    re.IGNORECASE,
)
# What a rank raises when a peer (or the store's host) went away first: its error is an echo of that
# failure, not a cause. Each is a message torch 2.x, gloo or NCCL writes, verbatim:
ECHO_MARKERS = (
    # gloo/transport/tcp/pair.cc: a peer's socket closed (the peer died) or reset, or a recv never came.
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    r"Timed out waiting \d+ms for (?:recv|send) operation",
    # NCCL (ncclGetErrorString of ncclRemoteError) and ProcessGroupNCCL's watchdog and abort.
    "remote process exited or there was a network error",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
    "Some NCCL operations have failed or timed out",
    "ProcessGroupNCCL's watchdog got stuck",
    # c10d's TCPStore and rendezvous: the store's host (rank 0's agent or process) is gone or late.
    "Failed to recv, got 0 bytes",
    "Socket Timeout",
    r"wait timeout after \d+ms",
    r"Timed out after \d+ seconds waiting for clients",
    r"\bDistNetworkError\b",
    r"\bDistStoreError\b",
)
ECHO = re.compile("|".join(f"(?:{m})" for m in ECHO_MARKERS))
_COMM = re.compile(
    r"\bNCCL\b|\bncclSystemError\b|\bgloo\b|Connection refused|"
    r"DistBackendError|ProcessGroup\w*|c10d|timed out after|" + ECHO.pattern,
)
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)

# 128 + signal number, the code a shell reports for a killed child.
_SIGKILL_CODES = {-int(signal.SIGKILL), 128 + int(signal.SIGKILL)}
_SIGABRT_CODES = {-int(signal.SIGABRT), 128 + int(signal.SIGABRT)}


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
    if exit_code in _SIGABRT_CODES and ECHO.search(text):
        # ProcessGroupNCCL's watchdog aborts the process after a peer died or a collective timed out.
        return FailureClass.COMM
    if exit_code < 0:
        return FailureClass.KILLED
    if _COMM.search(text):
        return FailureClass.COMM
    if _TRACEBACK.search(text) or error_message:
        return FailureClass.USER
    return FailureClass.UNKNOWN
