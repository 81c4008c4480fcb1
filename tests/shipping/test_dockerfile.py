"""Static checks of the Dockerfile and .dockerignore: what would break `docker build` or ship a bad image.

No Docker engine runs on the development machines, so these read the files and compare them with the
repository: COPY sources exist and are in the build context, the targets exist, extras exist in
pyproject.toml, the runtime user is not root, nothing is fetched with ADD.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from phalanx.operator import builders
from tests.shipping.dockerfile import DockerIgnore, Stage, copy_sources, exec_form, files_under, stages

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "Dockerfile").read_text()
STAGES = {s.name: s for s in stages(TEXT)}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IGNORE = DockerIgnore((ROOT / ".dockerignore").read_text())


def _chain(name: str) -> list[Stage]:
    """The stage and the stages it builds FROM, nearest first."""
    chain = []
    while name in STAGES:
        chain.append(STAGES[name])
        name = STAGES[name].base
    return chain


def _last(name: str, keyword: str) -> str | None:
    for stage in _chain(name):
        for kw, args in reversed(stage.instructions):
            if kw == keyword:
                return args
    return None


def _installed_extras(name: str) -> set[str]:
    extras: set[str] = set()
    for stage in _chain(name):
        for kw, args in stage.instructions:
            if kw == "RUN" and "pip install" in args:
                # `pip install "${wheel}[a,b]"`, `pip install ".[a]"` or `pip install x.whl[a]`
                for group in re.findall(r"(?:\}|\.whl|\.)\[([\w,\s-]+)\]", args):
                    extras.update(e.strip() for e in group.split(",") if e.strip())
    return extras


def test_targets_and_base_images() -> None:
    assert {"base", "train"} <= STAGES.keys()
    # Both targets build on the same `runtime` stage (the Python base and the uid), not on each other: train
    # puts torch below the phalanx wheel, so that a source change never rebuilds the torch layer.
    assert "runtime" in {s.name for s in _chain("base")}
    assert "runtime" in {s.name for s in _chain("train")}
    arg = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", TEXT, flags=re.MULTILINE)
    assert arg
    # The public slim image by its exact tag (a patch release and a Debian release), or by digest.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", arg[1]), (
        f"PYTHON_IMAGE={arg[1]} is not pinned"
    )
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, arg[1].split(":")[1].split("-")[0].split("."))) >= tuple(
        map(int, minimum.split("."))
    )
    for stage in STAGES.values():
        assert stage.base in STAGES or stage.base in ("${PYTHON_IMAGE}", "scratch"), (
            f"{stage.name}: unpinned base {stage.base}"
        )


def test_torch_layer_comes_before_anything_of_the_repository() -> None:
    """The torch layer's stage and its ancestors copy nothing from the build context or the wheel stage but
    the lock's torch pins (requirements/torch.txt)."""
    chain = _chain("train")
    names = [s.name for s in chain]
    assert "torch" in names
    wheel_copy = next(
        i
        for i, s in enumerate(chain)
        for kw, args in s.instructions
        if kw == "COPY" and "--from=wheel" in args
    )
    assert wheel_copy < names.index("torch"), "the wheel must be copied above the torch layer"
    for stage in _chain("torch"):
        for kw, args in stage.instructions:
            if kw == "COPY":
                assert copy_sources(args) == (["requirements/torch.txt"], False), f"{stage.name}: COPY {args}"
            if kw == "RUN":
                mounts = re.findall(r"--mount=(\S+)", args)
                assert all("from=torch-wheels" in m for m in mounts), mounts
    runs = [args for kw, args in STAGES["torch"].instructions if kw == "RUN"]
    assert len(runs) == 1, "torch is installed in one layer"
    # Offline from a bind-mounted wheel folder (TORCH_FROM=wheels), else from the index: the lock's files.
    assert "--mount=type=bind,from=torch-wheels" in runs[0]
    assert "--no-index --find-links /tmp/torch-wheels --require-hashes --no-deps -r /tmp/torch.txt" in runs[0]
    assert STAGES["torch-wheels"].base == "scratch"
    assert not STAGES["torch-wheels"].instructions, "an empty stage that --build-context replaces"


def test_every_install_is_locked() -> None:
    """Each `pip install` takes the lock's exported files by hash, or the phalanx wheel with no index (which
    fails if the lock left out anything the wheel needs); the one exception is a torch build from another
    index that the builder asks for by TORCH_INDEX_URL."""
    installs = [
        line.strip()
        for stage in STAGES.values()
        for kw, args in stage.instructions
        if kw == "RUN"
        for line in re.split(r";|&&", args)
        if "pip install" in line
    ]
    assert installs
    for line in installs:
        locked = "--require-hashes --no-deps -r /tmp/" in line
        wheel = '--no-index "${wheel}[' in line
        other_torch = '--extra-index-url "${TORCH_INDEX_URL}" -r /tmp/pins.txt' in line
        assert locked or wheel or other_torch, f"an install outside the lock: {line}"
    exported = {p.name for p in (ROOT / "requirements").glob("*.txt")}
    copied = {
        Path(src).name
        for stage in STAGES.values()
        for kw, args in stage.instructions
        if kw == "COPY"
        for src in copy_sources(args)[0]
        if src.startswith("requirements/")
    }
    assert copied == exported == {"base.txt", "torch.txt", "train.txt", "build.txt"}
    assert "--no-build-isolation" in TEXT, "the wheel is built by the locked hatchling, not the newest one"


