"""`helm upgrade` upgrades the ElasticJob CRD (the chart renders it from templates/, not crds/, which Helm
never upgrades), and `helm uninstall` keeps it (deleting a CRD deletes every object of it). Run with the
helm that scripts/go-tools builds against the real control plane."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from k8s_harness.controlplane import ControlPlane
from tests.gotools import go_built

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phalanx"
# A CRD of its own, so the test never touches the one the other tests' jobs live in.
GROUP = "upgradetest.phalanx.dev"


def test_helm_upgrade_applies_a_changed_crd_and_uninstall_keeps_it(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    binary = go_built("helm", unchecked="the chart's CRD upgrade is not tested")
    env = {
        "PATH": os.environ.get("PATH", ""),
        **{f"HELM_{k}_HOME": str(tmp_path / k.lower()) for k in ("CACHE", "CONFIG", "DATA")},
    }

    def helm(*args: str) -> str:
        result = subprocess.run(
            [binary, "--kubeconfig", str(control_plane.kubeconfig), *args],
            capture_output=True, text=True, timeout=120, check=False, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr + result.stdout
        return result.stdout

    chart = tmp_path / "phalanx"
    shutil.copytree(CHART, chart)
    crd_file = chart / "files" / "elasticjobs.phalanx.dev.yaml"
    text = crd_file.read_text()
    assert "name: elasticjobs.phalanx.dev\n" in text
    assert "group: phalanx.dev\n" in text
    text = text.replace("name: elasticjobs.phalanx.dev\n", f"name: elasticjobs.{GROUP}\n")
    crd_file.write_text(text.replace("group: phalanx.dev\n", f"group: {GROUP}\n"))
    crd_name = f"elasticjobs.{GROUP}"

    def short_names() -> list[str]:
        crd = json.loads(control_plane.kubectl("get", "crd", crd_name, "-o", "json"))
        return list(crd["spec"]["names"].get("shortNames") or [])

    # No operator Pods: this release only carries the CRD under test.
    release = ["chart-upgrade", str(chart), "-n", "chart-upgrade", "--set", "operator.replicas=0"]
    try:
        helm("install", *release, "--create-namespace")
        assert short_names() == ["ej"]

        # The next chart version changes the CRD: `helm upgrade` applies it.
        crd_file.write_text(crd_file.read_text().replace("    - ej\n", "    - ej\n    - ejob\n"))
        assert "- ejob" in crd_file.read_text()
        helm("upgrade", *release)
        assert short_names() == ["ej", "ejob"]

        helm("uninstall", "chart-upgrade", "-n", "chart-upgrade")
        assert short_names() == ["ej", "ejob"], "helm uninstall must keep the CRD"
    finally:
        control_plane.kubectl("delete", "crd", crd_name, "--ignore-not-found", "--wait=false", check=False)
        control_plane.kubectl("delete", "namespace", "chart-upgrade", "--wait=false", check=False)
        rbac = ("clusterrole,clusterrolebinding", "chart-upgrade-phalanx-operator", "--ignore-not-found")
        control_plane.kubectl("delete", *rbac, check=False)
