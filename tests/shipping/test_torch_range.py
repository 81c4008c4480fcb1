"""The torch range the training side supports, tested at both ends: everything else in `make test` runs on the
newest torch (the lock's); here the training-side tests run again on the oldest (pyproject.toml's dependency
group torch-oldest, in the environment scripts/torch-oldest makes), and pip installing phalanx[train] where
that torch is installed keeps it, as it keeps a vendor image's own torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / ".venv-torch-oldest"
# The tests that touch torch's own API: the flash checkpoint and DCP (tests/checkpoint), the trainer's
# in-process regroup (tests/trainer), and the instrumentation of scripts that never import phalanx: steps from
# the optimizer's hooks, collectives from c10d's, the flight recorder, hang verdicts (tests/agent, and
# tests/local/test_unmodified_script.py under `phalanx local`).
TRAINING_SIDE = ("tests/checkpoint", "tests/trainer", "tests/agent", "tests/local/test_unmodified_script.py")
# Tests there of phalanx's own machinery, not of torch's API (the agent's restarts around a checkpoint, its
# launcher, its link to the master, the wheel's build, faults injected without instrumentation): run on the
# newest torch only, to keep this run short.
NOT_TORCH = (
    "tests/agent/test_agent_checkpointing.py",
    "tests/agent/test_checkpoint_integration.py",
    "tests/agent/test_run.py",
    "tests/agent/test_master_link.py",
    "tests/agent/test_link_stream.py",
    "tests/agent/test_ring_writers.py::test_the_wheel_carries_the_c_writer_and_is_pure_python_without_a_compiler",
    "tests/trainer/test_elastic_local.py",  # phalanx local around the regroup test_elastic.py runs here
    "tests/local/test_unmodified_script.py::test_no_instrument_leaves_an_unmodified_script_unseen",
    # The optimizer's step hooks are what the idle-floor test here judges by; this one adds phalanx status.
    "tests/local/test_unmodified_script.py::test_phalanx_status_shows_the_steps_and_step_times_of_an_unmodified_script",
    "tests/local/test_unmodified_script.py::test_a_time_based_fault_fires_on_a_script_that_reports_nothing",
    "tests/local/test_unmodified_script.py::test_a_fault_that_never_fires_fails_the_run",
)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _train_torch() -> Requirement:
    train = _pyproject()["project"]["optional-dependencies"]["train"]
    return next(r for r in map(Requirement, train) if r.name == "torch")


def _oldest_pin() -> str:
    group = _pyproject()["dependency-groups"]["torch-oldest"]
    torch = next(Requirement(r) for r in group if isinstance(r, str) and r.startswith("torch"))
    (spec,) = torch.specifier
    assert spec.operator == "==", f"the oldest torch is pinned exactly, not {spec}"
    return spec.version


def _oldest_python() -> Path:
    python = ENV / "bin" / "python"
    if not python.exists():
        message = f"no environment of the oldest torch in {ENV}: run scripts/torch-oldest (make test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def test_the_oldest_torch_is_the_low_end_of_the_train_extras_range() -> None:
    python = _oldest_python()
    installed = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    oldest = _oldest_pin()
    assert installed.split("+")[0] == oldest, f"{ENV} has torch {installed}: run scripts/torch-oldest"
    train = _train_torch()
    lower = next(s for s in train.specifier if s.operator == ">=")
    assert oldest.startswith(lower.version + "."), f"the range {train.specifier} starts below {oldest}"
    assert train.specifier.contains(oldest)
    import torch

    assert train.specifier.contains(torch.__version__.split("+")[0]), "the lock's torch is outside the range"


def test_pip_installing_phalanx_train_keeps_the_supported_torch_it_finds() -> None:
    """pip, asked for phalanx[train] with nothing to download from, finds the installed torch within the
    extra's range and plans no install: a vendor image's torch in the range is kept the same way."""
    python = _oldest_python()
    plan = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--no-index",
         "--disable-pip-version-check", "phalanx[train]"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    kept = re.search(
        r"Requirement already satisfied: torch(\S*) in .*\(from phalanx\[train\]\) \((\S+)\)", plan.stdout
    )
    assert kept is not None, plan.stdout[-3000:]
    assert kept.group(2) == _oldest_pin(), kept.group(0)
    assert "Would install" not in plan.stdout, plan.stdout[-2000:]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_training_side_tests_pass_on_the_oldest_torch() -> None:
    python = _oldest_python()
    run = subprocess.run(
        [str(python), "-m", "pytest", *TRAINING_SIDE, *(f"--deselect={test}" for test in NOT_TORCH),
         "-p", "no:cacheprovider", "-q", "-n", "2", "--timeout", "300"],
        cwd=ROOT, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None, summary
    assert int(passed.group(1)) >= 100, summary
    assert "failed" not in summary, summary
    assert "error" not in summary, summary
