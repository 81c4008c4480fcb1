"""Fixtures of the flash-checkpoint tests: a fresh job id per test, its storage directory, a real
checkpoint host, and a check that the job leaves nothing behind in /dev/shm."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.checkpoint import host as host_mod
from phalanx.checkpoint import shm

SHM = Path("/dev/shm")


def job_segments(job_id: str) -> list[str]:
    """The shared-memory files of a job (in this user's directory of /dev/shm)."""
    return [p.name for p in shm.job_files(SHM, job_id)]


@pytest.fixture
def job_id() -> Iterator[str]:
    """A unique job id; the test fails if any shared memory of the job is left behind."""
    job = f"t-{uuid.uuid4().hex[:10]}"
    yield job
    left = job_segments(job)
    for name in left:  # clean up before failing, so one bad test does not leak into the next
        (shm.private_dir(SHM) / name).unlink(missing_ok=True)
    assert not left, f"shared memory of job {job} left behind: {left}"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """The job's checkpoint storage directory."""
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def host(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[host_mod.HostHandle]:
    """A running checkpoint host, advertised in this process's environment; stopped at the end."""
    handle = host_mod.start(
        job_id=job_id, storage=str(store), keep_last=2, socket_path=tmp_path / "host.sock"
    )
    for key, value in handle.env().items():
        monkeypatch.setenv(key, value)
    yield handle
    handle.stop()


def worker_env(handle: host_mod.HostHandle, **extra: str) -> dict[str, str]:
    """Environment of a training subprocess that uses ``handle``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_CHECKPOINT_")}
    env.update(handle.env())
    env.update(extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
