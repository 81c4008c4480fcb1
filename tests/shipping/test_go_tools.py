"""scripts/go-tools, the one build of every Go program the tests run: each program of the tests' set is where
it says and is the release it pins; the container nodes' set (`--nodes`: kubelet, CoreDNS, ...) is `make
e2e`'s, and e2e/test_node_programs.py checks it there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.gotools import SCRIPT, go_built

PROGRAMS = (
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "helm", "prometheus",
    "promtool", "minio", "scheduler-plugins",
)  # fmt: skip
NODE_PROGRAMS = ("kubelet", "kube-proxy", "coredns", "kube-router", "kueue")


def test_every_program_is_built_into_one_folder() -> None:
    go_built("kube-apiserver", unchecked="the Go tools' build")
    out = subprocess.run([SCRIPT, "--cached", *PROGRAMS], capture_output=True, text=True, check=True).stdout
    paths = [Path(line) for line in out.splitlines()]
    assert [p.name for p in paths] == list(PROGRAMS)
    assert len({p.parent for p in paths}) == 1, paths
    folder = subprocess.run([SCRIPT, "--cached"], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(folder) == paths[0].parent
    for p in paths:
        assert p.is_file(), p
        assert p.stat().st_mode & 0o111, p


def test_the_two_sets_are_every_program_there_is() -> None:
    """Every program the script knows is in one of the two sets: naming an unknown one lists them all."""
    result = subprocess.run([SCRIPT, "--cached", "kube-dns"], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert "no program 'kube-dns' here" in result.stderr
    listed = set(result.stderr.rsplit("(one of: ", 1)[1].rstrip(")\n").split())
    assert listed == set(PROGRAMS) | set(NODE_PROGRAMS), listed
    text = SCRIPT.read_text()
    for name, programs in (("TEST_PROGRAMS", PROGRAMS), ("NODE_PROGRAMS", NODE_PROGRAMS)):
        declared = re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE)
        assert declared is not None, name
        assert declared.group(1).split() == list(programs), (name, declared.group(1))


def test_an_unknown_option_is_refused() -> None:
    result = subprocess.run([SCRIPT, "--nodez"], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert "no option '--nodez'" in result.stderr


def test_the_control_plane_is_the_pinned_release() -> None:
    pinned = re.search(r"PHALANX_K8S_VERSION:-(v[0-9.]+)", SCRIPT.read_text())
    assert pinned is not None
    for program in ("kube-apiserver", "kubectl"):
        path = go_built(program, unchecked="the control plane's build")
        argv = [path, "version", "--client"] if program == "kubectl" else [path, "--version"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert pinned.group(1) in out, (program, out)
