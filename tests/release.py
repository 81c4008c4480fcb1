"""Session fixtures stopped as soon as the last test that uses them has run, not at the session's end.

A Kubernetes control plane and its nodes keep part of a core busy while idle (etcd, the API server's watches,
the kubelets' housekeeping, containerd). In `make test` the two clusters (tests/k8s, e2e/) run their tests
first, each in a lane of its own (tests/conftest.py); they used to sit idle then to the end of the session:
measured with tests/cpu_usage.py, their processes cost about 890 CPU seconds over a 37-minute run, a fifth of
the machine.
Each folder's tests run one after another in its lane, so the test after the last one of a folder is the
moment to stop what only that folder's tests use.
"""

from __future__ import annotations

from collections.abc import Callable

_stops: list[tuple[str, Callable[[], None]]] = []


def when_done(folder: str, stop: Callable[[], None]) -> None:
    """Calls ``stop`` after the teardown of the last test under ``folder`` (a node id prefix, such as
    ``"e2e/"``) that this process runs. ``stop`` must be safe to call twice: the fixture's own teardown at the
    session's end calls it again (an ``ExitStack``'s ``close``, a generator's ``close``)."""
    _stops.append((folder, stop))


def leaving(nodeid: str, next_nodeid: str | None) -> list[str]:
    """After a test's teardown: when the next test is not under a folder this one is under, stops what that
    folder registered, the newest first (a fixture before the fixtures it uses). Returns those folders."""
    left = []
    for entry in reversed(list(_stops)):
        folder, stop = entry
        if nodeid.startswith(folder) and not (next_nodeid or "").startswith(folder):
            _stops.remove(entry)
            stop()
            left.append(folder)
    return sorted(set(left))
