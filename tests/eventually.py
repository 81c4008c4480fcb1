"""Waiting in tests: one helper instead of a hand-written loop per test.

A test waits for a condition another process or thread brings about; it never sleeps to synchronise.
``eventually`` polls ``check`` until it returns something truthy and returns that value, or fails the test
with ``what`` once ``timeout`` seconds have passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str = "the condition",
    interval: float = 0.05,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """``diagnose``, if given, says more on a timeout (a cluster's objects and logs, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{diagnose()}" if diagnose is not None else ""
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r}){more}")
        time.sleep(interval)
