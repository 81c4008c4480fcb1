"""Where `make test`'s time goes: the CPU seconds each test module spent, and how busy the machine was.

On a 2-core machine the suite's wall time is bounded by the CPU work of its tests more than by their
waits; this report, at the end of every run, names the modules that cost the most so that cutting the
suite's time starts from a measurement. Each test's figure is its lane process's own CPU time plus that
of the child processes it reaped (``RUSAGE_CHILDREN``: an agent's workers count once the agent has
waited for them), from its set-up to its teardown. A session fixture's processes are reaped when it stops:
the Kubernetes clusters after their folder's last test (tests/release.py), the rest after a lane's last
test; each has a line of its own rather than counting for the test it stopped after. Processes nobody
here reaps are not counted: containers run by containerd.

The hooks are :mod:`tests.conftest`'s, so they cover the tests under ``tests/`` (the e2e scenarios' work is
in their containers anyway).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests import torch_forks

CPU_PROPERTY = "cpu_s"
FIXTURES_PROPERTY = "cpu_fixtures"
"""(what, seconds): session fixtures stopped after the test, whose CPU is not the test's."""
_STARTED = pytest.StashKey[float]()
_TEARDOWN = pytest.StashKey[tuple[float, bool]]()
_RELEASED = pytest.StashKey[list[tuple[str, float]]]()


def cpu_seconds() -> float:
    """This process's CPU time and that of its reaped children, user and system, with the processes its
    torch zygote forked and reaped (tests/torch_forks.py)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = torch_forks.reaped_cpu_seconds()
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


def machine_busy() -> tuple[float, float, float] | None:
    """(busy, stolen, total) jiffies of every CPU since boot (``/proc/stat``: user, nice, system, idle,
    iowait, irq, softirq, steal; the guest times are in user already); None where there is no such file."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


class Report:
    """Collects each test's CPU seconds (in the process that prints the summary: xdist's controller)."""

    def __init__(self) -> None:
        self.by_module: dict[str, float] = defaultdict(float)
        self.machine_at_start = machine_busy()
        self.started = time.monotonic()
        self.lanes: dict[str, list[float]] = {}
        """lane -> [first test's start, last test's end, seconds in tests, seconds in cluster tests]: which
        lane is the run's critical path, and how much of it the clusters' tests are."""

    def timed(self, report: pytest.TestReport, *, cluster: bool) -> None:
        """Adds one phase (set-up, call, teardown) of a test to its lane's wall time."""
        node = getattr(report, "node", None)  # xdist's worker on the controller
        lane = str(getattr(getattr(node, "gateway", None), "id", "main"))
        start, stop = float(getattr(report, "start", 0.0)), float(getattr(report, "stop", 0.0))
        if not start or not stop:
            return
        first, last, busy, clusters = self.lanes.get(lane, [start, stop, 0.0, 0.0])
        took = stop - start
        in_clusters = clusters + (took if cluster else 0.0)
        self.lanes[lane] = [min(first, start), max(last, stop), busy + took, in_clusters]

    def add(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == CPU_PROPERTY and isinstance(value, float):
                self.by_module[report.nodeid.partition("::")[0]] += value
            elif name == FIXTURES_PROPERTY and isinstance(value, (list, tuple)):
                what, seconds = value
                self.by_module[f"session fixtures: {what}"] += float(seconds)

    def lines(self, *, top: int = 15) -> list[str]:
        total = sum(self.by_module.values())
        out = [f"CPU of the tests and their session fixtures: {total:.0f} s in all; the most:"]
        for module, seconds in sorted(self.by_module.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"  {seconds:7.1f} s  {module}")
        for lane, (first, last, busy, clusters) in sorted(self.lanes.items()):
            out.append(
                f"lane {lane}: {last - first:.0f} s from its first test's start to its last one's end, "
                f"{busy:.0f} s of it in tests ({clusters:.0f} s in the clusters' tests)"
            )
        end, start = machine_busy(), self.machine_at_start
        if start is not None and end is not None and end[2] > start[2]:
            busy, stolen, total_jiffies = (e - s for e, s in zip(end, start, strict=True))
            out.append(
                f"the machine's CPUs were busy {100 * busy / total_jiffies:.0f}% of the "
                f"{time.monotonic() - self.started:.0f} s run, and taken by the host (steal) "
                f"{100 * stolen / total_jiffies:.0f}% (everything on the machine, not only the tests)"
            )
        return out


def start(item: pytest.Item) -> None:
    item.stash[_STARTED] = cpu_seconds()


def teardown_starts(item: pytest.Item, *, last: bool) -> None:
    """``last``: no test follows in this process, so its teardown stops every session fixture too."""
    item.stash[_TEARDOWN] = (cpu_seconds(), last)


def released(item: pytest.Item, what: str, seconds: float) -> None:
    """Session fixtures (``what``) stopped after ``item`` cost ``seconds``."""
    item.stash.setdefault(_RELEASED, []).append((what, seconds))


def finish(item: pytest.Item, report: pytest.TestReport) -> None:
    """Puts the test's CPU seconds on its teardown report, which xdist carries to the controller, and
    those of the session fixtures stopped after it apart."""
    started = item.stash.get(_STARTED, None)
    if started is None:
        return
    now = cpu_seconds()
    fixtures = list(item.stash.get(_RELEASED, []))
    own = now - started - sum(seconds for _, seconds in fixtures)
    teardown_at, last = item.stash.get(_TEARDOWN, (now, False))
    if last:  # the teardown stopped every session fixture left: theirs, not the test's
        fixtures.append(("the rest, at the lane's end", own - (teardown_at - started)))
        own = teardown_at - started
    report.user_properties.append((CPU_PROPERTY, round(own, 2)))
    for what, seconds in fixtures:
        report.user_properties.append((FIXTURES_PROPERTY, (what, round(seconds, 2))))
