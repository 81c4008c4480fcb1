"""Tools tests run for real (helm, prometheus, promtool, minio), built from the Go module proxy by
``scripts/<name>`` and cached under ~/.cache/phalanx/tools."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def go_built(script: str, *, cached: str, unchecked: str) -> str:
    """What ``scripts/<script>`` prints last (the built tool's path), building it on first use. Without Go
    and without a cached build (``cached``: a glob under the tools cache) the test skips with a loud reason
    saying what goes ``unchecked``, except under CI=true, where it fails."""
    has_go = shutil.which("go") or Path("/usr/local/go/bin/go").exists()
    tools = Path(os.environ.get("PHALANX_TOOLS_CACHE", Path.home() / ".cache/phalanx/tools"))
    if not has_go and not list(tools.glob(cached)):
        message = f"no Go toolchain and no cached build: {unchecked} (run scripts/{script})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: a skipped check is a failure)")
        pytest.skip(message)
    result = subprocess.run(
        [str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=880, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]
