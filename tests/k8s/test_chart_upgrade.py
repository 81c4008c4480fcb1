"""`helm upgrade` upgrades the ElasticJob CRD (the chart renders it from templates/, not crds/, which Helm
never upgrades), and `helm uninstall` keeps it (deleting a CRD deletes every object of it); a second
release beside the first (crds.install=false) installs without a conflict; the chart's roles put
ElasticJobs into the built-in `edit` role. Run with the helm that scripts/go-tools builds against the real
control plane."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from k8s_harness.controlplane import ControlPlane
from tests.eventually import eventually
from tests.gotools import go_built

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phalanx"
# A CRD of its own, so the test never touches the one the other tests' jobs live in.
GROUP = "upgradetest.phalanx.dev"


def test_helm_upgrade_applies_a_changed_crd_uninstall_keeps_it_and_a_second_release_fits_beside(
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

    def can_i(verb: str, user: str, namespace: str) -> bool:
        answer = control_plane.kubectl(
            "auth", "can-i", verb, f"elasticjobs.{GROUP}", "--as", user, "-n", namespace, check=False
        )
        return answer.split()[:1] == ["yes"]  # stdout's answer first; a warning on stderr after it

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
    # The job authors' roles of this chart copy name the test's group too.
    roles_file = chart / "files" / "elasticjob-author-roles.yaml"
    roles_file.write_text(roles_file.read_text().replace("[phalanx.dev]", f"[{GROUP}]"))
    second = ["second", str(chart), "-n", "chart-second", "--set", "operator.replicas=0"]
    second += ["--set", "crds.install=false", "--set", "operator.watchNamespace=chart-second"]
    try:
        helm("install", *release, "--create-namespace")
        assert short_names() == ["ej", "pxj"]

        # A second release (another team's operator): no CRD of its own, nothing cluster-wide in common.
        helm("install", *second, "--create-namespace")
        crd = json.loads(control_plane.kubectl("get", "crd", crd_name, "-o", "json"))
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "chart-upgrade"

        # Whoever may edit a namespace may run ElasticJobs there; a viewer may only read them.
        control_plane.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice",
                              "-n", "chart-second")  # fmt: skip
        control_plane.kubectl("create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob",
                              "-n", "chart-second")  # fmt: skip
        eventually(lambda: can_i("create", "alice", "chart-second"), timeout=30, what="edit to aggregate")
        eventually(lambda: can_i("list", "bob", "chart-second"), timeout=30, what="view to aggregate")
        assert not can_i("create", "bob", "chart-second")
        assert not can_i("create", "alice", "chart-upgrade")  # her binding is in one namespace only
        helm("uninstall", "second", "-n", "chart-second")
        assert short_names() == ["ej", "pxj"], "the second release had no CRD to take away"

        # The next chart version changes the CRD: `helm upgrade` applies it.
        crd_file.write_text(crd_file.read_text().replace("    - ej\n", "    - ej\n    - ejob\n"))
        assert "- ejob" in crd_file.read_text()
        helm("upgrade", *release)
        assert short_names() == ["ej", "ejob", "pxj"]

        helm("uninstall", "chart-upgrade", "-n", "chart-upgrade")
        assert short_names() == ["ej", "ejob", "pxj"], "helm uninstall must keep the CRD"
    finally:
        control_plane.kubectl("delete", "crd", crd_name, "--ignore-not-found", "--wait=false", check=False)
        for namespace in ("chart-upgrade", "chart-second"):
            control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for release_name in ("chart-upgrade", "second"):
            names = ",".join(
                f"{release_name}-phalanx-{suffix}"
                for suffix in ("operator", "elasticjob-edit", "elasticjob-view")
            )
            control_plane.kubectl("delete", "clusterrole,clusterrolebinding", names, "--ignore-not-found",
                                  check=False)  # fmt: skip
