"""The master's state file on a disk that fills up: a small tmpfs mounted for the test, filled for real.

A save that does not fit must fail with StateStoreError and leave the previous state loadable; before the
fix, ``os.write`` wrote what fit, the short count went unnoticed and the torn file replaced the good one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.api.errors import StateStoreError
from phalanx.master.store.stores import FileStateStore

PAGE = 4096


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill it needs root (the test fills a real filesystem)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path, *, leave: int) -> None:
    """Fills the filesystem of ``directory`` to the last byte, then frees ``leave`` bytes (whole pages)."""
    spare = directory / "spare"
    spare.write_bytes(b"s" * leave)
    with (directory / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"f" * PAGE)
    with pytest.raises(OSError) as full:
        (directory / "probe").write_bytes(b"x" * PAGE)
    assert full.value.errno == errno.ENOSPC
    (directory / "probe").unlink(missing_ok=True)
    spare.unlink()


def test_a_full_disk_keeps_the_previous_state(tiny_fs: Path) -> None:
    store = FileStateStore(tiny_fs / "state.json")
    good = {"job_id": "j", "round": {"number": 3}, "nodes": {"n0": "x" * 100}}
    store.save(good)
    bigger = {**good, "round": {"number": 4}, "nodes": {f"n{i}": "y" * 200 for i in range(100)}}  # ~22 KB
    fill(tiny_fs, leave=PAGE)  # room for the first page of the new state only: a short write

    with pytest.raises(StateStoreError, match="previous state is kept"):
        store.save(bigger)

    assert store.load() == good
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["filler", "state.json"]  # no temp file left
    (tiny_fs / "filler").unlink()  # room again: the next save goes through
    store.save(bigger)
    assert store.load() == bigger
