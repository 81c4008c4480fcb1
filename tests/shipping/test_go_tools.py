"""scripts/go-tools, the one build of every Go program the tests run: each program is where it says, is the
release it pins, and CoreDNS carries only the plugins the test clusters' Corefile names (CoreDNS's own build
has about fifty, with the AWS, Azure, GCP and Datadog SDKs under them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.gotools import SCRIPT, go_built

PROGRAMS = (
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy", "etcd",
    "helm", "prometheus", "promtool", "minio", "coredns", "kube-router",
)  # fmt: skip


def test_every_program_is_built_into_one_folder() -> None:
    go_built("coredns", unchecked="the Go tools' build")
    out = subprocess.run([SCRIPT, "--cached", *PROGRAMS], capture_output=True, text=True, check=True).stdout
    paths = [Path(line) for line in out.splitlines()]
    assert [p.name for p in paths] == list(PROGRAMS)
    assert len({p.parent for p in paths}) == 1, paths
    folder = subprocess.run([SCRIPT, "--cached"], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(folder) == paths[0].parent
    for p in paths:
        assert p.is_file(), p
        assert p.stat().st_mode & 0o111, p


def test_an_unknown_program_is_refused_with_the_names_there_are() -> None:
    result = subprocess.run([SCRIPT, "--cached", "kube-dns"], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert "no program 'kube-dns' here" in result.stderr
    assert "coredns" in result.stderr


def test_coredns_has_the_plugins_of_the_clusters_corefile_and_no_other() -> None:
    coredns = go_built("coredns", unchecked="the cluster DNS's build")
    listed = subprocess.run([coredns, "-plugins"], capture_output=True, text=True, check=True).stdout
    # The Corefile's four, and the three that kubernetes and cache register by importing them.
    corefile = {"bind", "errors", "cache", "kubernetes"}
    assert set(listed.split()) == corefile | {"metadata", "prometheus", "transfer"}, listed


def test_the_control_plane_is_the_pinned_release() -> None:
    pinned = re.search(r"PHALANX_K8S_VERSION:-(v[0-9.]+)", SCRIPT.read_text())
    assert pinned is not None
    for program in ("kube-apiserver", "kubelet", "kubectl"):
        path = go_built(program, unchecked="the control plane's build")
        argv = [path, "version", "--client"] if program == "kubectl" else [path, "--version"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert pinned.group(1) in out, (program, out)
