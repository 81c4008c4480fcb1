"""The Go programs tests run for real (helm, prometheus, promtool, minio, and the clusters' own), built from
the Go module proxy by ``scripts/go-tools`` and cached under ~/.cache/phalanx/go-tools."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "go-tools"


def cached(name: str = "") -> Path | None:
    """``name``'s path (the bin folder for ""), when the cache holds this checkout's build; None otherwise."""
    result = subprocess.run(
        [str(SCRIPT), "--cached", *([name] if name else [])], capture_output=True, text=True, check=False
    )
    return Path(result.stdout.split()[-1]) if result.returncode == 0 else None


def go_built(name: str, *, unchecked: str) -> str:
    """``name``'s path, building every Go tool on first use (``make test`` builds them before pytest starts).
    Without Go and without a cached build the test skips with a loud reason saying what goes ``unchecked``,
    except under CI=true, where it fails."""
    has_go = shutil.which("go") or Path("/usr/local/go/bin/go").exists()
    if not has_go and cached(name) is None:
        message = f"no Go toolchain and no cached build: {unchecked} (run scripts/go-tools)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: a skipped check is a failure)")
        pytest.skip(message)
    result = subprocess.run([str(SCRIPT), name], capture_output=True, text=True, timeout=3600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]