def test_context_of_scripts_images_is_what_dockerignore_lets_in() -> None:
    """scripts/images hashes (for its tags) and stages exactly the files a `docker build .` would send."""
    listed = subprocess.run(
        [str(ROOT / "scripts" / "images"), "--context-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    admitted = {f for f in tracked if not IGNORE.excluded(f)} | {"Dockerfile", ".dockerignore"}
    assert admitted == {f for f in listed if f in tracked}


def _git_ignored(files: list[str]) -> set[str]:
    out = subprocess.run(
        ["git", "check-ignore", "--stdin"],
        cwd=ROOT, input="\n".join(files), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr  # 1: none of them is ignored
    return set(out.stdout.split())


def test_copy_sources_exist_and_are_in_the_build_context() -> None:
    copied: list[str] = []
    for stage in STAGES.values():
        for kw, args in stage.instructions:
            assert kw != "ADD", "use COPY (ADD fetches URLs and unpacks archives implicitly)"
            if kw != "COPY":
                continue
            sources, from_stage = copy_sources(args)
            if from_stage:
                continue
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
                files = files_under(ROOT, src)
                assert files, f"COPY {src}: empty"
                # Build products git ignores (bytecode, the C writer built in place) stay out on purpose.
                built = _git_ignored(files)
                excluded = [f for f in files if IGNORE.excluded(f) and f not in built]
                assert not excluded, f"COPY {src}: .dockerignore leaves out {excluded[:5]}"
                copied.append(src)
    # What the wheel build reads must be copied: the project table and the files it names.
    assert "pyproject.toml" in copied
    assert "src" in {c.rstrip("/") for c in copied}
    assert PYPROJECT["project"]["readme"] in copied


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/shipping/test_dockerfile.py",
        "charts/phalanx/Chart.yaml",
    ):
        assert IGNORE.excluded(path), path
    assert IGNORE.excluded("src/phalanx/__pycache__/x.cpython-311.pyc")
    assert not IGNORE.excluded("src/phalanx/__init__.py")


def test_extras_exist_and_base_stays_free_of_torch() -> None:
    optional = PYPROJECT["project"]["optional-dependencies"]
    base, train = _installed_extras("base"), _installed_extras("train")
    assert base
    assert train > base
    assert (base | train) <= optional.keys(), f"unknown extras {(base | train) - optional.keys()}"
    base_requirements = " ".join(
        PYPROJECT["project"]["dependencies"] + [r for e in base for r in optional[e]]
    )
    assert "torch" not in base_requirements, "the base image (operator, master) must not install torch"
    base_file = (ROOT / "requirements" / "base.txt").read_text()
    assert not re.search(r"^(torch|nvidia-)", base_file, flags=re.MULTILINE), (
        "requirements/base.txt has torch"
    )
    assert any(r.startswith("torch") for r in optional["train"])
    assert "train" in train


@pytest.mark.parametrize("target", ["base", "train"])
def test_runs_as_non_root_with_the_phalanx_entrypoint(target: str) -> None:
    user = _last(target, "USER")
    assert user is not None, f"{target}: no USER"
    assert user.split(":")[0] not in ("root", "0"), f"{target} runs as {user}"
    entrypoint = _last(target, "ENTRYPOINT")
    assert entrypoint is not None
    program = exec_form(entrypoint)[0]
    assert program in PYPROJECT["project"]["scripts"], f"{program} is not a console script of phalanx"
    assert program == "phalanx"
    # The uid the chart's securityContext names must be the image's.
    chart = (ROOT / "charts" / "phalanx" / "templates" / "deployment.yaml").read_text()
    uid = user.split(":")[0]
    assert f"runAsUser: {uid}" in chart
    # The group that may read the secrets mounted into the operator and the masters (fsGroup).
    gid = user.split(":")[1]
    assert f"fsGroup: {gid}" in chart
    assert str(builders.IMAGE_GID) == gid


@pytest.mark.parametrize("target", ["base", "train"])
def test_labels_name_the_image(target: str) -> None:
    labels = " ".join(args for kw, args in STAGES[target].instructions if kw == "LABEL")
    for key in ("title", "source", "licenses", "version"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'licenses="{PYPROJECT["project"]["license"]}"' in labels
    version = re.search(r"^ARG VERSION=(\S+)$", TEXT, flags=re.MULTILINE)
    assert version
    assert version[1] == PYPROJECT["project"]["version"]


def test_dockerignore_reader_follows_dockers_rules() -> None:
    rules = DockerIgnore("# comment\n**\n!src/\n**/*.pyc\n!src/keep.pyc\ndocs/*.md\n")
    assert rules.excluded("README.md")
    assert not rules.excluded("src/a/b.py")  # re-included folder covers what is inside
    assert rules.excluded("src/a/b.pyc")
    assert not rules.excluded("src/keep.pyc")  # the last matching pattern wins
    assert DockerIgnore("docs/*.md\n").excluded("docs/x.md")
    assert not DockerIgnore("docs/*.md\n").excluded("docs/sub/x.md")  # `*` stops at a slash
