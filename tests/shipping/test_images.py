"""The container images, built for real by scripts/images (buildah, a debootstrap base, no registry), and run.

`make test` builds them before pytest (scripts/prepare-tests, `scripts/images --no-export`: buildah runs them
here, only container nodes import their tarballs, which e2e/test_image_archives.py checks), so the fixture
below finds them warm and returns in a second or two; run alone on a cold machine it builds them (~10
minutes on 2 cores). Without root, buildah or
debootstrap the tests skip with a loud reason, except under CI=true, where that is a failure
(scripts/host-packages installs what is missing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.eventually import eventually

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "images"
NAMES = ("phalanx", "phalanx-train", "phalanx-pause", "phalanx-as-root")
# A cold build: debootstrap, the torch layer (~6 GB unpacked), exports; far more on a busy 2-core machine.
COLD_BUILD_S = 3000

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"IMAGES CANNOT BE BUILT: {reason} (CI=true: a skipped image test is a failure)")
    pytest.skip(f"IMAGES CANNOT BE BUILT: {reason}")


def buildah(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """buildah on scripts/images' own storage."""
    flags = subprocess.run(
        [str(SCRIPT), "--buildah-flags"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return subprocess.run(
        ["buildah", *flags, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def images() -> dict[str, dict[str, str]]:
    if os.geteuid() != 0:
        _missing("not root (debootstrap and buildah's storage need it)")
    for tool in ("buildah", "debootstrap"):
        if not shutil.which(tool):
            _missing(f"no {tool}: run scripts/host-packages (as root) or `make host-packages`")
    result = subprocess.run(
        [str(SCRIPT), "--json", "--no-export"],
        capture_output=True,
        text=True,
        timeout=COLD_BUILD_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    built: dict[str, dict[str, str]] = json.loads(result.stdout)
    return built


def run_in(image: str, *command: str, user: str = "10001:10001", timeout: float = 300) -> str:
    """Run a command in a fresh container of the image (buildah from + run, runc isolation), as `user`."""
    created = buildah("from", "--pull=never", "--quiet", f"localhost/{image}")
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    try:
        ran = buildah("run", "--user", user, container, "--", *command, timeout=timeout)
        assert ran.returncode == 0, f"{command} in {image}: {ran.stderr[-3000:]}"
        return ran.stdout
    finally:
        buildah("rm", container)


@pytest.mark.timeout(COLD_BUILD_S + 60)
def test_each_image_is_stored_under_its_ref_and_its_id(images: dict[str, dict[str, str]]) -> None:
    assert set(images) == set(NAMES)
    for name, image in images.items():
        ref = image["ref"]
        repo, _, tag = ref.partition(":")
        assert repo == name
        version, _, digest = tag.rpartition("-")
        assert version, f"{ref}: the tag is <version>-<hash of the inputs>"
        assert len(digest) == 12, f"{ref}: the tag is <version>-<hash of the inputs>"
        stored = buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", f"localhost/{ref}")
        assert stored.returncode == 0, stored.stderr
        assert stored.stdout.strip() == image["id"], ref


@pytest.mark.timeout(COLD_BUILD_S + 60)
def test_a_warm_run_returns_at_once_with_the_same_images(images: dict[str, dict[str, str]]) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [str(SCRIPT), "--no-export"], capture_output=True, text=True, timeout=120, check=False
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert lines == {
        name: f"{i['ref']} {i['tarball']}" if i["tarball"] else i["ref"] for name, i in images.items()
    }
    assert elapsed < 15, f"a warm scripts/images took {elapsed:.1f} s"


@pytest.mark.timeout(COLD_BUILD_S + 300)
def test_base_image_runs_phalanx_as_uid_10001_without_torch(images: dict[str, dict[str, str]]) -> None:
    ref = images["phalanx"]["ref"]
    assert "usage" in run_in(ref, "phalanx", "--help").lower()
    out = run_in(
        ref,
        "python",
        "-c",
        "import os, importlib.util, phalanx, kubernetes; "
        "print(os.getuid(), os.getgid(), importlib.util.find_spec('torch') is None)",
    )
    assert out.split() == ["10001", "10001", "True"]


@pytest.mark.timeout(COLD_BUILD_S + 60)
def test_the_as_root_image_is_the_base_image_with_root_as_its_user(images: dict[str, dict[str, str]]) -> None:
    """What a vendor image looks like to the kubelet (the e2e scenario of a root image runs it): the base
    image's layers, its user root."""

    def inspect(name: str) -> dict[str, Any]:
        out = buildah("inspect", "--type", "image", f"localhost/{images[name]['ref']}").stdout
        return json.loads(out)["OCIv1"]

    base, as_root = inspect("phalanx"), inspect("phalanx-as-root")
    assert base["config"]["User"] == "10001:10001"
    assert as_root["config"]["User"] == "0:0"
    diffs = as_root["rootfs"]["diff_ids"]
    assert diffs[: len(base["rootfs"]["diff_ids"])] == base["rootfs"]["diff_ids"]


@pytest.mark.timeout(COLD_BUILD_S + 300)
def test_train_image_imports_torch_and_phalanx_as_uid_10001(images: dict[str, dict[str, str]]) -> None:
    out = run_in(
        images["phalanx-train"]["ref"],
        "python",
        "-c",
        "import os, torch, phalanx, numpy, safetensors, phalanx.intervals as iv; t = torch.ones(4) * 2; "
        "print(os.getuid(), torch.__version__, float(t.sum()), iv.collective.__module__)",
    )
    uid, version, total, collective = out.split()
    assert uid == "10001"
    assert collective == "phalanx._ringwrite"  # the recorder's C write path was built into the image's wheel
    venv_torch = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version.split("+")[0] == venv_torch.split("+")[0], "the image has the torch the tests ran"
    assert float(total) == 8.0


@pytest.mark.timeout(COLD_BUILD_S + 60)
def test_train_image_has_the_libraries_nccl_needs_for_infiniband_and_roce(
    images: dict[str, dict[str, str]],
) -> None:
    """NCCL dlopens libibverbs.so.1 (and librdmacm for RoCE) and the device's provider; without them it uses
    TCP sockets without a word. The worker's user must find them, and the Mellanox/NVIDIA (mlx5) and AWS
    (efa) providers among them."""
    out = run_in(
        images["phalanx-train"]["ref"],
        "python",
        "-c",
        "import ctypes, glob; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('librdmacm.so.1'); "
        "print(' '.join(sorted(glob.glob('/usr/lib/*/libibverbs/lib*-rdmav*.so'))))",
    )
    providers = {path.rsplit("/", 1)[1].split("-rdmav")[0] for path in out.split()}
    assert {"libmlx5", "libefa"} <= providers, providers


@pytest.fixture
def pause_binary(images: dict[str, dict[str, str]], tmp_path: Path) -> Path:
    """The /pause program, copied out of the pause image (what a node would run)."""
    created = buildah("from", "--pull=never", "--quiet", f"localhost/{images['phalanx-pause']['ref']}")
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    try:
        mounted = buildah("mount", container)
        assert mounted.returncode == 0, mounted.stderr
        files = sorted(p.name for p in Path(mounted.stdout.strip()).iterdir())
        assert "pause" in files
        out = tmp_path / "pause"
        shutil.copy2(Path(mounted.stdout.strip()) / "pause", out)
        config = json.loads(buildah("inspect", "--type", "container", container).stdout)
        assert config["OCIv1"]["config"]["Entrypoint"] == ["/pause"]
        assert config["OCIv1"]["config"]["User"] == "65535:65535"
    finally:
        buildah("umount", container)
        buildah("rm", container)
    return out


@pytest.mark.timeout(COLD_BUILD_S + 60)
def test_pause_is_static_exits_on_sigterm_and_reaps_orphans(pause_binary: Path) -> None:
    with pause_binary.open("rb") as f:
        assert f.read(4) == b"\x7fELF"
    assert b"/lib64/ld-linux" not in pause_binary.read_bytes(), "pause must be static (FROM scratch)"
    if not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("no unshare/nsenter to give pause a PID namespace")
    # pause as PID 1 of a PID namespace, as in a Pod sandbox.
    with subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", str(pause_binary)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            pause_pid = eventually(
                lambda: next((pid for pid, name in _children_of(proc.pid) if name == pause_binary.name), 0),
                timeout=10,
                what=f"{pause_binary.name} starting under {proc.pid}",
            )
            # An orphan in the namespace: sh starts a sleep and exits at once, so the sleep is re-parented
            # to PID 1 (pause); killed, it stays a zombie until pause reaps it, as only pause can.
            subprocess.run(
                ["nsenter", "-t", str(pause_pid), "-p", "--", "sh", "-c", "sleep 60 & exit 0"],
                check=True,
                timeout=10,
            )
            orphan = eventually(
                lambda: next((pid for pid, name in _children_of(pause_pid) if name == "sleep"), 0),
                timeout=10,
                what="the orphan re-parented to pause",
            )
            os.kill(orphan, signal.SIGKILL)
            eventually(
                lambda: not _children_of(pause_pid),
                timeout=10,
                what="pause reaping its orphan, a zombie until then",
            )
            os.kill(pause_pid, signal.SIGTERM)
            _, stderr = proc.communicate(timeout=10)
            assert proc.returncode == 0
            assert "Shutting down, got signal: terminated" in stderr
        finally:
            if proc.poll() is None:
                proc.kill()


def _children_of(parent: int) -> list[tuple[int, str]]:
    """(pid, name) of each process whose parent is ``parent``, zombies included."""
    children = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(parent):
            children.append((int(status.parent.name), fields.get("Name", "").strip()))
    return children
