"""The container nodes' programs of scripts/go-tools (`--nodes`, which `make e2e` builds for these
scenarios): the kubelet is the pinned release, and CoreDNS carries only the plugins the nodes' Corefile names
(CoreDNS's own build has about fifty, with the AWS, Azure, GCP and Datadog SDKs under them)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from tests.gotools import SCRIPT, go_built

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("PHALANX_E2E_KUBECONFIG")),
    reason="the cluster under test (PHALANX_E2E_KUBECONFIG) brings its own kubelet and DNS, not this build",
)


def test_the_kubelet_is_the_pinned_release() -> None:
    pinned = re.search(r"PHALANX_K8S_VERSION:-(v[0-9.]+)", SCRIPT.read_text())
    assert pinned is not None
    kubelet = go_built("kubelet", unchecked="the nodes' kubelet")
    out = subprocess.run([kubelet, "--version"], capture_output=True, text=True, check=True).stdout
    assert pinned.group(1) in out, out


def test_the_node_programs_are_beside_the_control_planes() -> None:
    nodes = ("kubelet", "kube-proxy", "coredns", "kube-router", "kueue")
    out = subprocess.run([SCRIPT, "--cached", *nodes], capture_output=True, text=True, check=True).stdout
    folder = subprocess.run([SCRIPT, "--cached"], capture_output=True, text=True, check=True).stdout.strip()
    for line in out.splitlines():
        assert os.path.dirname(line) == folder, (line, folder)
        assert os.access(line, os.X_OK), line


def test_coredns_has_the_plugins_of_the_clusters_corefile_and_no_other() -> None:
    coredns = go_built("coredns", unchecked="the cluster DNS's build")
    listed = subprocess.run([coredns, "-plugins"], capture_output=True, text=True, check=True).stdout
    # The Corefile's four, and the three that kubernetes and cache register by importing them.
    corefile = {"bind", "errors", "cache", "kubernetes"}
    assert set(listed.split()) == corefile | {"metadata", "prometheus", "transfer"}, listed
