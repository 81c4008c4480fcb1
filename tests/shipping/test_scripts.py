"""The repository's Python scripts start as a person runs them: outside pytest, from any directory, with only
the venv's Python (no `tests` or `src` on the path). `make k8s-up` once failed so while CI stayed green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.name for p in (ROOT / "scripts").iterdir() if p.read_text().startswith("#!/usr/bin/env python")
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_from_anywhere(script: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout, result.stdout


def test_k8s_cluster_is_among_them() -> None:
    assert {"k8s-cluster", "export-requirements"} <= set(SCRIPTS)
