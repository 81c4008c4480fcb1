"""The installed entry points answer --version and --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import phalanx

BIN = Path(sys.executable).parent


def test_phalanx_version() -> None:
    out = subprocess.run([BIN / "phalanx", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"phalanx {phalanx.__version__}"


def test_phalanx_help_lists_commands() -> None:
    out = subprocess.run([BIN / "phalanx", "--help"], capture_output=True, text=True, check=True)
    assert "usage: phalanx" in out.stdout


def test_phalanx_without_a_command_prints_help_and_fails() -> None:
    out = subprocess.run([BIN / "phalanx"], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "usage: phalanx" in out.stdout


def test_python_dash_m_phalanx() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "--version"], capture_output=True, text=True, check=True
    )
    assert phalanx.__version__ in out.stdout
