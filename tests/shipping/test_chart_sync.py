"""scripts/sync-chart: the chart's CRD and RBAC rules are copies of crds/ and deploy/, and drift is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sync-chart"


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "sync-chart"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_chart_is_in_sync() -> None:
    result = _run(ROOT, "--check")
    assert result.returncode == 0, result.stderr
    assert (ROOT / "charts/phalanx/files/elasticjobs.phalanx.dev.yaml").read_bytes() == (
        ROOT / "crds/elasticjobs.phalanx.dev.yaml"
    ).read_bytes()


def _copy_tree(tmp: Path) -> Path:
    """The files sync-chart reads and writes, in a scratch checkout, so the test may break them."""
    root = tmp / "repo"
    for rel in ("scripts/sync-chart", "crds", "deploy", "charts/phalanx/files", "charts/phalanx/templates"):
        src, dst = ROOT / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return root


def test_check_fails_on_a_changed_rbac_rule_and_sync_repairs_it(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    rbac = root / "deploy" / "operator-rbac.yaml"
    rbac.write_text(
        rbac.read_text().replace("verbs: [get, list, watch, create, delete]", "verbs: [get, list]")
    )
    result = _run(root, "--check")
    assert result.returncode == 1
    assert "clusterrole.yaml" in result.stderr
    assert "-    verbs: [get, list, watch, create, delete]" in result.stderr
    assert _run(root).returncode == 0
    assert _run(root, "--check").returncode == 0
    role = (root / "charts/phalanx/templates/clusterrole.yaml").read_text()
    assert "verbs: [get, list]\n" in role
    # Comments travel with the rules: each rule keeps the line that says why it exists.
    assert (
        "# With PHALANX_OPERATOR_NETWORK_POLICY=true: each job's NetworkPolicy guarding its master's ports"
        in role
    )


def test_check_fails_on_a_changed_crd(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    crd = root / "crds" / "elasticjobs.phalanx.dev.yaml"
    crd.write_text(crd.read_text().replace("- ej\n", "- ejob\n"))
    result = _run(root, "--check")
    assert result.returncode == 1
    assert "elasticjobs.phalanx.dev.yaml" in result.stderr
    assert _run(root).returncode == 0
    chart_crd = yaml.safe_load((root / "charts/phalanx/files/elasticjobs.phalanx.dev.yaml").read_text())
    assert chart_crd["spec"]["names"]["shortNames"] == ["ejob", "pxj"]


def test_check_fails_when_the_markers_are_gone(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    role = root / "charts/phalanx/templates/clusterrole.yaml"
    role.write_text(role.read_text().replace("# END rules\n", ""))
    result = _run(root, "--check")
    assert result.returncode == 1
    assert "markers" in result.stderr


def test_check_fails_on_a_changed_admission_check_and_sync_repairs_it(tmp_path: Path) -> None:
    """The chart's ValidatingAdmissionPolicy carries the checks of deploy/elasticjob-admission.yaml."""
    root = _copy_tree(tmp_path)
    policy = root / "deploy" / "elasticjob-admission.yaml"
    policy.write_text(policy.read_text().replace("['hostPID', 'hostIPC']", "['hostPID']"))
    result = _run(root, "--check")
    assert result.returncode == 1
    assert "admission-policy.yaml" in result.stderr
    assert _run(root).returncode == 0
    assert "['hostPID'].filter" in (root / "charts/phalanx/templates/admission-policy.yaml").read_text()
