"""Fixtures shared by the test packages."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from phalanx.api.ports import free_port as _free_port
from tests import cpu_usage, release
from tests.eventually import eventually
from tests.gotools import go_built

MINIO_USER, MINIO_PASSWORD = "phalanx-test", "phalanx-test-secret"

CLUSTER_PATHS = ("tests/k8s/", "e2e/")


def _lane_unit(nodeid: str) -> str:
    """What runs whole in one lane of `make test`'s parallel run: a test module, so that its module
    fixtures start once, or every test of one Kubernetes cluster (the control plane and test kubelet of
    tests/k8s; the container nodes of e2e), so that each cluster starts once and stops after its last test
    (tests/release.py). The two clusters share nothing (ports are free ports, the container nodes are e2e's
    alone) and run in two lanes at once: in one lane, one after the other, they were the run's critical path
    (1,104 s of an 1,122 s run, with the machine's CPUs 66 % busy)."""
    for folder in CLUSTER_PATHS:
        if nodeid.startswith(folder):
            return f"cluster {folder}"
    return nodeid.partition("::")[0]


def _in_cluster(nodeid: str) -> bool:
    return nodeid.startswith(CLUSTER_PATHS)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist hands out the units above (its own ``xdist_group`` marks are lost on pytest 9.2, which
    no longer reads the node ids xdist rewrites), in the order collection left them (below): its own
    reordering, by number of tests, would put a module of many short tests before a cluster."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _lane_unit(nodeid)

    config.option.loadscopereorder = False
    return Lanes(config, log)


LONG_UNITS_S = {
    "tests/shipping/test_torch_range.py": 258,
    "tests/local/test_slow_nodes.py": 214,
    "tests/agent/test_checkpoint_integration.py": 206,
    "tests/local/test_faults.py": 162,
    "tests/diagnostics/test_allgather_probe.py": 129,
    "tests/local/test_frameworks.py": 121,
    "tests/local/test_network.py": 118,
    "tests/local/test_unmodified_script.py": 102,
    "tests/diagnostics/test_warm_probes.py": 80,
    "tests/trainer/test_elastic_local.py": 77,
    "tests/local/test_hang_evidence.py": 72,
    "tests/master/test_connection_flood.py": 62,
}
"""The units outside the clusters that took longest, in seconds (a cold `make test` on the 2-core machine,
2026-12-02; every other took under a minute): handed out first, longest first. In collection order, the
oldest torch's run (two tests) started last and ran alone at the end: that run's lanes ended 1,004, 1,051 and
1,182 s in. A hint for the order only; `.pytest_cache/last-run.xml` has every test's time to renew it."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The clusters' units are the longest, e2e's first, so they start at once; then the long units above,
    longest first; then the units with the most tests. The other lanes take the rest meanwhile, instead of
    idling through a long unit's tail."""
    sizes = Counter(_lane_unit(item.nodeid) for item in items)

    def order(item: pytest.Item) -> tuple[int, int, int, str]:
        unit = _lane_unit(item.nodeid)
        rank = 0 if unit == "cluster e2e/" else 1 if _in_cluster(item.nodeid) else 2
        return rank, -LONG_UNITS_S.get(unit, 0), -sizes[unit], unit

    items.sort(key=order)


_CPU = cpu_usage.Report()
"""The CPU seconds of every test, summed by module and printed at the end of the run (tests/cpu_usage.py)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    cpu_usage.start(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if call.when == "teardown":
        cpu_usage.finish(item, report)
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    cpu_usage.teardown_starts(item, last=nextitem is None)


@pytest.hookimpl(specname="pytest_runtest_teardown", trylast=True)  # after the test's own fixtures' teardown
def pytest_runtest_teardown_release(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    before = cpu_usage.cpu_seconds()
    if stopped := release.leaving(item.nodeid, nextitem.nodeid if nextitem is not None else None):
        cpu_usage.released(item, " and ".join(stopped), cpu_usage.cpu_seconds() - before)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _CPU.timed(report, cluster=_in_cluster(report.nodeid))
    if report.when == "teardown":
        _CPU.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _CPU.by_module:
        terminalreporter.section("CPU time")
        for line in _CPU.lines():
            terminalreporter.write_line(line)


@contextlib.contextmanager
def minio_server(data: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A MinIO server on loopback storing under ``data``; yields its endpoint URL and process."""
    binary = go_built("minio", unchecked="S3 checkpoint storage unchecked")
    port = _free_port()
    env = {
        **os.environ,
        "MINIO_ROOT_USER": MINIO_USER,
        "MINIO_ROOT_PASSWORD": MINIO_PASSWORD,
        "MINIO_BROWSER": "off",
    }
    log_path = data.parent / f"{data.name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [binary, "server", str(data), "--address", f"127.0.0.1:{port}", "--quiet"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:

        def started() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return _live(endpoint)

        eventually(started, timeout=60, what="MinIO serving", interval=0.2)
        yield endpoint, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)  # a test that stopped it, to play a storage outage
        proc.terminate()
        proc.wait(20)


def aws_env(endpoint: str) -> dict[str, str]:
    """The standard variables that point boto3 at a MinIO server, as a Pod would set them."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": MINIO_USER,
        "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD,
        "AWS_REGION": "us-east-1",
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Sets variables in this process's environment (boto3 reads them there) and restores them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A MinIO server on loopback; yields its endpoint URL. boto3 finds it through the standard variables,
    as a Pod would (set for the session's tests, and inherited by the processes they start)."""
    with minio_server(tmp_path_factory.mktemp("minio")) as (endpoint, _), environment(aws_env(endpoint)):
        yield endpoint


def _live(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/minio/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
