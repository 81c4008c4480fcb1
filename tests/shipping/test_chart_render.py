"""The Helm chart, rendered for real by `helm lint` and `helm template` (helm built by scripts/go-tools).

Without Go and without a cached helm the tests skip with a loud reason, except under CI=true, where they
fail. The first run builds helm from source (a few minutes on 2 cores); later runs find it cached.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx.api.settings import OperatorSettings
from phalanx.operator import names, tls
from phalanx.operator.leader import ENVIRONMENT as LEADER_ELECTION_ENV
from phalanx.operator.supporting import master_service
from tests.shipping.helmchart import CHART, NAMESPACE, ROOT, Helm
from tests.shipping.helmchart import one as _one

COMMON_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)

# A cold helm build is the only slow part; a warm cache makes every test here take about a second.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _deploy(kind: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text()) if d]
    docs += [d for d in yaml.safe_load_all((ROOT / "deploy" / "operator.yaml").read_text()) if d]
    return next(d for d in docs if d["kind"] == kind)


def test_lint_passes_strict(helm: Helm) -> None:
    helm("lint", "--strict", str(CHART))
    helm(
        "lint",
        "--strict",
        str(CHART),
        "--set",
        "podMonitor.enabled=true",
        "--set",
        "podMonitor.authorization.secretName=metrics-token",
    )


def test_default_render(helm: Helm) -> None:
    objs = helm.render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",  # the operator's rules; no cluster-scoped one without operator.cordonNodes
            "ClusterRoleBinding",
            "ClusterRole",  # reading its own admission policies, by name (fail closed without them)
            "ClusterRoleBinding",
            "ClusterRole",  # kueue.enabled: reading ResourceFlavors and priority classes for queued jobs
            "ClusterRoleBinding",
            "ClusterRole",  # ... and MultiKueue's rights on ElasticJobs, bound by the administrator
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",  # the advice: a Warning for a job that will be suspended
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",  # only the operator makes a job's Pods
            "ValidatingAdmissionPolicyBinding",
            "Role",
            "RoleBinding",
            "Role",  # operator.masterTLS, on by default: the CA Secret of the release namespace
            "RoleBinding",
            "NetworkPolicy",  # operator.networkPolicy, on by default: the operator's own Pods
            "ClusterRole",  # rbac.aggregateToDefaultRoles: ElasticJobs in the built-in admin/edit roles
            "ClusterRole",  # ... and in view
            "PodDisruptionBudget",  # two replicas: a drain takes one at a time
            "Deployment",
            "ConfigMap",
            "ConfigMap",
        ]
    )
    for obj in objs:
        if obj["kind"] == "CustomResourceDefinition":
            continue
        labels = obj["metadata"]["labels"]
        missing = [k for k in COMMON_LABELS if k not in labels]
        assert not missing, f"{obj['kind']} {obj['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        if obj["kind"] in ("ServiceAccount", "Deployment", "ConfigMap"):
            assert obj["metadata"]["namespace"] == NAMESPACE

    # Safe by default: every job's master and workers behind NetworkPolicies, every master over TLS.
    env = {
        e["name"]: e.get("value")
        for e in _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PHALANX_OPERATOR_NETWORK_POLICY"] == "true"
    assert env["PHALANX_OPERATOR_TLS_CA_SECRET"] == "rel-phalanx-ca"
    # The operator's own Pods: its one port from the monitoring namespace only, nothing else at all.
    policy = _one(objs, "NetworkPolicy")
    assert (
        policy["spec"]["podSelector"]["matchLabels"]
        == _one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "ports": [{"protocol": "TCP", "port": "http"}],
        }
    ]
    closed = _one(helm.render("operator.networkPolicy.monitoringNamespace="), "NetworkPolicy")
    assert not closed["spec"]["ingress"], "no monitoring namespace: nothing reaches the operator"
    assert not [
        o for o in helm.render("operator.networkPolicy.enabled=false") if o["kind"] == "NetworkPolicy"
    ]

    # The CRD is a template (so `helm upgrade` upgrades it) that `helm uninstall` keeps: deleting it would
    # delete every ElasticJob in the cluster.
    crd = _one(objs, "CustomResourceDefinition")
    assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert crd == yaml.safe_load((ROOT / "crds" / "elasticjobs.phalanx.dev.yaml").read_text())


def test_rbac_equals_deploy(helm: Helm) -> None:
    objs = helm.render()
    role = _one(objs, "ClusterRole", "rel-phalanx-operator")
    binding = _one(objs, "ClusterRoleBinding", "rel-phalanx-operator")
    account = _one(objs, "ServiceAccount")
    assert role["rules"] == _deploy("ClusterRole")["rules"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    deployment = _one(objs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_operator_deployment(helm: Helm) -> None:
    deployment = _one(helm.render("operator.watchNamespace=team-a"), "Deployment")
    reference = _deploy("Deployment")
    spec = deployment["spec"]
    # Two replicas that elect a leader on a Lease (templates/leader-election-role.yaml), leases only.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate"}
    template_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    (ref_container,) = reference["spec"]["template"]["spec"]["containers"]
    assert container["image"] == ref_container["image"]  # the chart's appVersion is the released image
    assert container["command"] == ref_container["command"] == ["phalanx", "operator"]
    # The kubectl path is as safe by default as the chart: masters over TLS, the operator probed and fenced.
    ref_env = {e["name"]: e.get("value") for e in ref_container["env"]}
    assert ref_env["PHALANX_OPERATOR_TLS_CA_SECRET"] == "phalanx-ca"
    assert ref_container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    fence = _deploy("NetworkPolicy")
    assert fence["spec"]["podSelector"]["matchLabels"] == reference["spec"]["selector"]["matchLabels"]
    role = _deploy("Role")
    assert role["metadata"]["name"] == "phalanx-operator-tls-ca"
    assert {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": ["phalanx-ca", "phalanx-metrics-token"],
        "verbs": ["get"],
    } in role["rules"]
    # The kubectl install keeps the metrics token too (deploy/prometheus-scrape.yaml presents it).
    assert ref_env["PHALANX_OPERATOR_METRICS_TOKEN_SECRET"] == "phalanx-metrics-token"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PHALANX_OPERATOR_NAMESPACE"] == "team-a"
    assert env["PHALANX_OPERATOR_IMAGE"] == container["image"]
    # Every variable is a real operator setting (a typo would be silently ignored by the operator).
    settings = {f"PHALANX_OPERATOR_{name.upper()}" for name in OperatorSettings.__dataclass_fields__}
    settings |= set(LEADER_ELECTION_ENV)
    assert env.keys() <= settings, env.keys() - settings
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_dashboards_configmaps_carry_the_files(helm: Helm) -> None:
    objs = helm.render()
    maps = [o for o in objs if o["kind"] == "ConfigMap"]
    shipped = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "phalanx"}
        shipped.update({k: json.loads(v) for k, v in cm["data"].items()})
    files = {p.name: json.loads(p.read_text()) for p in (CHART / "dashboards").glob("*.json")}
    assert shipped == files
    assert not [o for o in helm.render("dashboards.enabled=false") if o["kind"] == "ConfigMap"]


def _meta_label(label: str) -> str:
    """Prometheus' service-discovery name of a Pod label: every character not allowed in a name becomes _."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)


def test_pod_monitor_is_optional_and_selects_the_masters(helm: Helm) -> None:
    assert not [o for o in helm.render() if o["kind"] in ("PodMonitor", "Secret")]
    objs = helm.render("podMonitor.enabled=true", "podMonitor.authorization.secretName=metrics-token")
    assert not [o for o in objs if o["kind"] == "Secret"], "a named Secret is the user's, not the chart's"
    monitor = _one(objs, "PodMonitor", "rel-phalanx-masters")
    spec = monitor["spec"]
    # The dashboards' and alerts' `elasticjob` label is the ElasticJob name, the master Pod's phalanx.dev/job
    # label; Prometheus' own `job` label is left as prometheus-operator sets it.
    assert "jobLabel" not in spec
    (relabel,) = spec["podMetricsEndpoints"][0]["relabelings"]
    assert relabel == {"sourceLabels": [_meta_label(names.JOB_LABEL)], "targetLabel": "elasticjob"}
    # The operator's own builders give the master's labels and port names (the Service shares the Pod's).
    service = master_service(
        {"metadata": {"name": "train-gpt", "namespace": "ml", "uid": "u-1"}}, settings=OperatorSettings()
    )
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    worker_labels = names.labels("train-gpt", component="worker")
    assert not spec["selector"]["matchLabels"].items() <= worker_labels.items()
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "metrics-token", "key": "token"}
    assert spec["namespaceSelector"] == {"any": True}


def test_the_pod_monitor_and_the_operator_share_one_metrics_token(helm: Helm) -> None:
    """The PodMonitors present the token of one Secret; the operator reads that Secret (and makes it, with a
    random token, when it is missing) to hand the token to every job's master. The render holds no token."""
    objs = helm.render("podMonitor.enabled=true")
    assert not [o for o in objs if o["kind"] == "Secret"], "a rendered token would differ on every render"
    for name in ("rel-phalanx-masters", "rel-phalanx-operator"):
        (endpoint,) = _one(objs, "PodMonitor", name)["spec"]["podMetricsEndpoints"]
        assert endpoint["authorization"]["credentials"] == {
            "name": "rel-phalanx-metrics-token",
            "key": "token",
        }
    (container,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PHALANX_OPERATOR_METRICS_TOKEN_SECRET"] == "rel-phalanx-metrics-token"
    assert env["PHALANX_OPERATOR_METRICS_TOKEN_SECRET_KEY"] == "token"
    role = _one(objs, "Role", "rel-phalanx-operator-metrics-token")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["rel-phalanx-metrics-token"],
            "verbs": ["get"],
        },
    ]
    binding = _one(objs, "RoleBinding", "rel-phalanx-operator-metrics-token")
    assert binding["subjects"][0]["name"] == _one(objs, "ServiceAccount")["metadata"]["name"]
    own = helm.render("podMonitor.enabled=true", "podMonitor.authorization.secretName=corp-metrics")
    own_env = {
        e["name"]: e.get("value")
        for e in _one(own, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert own_env["PHALANX_OPERATOR_METRICS_TOKEN_SECRET"] == "corp-metrics"
    without = _one(helm.render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert not {"PHALANX_OPERATOR_METRICS_TOKEN_SECRET", "PHALANX_OPERATOR_METRICS_TOKEN_FILE"} & {
        e["name"] for e in without["env"]
    }


def test_without_rbac_and_with_an_existing_service_account(helm: Helm) -> None:
    objs = helm.render("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ops")
    assert not {"ClusterRole", "ClusterRoleBinding", "ServiceAccount"} & {o["kind"] for o in objs}
    assert _one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_notes_render(helm: Helm, tmp_path: Path) -> None:
    """NOTES.txt is rendered only at install time (no cluster here), so render it inside a scratch copy."""
    chart = tmp_path / "phalanx"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "NOTES.txt")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: |-\n{{ tpl (.Files.Get "NOTES.txt") . | indent 4 }}\n'
    )

    def notes(*sets: str) -> str:
        args = ["template", "rel", str(chart), "-n", NAMESPACE, "--show-only", "templates/notes.yaml"]
        for s in sets:
            args += ["--set", s]
        return str(yaml.safe_load(helm(*args).stdout)["data"]["notes"])

    default = notes()
    assert "deployment/rel-phalanx-operator" in default
    assert "all namespaces" in default
    assert "podMonitor.enabled=true" in default
    scoped = notes(
        "operator.watchNamespace=ml", "podMonitor.enabled=true", "podMonitor.authorization.secretName=t"
    )
    assert "namespace ml" in scoped
    assert "Secret\nt (made by the operator when missing)" in scoped
    made = notes("podMonitor.enabled=true")
    assert "Secret\nrel-phalanx-metrics-token (made by the operator when missing)" in made


def test_prometheus_rule_is_optional_and_carries_the_alert_file(helm: Helm) -> None:
    assert not [o for o in helm.render() if o["kind"] == "PrometheusRule"]
    rule = _one(
        helm.render("prometheusRule.enabled=true", "prometheusRule.labels.release=kps"), "PrometheusRule"
    )
    assert rule["metadata"]["labels"]["release"] == "kps", "what a Prometheus' ruleSelector matches"
    assert rule["metadata"]["namespace"] == NAMESPACE
    shipped = yaml.safe_load((CHART / "alerts" / "phalanx.rules.yaml").read_text())
    assert rule["spec"] == shipped, "the rules promtool tests are the rules the chart ships"
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} >= {"PhalanxJobFailed"}


def test_the_operator_has_a_liveness_probe_and_its_own_pod_monitor(helm: Helm) -> None:
    objs = helm.render("podMonitor.enabled=true", "operator.httpPort=9000")
    deployment = _one(objs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 9000}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PHALANX_OPERATOR_HTTP_PORT"] == "9000", "the operator serves where the probe looks"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    monitor = _one(objs, "PodMonitor", "rel-phalanx-operator")["spec"]
    assert monitor["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert monitor["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")


def test_a_namespaced_operator_gets_a_role_and_only_the_cluster_rules_it_needs(helm: Helm) -> None:
    """operator.watchNamespace: the rules on namespaced objects (Secrets included) are a Role there, and
    nothing is cluster-wide (no CRDs, no namespaces: the operator watches jobs and Pods only) but reading its
    own admission policy by name and, with kueue.enabled, Kueue's flavors and priority classes; nodes only
    with operator.cordonNodes."""
    objs = helm.render("operator.watchNamespace=team-a")
    role = _one(objs, "Role", "rel-phalanx-operator")
    assert role["metadata"]["namespace"] == "team-a"
    assert role["rules"] == _deploy("ClusterRole")["rules"]
    binding = _one(objs, "RoleBinding", "rel-phalanx-operator")
    assert (binding["metadata"]["namespace"], binding["roleRef"]["kind"]) == ("team-a", "Role")

    def operators(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The operator's ClusterRoles: those bound to it (not the job authors' aggregated ones)."""
        bound = {o["roleRef"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"}
        return [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] in bound]

    check, queues = operators(objs)
    assert queues["metadata"]["name"] == "rel-phalanx-operator-kueue"
    assert {r for rule in queues["rules"] for r in rule["resources"]} == {
        "resourceflavors",
        "workloadpriorityclasses",
        "priorityclasses",
    }
    assert {v for rule in queues["rules"] for v in rule["verbs"]} == {"get"}
    assert operators(helm.render("operator.watchNamespace=team-a", "kueue.enabled=false")) == [check]
    assert check["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingadmissionpolicies", "validatingadmissionpolicybindings"],
            "resourceNames": ["rel-phalanx-elasticjob-templates", "rel-phalanx-elasticjob-pods"],
            "verbs": ["get"],
        }
    ]
    cordoning = helm.render("operator.watchNamespace=team-a", "operator.cordonNodes=true")
    cluster = _one(cordoning, "ClusterRole", "rel-phalanx-operator-cluster")
    assert cluster["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    bound = _one(cordoning, "ClusterRoleBinding", "rel-phalanx-operator-cluster")
    assert bound["roleRef"]["name"] == cluster["metadata"]["name"]
    everywhere = operators(helm.render())
    names = [o["metadata"]["name"] for o in everywhere]
    assert names == [
        "rel-phalanx-operator",
        "rel-phalanx-operator-admission-check",
        "rel-phalanx-operator-kueue",
    ]
    resources = {r for o in everywhere for rule in o["rules"] for r in rule["resources"]}
    assert not resources & {"nodes", "namespaces", "customresourcedefinitions"}


def test_an_operator_of_several_namespaces_gets_a_role_in_each_and_watches_them(helm: Helm) -> None:
    objs = helm.render("operator.watchNamespace=team-a", "operator.watchNamespaces={team-b,team-a}")
    operator = "rel-phalanx-operator"
    roles = [o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == operator]
    bindings = [o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"] == operator]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a", "team-b"], "each once"
    assert [b["metadata"]["namespace"] for b in bindings] == ["team-a", "team-b"]
    assert all(r["rules"] == _deploy("ClusterRole")["rules"] for r in roles)
    assert not [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == operator]
    (container,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PHALANX_OPERATOR_NAMESPACE"] == "team-a,team-b"


def test_the_multikueue_role_is_what_kueue_needs_of_elasticjobs_and_bound_to_nobody(helm: Helm) -> None:
    """MultiKueue's ClusterRole (docs/queues.md): the administrator binds it to Kueue in a manager cluster and
    to MultiKueue's identity in a worker; the chart binds it to nobody, and renders it only with
    kueue.enabled."""
    objs = helm.render()
    role = _one(objs, "ClusterRole", "rel-phalanx-operator-multikueue")
    assert role["rules"] == [
        {"apiGroups": ["phalanx.dev"], "resources": ["elasticjobs"],
         "verbs": ["get", "list", "watch", "create", "delete"]},
        {"apiGroups": ["phalanx.dev"], "resources": ["elasticjobs/status"],
         "verbs": ["get", "patch", "update"]},
    ]  # fmt: skip
    bindings = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert role["metadata"]["name"] not in [b["roleRef"]["name"] for b in bindings]
    without = helm.render("kueue.enabled=false")
    assert not [o for o in without if o["metadata"]["name"].endswith("-multikueue")]


def test_the_admission_policy_renders_the_allow_list_and_the_deploy_checks(helm: Helm) -> None:
    objs = helm.render(
        "admission.allow.serviceAccounts={default,trainer}", "admission.allow.hostNetwork=true"
    )
    policy = _one(objs, "ValidatingAdmissionPolicy", "rel-phalanx-elasticjob-templates")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert json.loads(variables["allowedServiceAccounts"]) == ["default", "trainer"]
    assert variables["allowHostNetwork"] == "true"
    deployed = list(yaml.safe_load_all((ROOT / "deploy" / "elasticjob-admission.yaml").read_text()))
    policies = (("elasticjob-templates", "Deny"), ("elasticjob-advice", "Warn"), ("elasticjob-pods", "Deny"))
    for name, action in policies:
        rendered = _one(objs, "ValidatingAdmissionPolicy", f"rel-phalanx-{name}")
        source = next(
            d for d in deployed
            if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == f"phalanx-{name}"
        )  # fmt: skip
        assert rendered["spec"]["validations"] == source["spec"]["validations"]
        assert rendered["spec"]["matchConditions"] == source["spec"]["matchConditions"]
        assert rendered["spec"]["matchConstraints"] == source["spec"]["matchConstraints"]
        binding = _one(objs, "ValidatingAdmissionPolicyBinding", f"rel-phalanx-{name}")
        assert binding["spec"] == {"policyName": rendered["metadata"]["name"], "validationActions": [action]}
    assert not [o for o in helm.render("admission.enabled=false") if "Admission" in o["kind"]]


def test_leader_election_role_is_namespaced_and_leases_only(helm: Helm) -> None:
    objs = helm.render()
    name = "rel-phalanx-operator-leader-election"
    role, binding = _one(objs, "Role", name), _one(objs, "RoleBinding", name)
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("coordination.k8s.io", "leases")
    }
    (container,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    lease = env["PHALANX_OPERATOR_LEASE_NAME"]["value"]
    # Only `create` is unbounded (it cannot be limited by name); reads and renewals are of that Lease only.
    assert [(r["verbs"], r.get("resourceNames")) for r in role["rules"]] == [
        (["create"], None),
        (["get", "update"], [lease]),
    ]
    assert env["PHALANX_OPERATOR_LEASE_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    reference = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy" / "operator-leader-election.yaml").read_text())
        if d["kind"] == "Role"
    )
    assert [r["verbs"] for r in reference["rules"]] == [r["verbs"] for r in role["rules"]]
    account = _one(objs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_master_tls_gives_the_operator_its_ca_and_prometheus_https(helm: Helm) -> None:
    off = helm.render("operator.masterTLS.enabled=false")
    assert not [o for o in off if o["kind"] == "Role" and o["metadata"]["name"].endswith("-tls-ca")]
    env = {e["name"] for e in _one(off, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "PHALANX_OPERATOR_TLS_CA_SECRET" not in env
    objs = helm.render("podMonitor.enabled=true")  # TLS on by default
    container = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PHALANX_OPERATOR_TLS_CA_SECRET"] == "rel-phalanx-ca"
    role = _one(objs, "Role", "rel-phalanx-operator-tls-ca")
    assert role["metadata"]["namespace"] == _one(objs, "Deployment")["metadata"]["namespace"]
    assert {
        "resources": ["secrets"],
        "resourceNames": ["rel-phalanx-ca"],
        "verbs": ["get"],
        "apiGroups": [""],
    } in (role["rules"])
    (endpoint,) = _one(objs, "PodMonitor", "rel-phalanx-masters")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "rel-phalanx-ca", "key": "tls.crt"}},
        "serverName": tls.SCRAPE_NAME,
    }
    own = helm.render("operator.masterTLS.enabled=true", "operator.masterTLS.caSecret=corp-ca")
    env = {
        e["name"]: e.get("value")
        for e in _one(own, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PHALANX_OPERATOR_TLS_CA_SECRET"] == "corp-ca"


def test_the_operator_is_told_its_admission_policy_unless_job_authors_are_trusted(helm: Helm) -> None:
    def env(objs: list[dict[str, Any]]) -> dict[str, str]:
        (container,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value", "") for e in container["env"]}

    objs = helm.render()
    assert env(objs)["PHALANX_OPERATOR_ADMISSION_POLICY"] == "rel-phalanx-elasticjob-templates"
    assert _one(objs, "ValidatingAdmissionPolicy", "rel-phalanx-elasticjob-templates")
    trusted = helm.render("operator.trustJobAuthors=true")
    assert env(trusted)["PHALANX_OPERATOR_ADMISSION_POLICY"] == ""
    # Trusted authors: the templates' policy is not read; the job Pods' one still is (forged members).
    (check,) = [o for o in trusted if o["metadata"]["name"].endswith("-admission-check") and "rules" in o]
    assert check["rules"][0]["resourceNames"] == ["rel-phalanx-elasticjob-pods"]
    assert env(trusted)["PHALANX_OPERATOR_POD_ADMISSION_POLICY"] == "rel-phalanx-elasticjob-pods"
