"""The chart's values as a platform team sets them: the schema that refuses a wrong value before anything is
rendered, a second release beside the first (crds.install=false), the operator's disruption budget and
priority, and the roles that let the namespace's own users run ElasticJobs. Rendered by the real helm
(scripts/go-tools), like test_chart_render.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.shipping.helmchart import CHART, ROOT, Helm, load_all
from tests.shipping.helmchart import one as _one

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _paths(values: Any, prefix: str = "") -> set[str]:
    """Every key path of a values mapping, e.g. ``operator.networkPolicy.enabled``; free-form maps are
    leaves (their keys are the user's)."""
    out: set[str] = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict) and value:
            out |= _paths(value, f"{path}.")
    return out


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        out.add(path)
        out |= _schema_paths(sub, f"{path}.")
    return out


def test_the_schema_names_every_value_and_nothing_else() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    free_form = {"operator.resources", "operator.extraEnv", "operator.nodeSelector", "operator.affinity"}
    documented = {p for p in _schema_paths(schema) if p != "global"}
    given = {p for p in _paths(values) if not any(p.startswith(f"{f}.") for f in free_form)}
    assert given == documented, (given - documented, documented - given)


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("operator.replicas=two", "operator/replicas"),
        ("operator.replicas=-1", "operator/replicas"),
        ("operator.httpPort=70000", "operator/httpPort"),
        ("operator.cordonNode=true", "cordonNode"),  # a misspelt key renders nothing it meant
        ("image.pullPolicy=Sometimes", "image/pullPolicy"),
        ("podMonitor.interval=15", "podMonitor/interval"),
        ("image.tag=1", "image/tag"),  # printf would render "%!s(int64=1)": --set-string says what is meant
        ("operator.watchNamespace=Team_A", "operator/watchNamespace"),
        ("operator.watchNamespaces={team-a,Team_B}", "operator/watchNamespaces/1"),
    ],
)
def test_a_wrong_value_is_refused_with_its_path(helm: Helm, setting: str, words: str) -> None:
    for command in ("template", "lint"):
        args = [command, "rel", str(CHART)] if command == "template" else [command, str(CHART)]
        result = helm(*args, "--set", setting, check=False)
        assert result.returncode != 0, f"{command} {setting} passed"
        assert "values don't meet the specifications of the schema" in result.stderr + result.stdout
        assert words in result.stderr + result.stdout, result.stderr


def test_a_label_value_that_reads_as_a_number_is_taken_as_its_text(helm: Helm) -> None:
    """`--set dashboards.labelValue=1` (the sidecar's usual value) is a number to helm: still a label."""
    objs = helm.render("dashboards.labelValue=1")
    dashboards = [o for o in objs if o["kind"] == "ConfigMap"]
    assert dashboards
    assert all(o["metadata"]["labels"]["grafana_dashboard"] == "1" for o in dashboards)


def test_two_renders_are_the_same(helm: Helm) -> None:
    """GitOps renders (Argo CD, Flux) compare `helm template` output: nothing random or looked up."""
    for sets in ((), ("podMonitor.enabled=true",)):
        args = ["template", "rel", str(CHART), "--namespace", "phalanx-system"]
        for s in sets:
            args += ["--set", s]
        assert helm(*args).stdout == helm(*args).stdout, sets


def test_a_second_release_renders_no_crd_and_names_of_its_own(helm: Helm) -> None:
    first = helm.render()
    second = load_all(
        helm(
            "template", "other", str(CHART), "--namespace", "team-b", "--include-crds",
            "--set", "crds.install=false", "--set", "operator.watchNamespace=team-b",
        ).stdout
    )  # fmt: skip
    assert not [d for d in second if d["kind"] == "CustomResourceDefinition"]
    assert [d for d in first if d["kind"] == "CustomResourceDefinition"]

    def cluster_scoped(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in objs if "namespace" not in o["metadata"]}

    # Nothing cluster-wide of one release is the other's: installing both makes no ownership conflict.
    assert not cluster_scoped(first) & cluster_scoped(second)


def test_the_operator_keeps_a_replica_through_a_drain_and_takes_a_priority(helm: Helm) -> None:
    objs = helm.render("operator.priorityClassName=platform-critical")
    budget = _one(objs, "PodDisruptionBudget")
    deployment = _one(objs, "Deployment")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == "platform-critical"
    # One replica: a budget would block every drain of its node.
    assert not [o for o in helm.render("operator.replicas=1") if o["kind"] == "PodDisruptionBudget"]
    assert "priorityClassName" not in _one(helm.render(), "Deployment")["spec"]["template"]["spec"]


def test_job_authors_get_elasticjobs_in_the_built_in_roles(helm: Helm) -> None:
    deploy = [
        d for d in yaml.safe_load_all((ROOT / "deploy" / "elasticjob-author-roles.yaml").read_text()) if d
    ]
    rendered = [o for o in helm.render() if o["kind"] == "ClusterRole" and "aggregate" in str(o["metadata"])]
    assert [r["rules"] for r in rendered] == [d["rules"] for d in deploy]
    assert [r["metadata"]["name"] for r in rendered] == [
        "rel-phalanx-elasticjob-edit",
        "rel-phalanx-elasticjob-view",
    ]
    for role, source in zip(rendered, deploy, strict=True):
        assert source["metadata"]["labels"].items() <= role["metadata"]["labels"].items()
        assert role["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    assert not [
        o for o in helm.render("rbac.aggregateToDefaultRoles=false") if "aggregate" in str(o["metadata"])
    ]


def test_the_example_says_how_to_install_the_chart_beside_a_kubectl_applied_crd() -> None:
    header = (ROOT / "examples" / "elasticjob.yaml").read_text().split("apiVersion:", 1)[0]
    assert "crds.install=false" in header
