"""phalanx on the Pythons vendor images bring: NGC's PyTorch images and Ubuntu 24.04 have CPython 3.12, Debian
trixie 3.13 (`make test` itself runs on 3.11, bookworm's). For each, scripts/other-pythons installs the wheel
scripts/dist builds for that Python (from the source distribution, as a user's `pip install` would) into an
environment of its own; here that wheel is checked (its tag, the C interval writer inside, this checkout's
code) and the tests of what differs between Pythons run against it: the C writer (built for the
interpreter's ABI) against the reference Python writer, and a real master process (gRPC streams, FastAPI,
its durable state) with real agents, SIGKILLed and restarted."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("3.12", "3.13")
TESTS = (
    "tests/agent/test_ring_writers.py",
    "tests/agent/test_intervals_ring.py",
    # A real master process: rendezvous, a failure and a new round over gRPC, the HTTP API and its refusals,
    # a SIGKILLed master resuming from its state file.
    "tests/master/test_master_process.py::test_two_agents_rendezvous_fail_rejoin_complete",
    "tests/master/test_master_process.py::test_auth_and_malformed_requests_are_refused_and_master_keeps_serving",
    "tests/master/test_master_process.py::test_kill9_master_resumes_same_round_without_new_round",
)
# These need torch (a process group's name) or build the wheel themselves (done here, per Python, already).
NEEDS_TORCH_OR_BUILDS = (
    "tests/agent/test_ring_writers.py::test_a_torch_process_group_is_named_by_its_ranks",
    "tests/agent/test_ring_writers.py::test_the_wheel_carries_the_c_writer_and_is_pure_python_without_a_compiler",
)


def _python(version: str) -> Path:
    python = ROOT / f".venv-py{version}" / "bin" / "python"
    if not python.exists():
        message = f"no environment of Python {version} in {python.parent.parent}: run scripts/other-pythons"
        if os.environ.get("CI"):
            pytest.fail(message + " (make test does)")
        pytest.skip(message)
    return python


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return h.hexdigest()


@pytest.mark.parametrize("version", VERSIONS)
def test_the_wheel_for_the_python_is_this_checkouts_with_the_c_writer(version: str) -> None:
    python = _python(version)
    tag = "cp" + version.replace(".", "")
    (wheel,) = (python.parent.parent / "dist").glob("phalanx-*.whl")
    assert f"-{tag}-{tag}-" in wheel.name, wheel.name
    probe = subprocess.run(
        [str(python), "-I", "-c",
         "import sys, phalanx, phalanx._ringwrite as w; "
         "print(sys.version.split()[0]); print(phalanx.__file__); print(w.__file__)"],
        capture_output=True, text=True, check=True, timeout=60, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    assert probe[0].startswith(version + "."), probe
    package = Path(probe[1]).parent
    assert package.is_relative_to(python.parent.parent), f"phalanx imported from {package}, not the wheel's"
    assert Path(probe[2]).name.startswith(f"_ringwrite.cpython-{tag[2:]}-"), probe[2]
    installed = {str(p.relative_to(package)): p.read_bytes() for p in package.rglob("*.py")}
    source = ROOT / "src" / "phalanx"
    checkout = {str(p.relative_to(source)): p.read_bytes() for p in source.rglob("*.py")}
    assert _digest(installed) == _digest(checkout), "a stale wheel: run scripts/other-pythons"
    (sdist,) = (python.parent.parent / "dist").glob("phalanx-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"hatch_build.py", "src/phalanx/_ringwrite.c", "pyproject.toml"} <= names
    assert not any(n.endswith(".so") for n in names), "a compiled extension in the source distribution"


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_c_writer_and_a_real_master_pass_their_tests_on_the_python(version: str) -> None:
    python = _python(version)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_XDIST_WORKER")}
    run = subprocess.run(
        [str(python), "-m", "pytest", *TESTS, *(f"--deselect={t}" for t in NEEDS_TORCH_OR_BUILDS),
         "-p", "no:cacheprovider", "-q", "-n", "0", "--timeout", "120"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = next(line for line in reversed(run.stdout.splitlines()) if re.search(r"\d+ passed", line))
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 20, summary  # type: ignore[union-attr]
    assert not re.search(r"failed|error|skipped", summary), summary


def test_pip_keeps_a_vendor_images_own_torch_build(tmp_path: Path) -> None:
    """NGC's images carry torch builds versioned as pre-releases of the next minor release (2.10.0a0+<commit>
    on NGC 25.10): pip installing phalanx[train] there must keep that torch, not download one. The vendor's
    build is stood in for by its metadata (what pip decides on); the rest of the environment is the 3.12 one,
    phalanx's wheel included."""
    python = _python("3.12")
    image = tmp_path / "ngc"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(image)], check=True, timeout=60)
    (site,) = image.glob("lib/python3.12/site-packages")
    (wheel_env,) = python.parent.parent.glob("lib/python3.12/site-packages")
    (site / "zz_wheel_env.pth").write_text(f"{wheel_env}\n")
    vendor = "2.10.0a0+ecf3bae40a.nv25.10"
    info = site / f"torch-{vendor}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {vendor}\n")
    (info / "RECORD").write_text("")
    for name in ("numpy", "safetensors"):  # the extra's other packages, as the image has them
        info = site / f"{name}-2.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.0.0\n")
        (info / "RECORD").write_text("")
    plan = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(image / "bin" / "python"), "install", "--dry-run",
         "--no-index", "--disable-pip-version-check", "phalanx[train]"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert re.search(rf"Requirement already satisfied: torch\S* in .*\({re.escape(vendor)}\)", plan.stdout), (
        plan.stdout[-3000:]
    )
    assert "Would install" not in plan.stdout, plan.stdout[-2000:]
