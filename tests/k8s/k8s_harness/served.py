"""A program the tests run beside a cluster's control plane (Kueue's manager, a second scheduler): waited for
until it answers, stopped with its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


def wait_answering(
    process: subprocess.Popen[bytes],
    url: str,
    log: Path,
    *,
    what: str,
    timeout: float = 120,
    verify: bool = True,
) -> None:
    """Until ``url`` answers 200; fails with the end of ``log`` if the program exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer within {timeout:g}s: {log.read_text()[-4000:]}")


def stop(process: subprocess.Popen[bytes], *, timeout: float = 20) -> None:
    """SIGTERM to its process group, SIGKILL after ``timeout``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue
