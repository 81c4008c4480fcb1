"""Fixtures for the tests that put nodes in network namespaces and cgroups of their own (root only)."""

from __future__ import annotations

import os

import pytest

from phalanx.api.errors import ConfigError
from phalanx.local import cpulimit, fabric


def _require(check: object, what: str) -> None:
    try:
        check()  # type: ignore[operator]
    except ConfigError as exc:
        message = f"{what} cannot be tested here: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: a skipped fault test is a failure)")
        pytest.skip(message)


@pytest.fixture
def namespaces() -> None:
    """Network namespaces can be created and wired (slow-network, --private-network)."""
    _require(fabric.check_privileges, "a slow network")


@pytest.fixture
def cgroups() -> None:
    """A cgroup cpu controller is at hand (slow-cpu)."""
    _require(cpulimit.check_privileges, "a slow CPU")
