"""Pure builders: the objects the operator creates, checked without a cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from phalanx.api import elasticjob
from phalanx.api.errors import ConfigError
from phalanx.api.settings import MasterSettings, OperatorSettings, ProbeSettings, StragglerSettings, from_env
from phalanx.cli.main import build_parser
from phalanx.cli.master import build_settings
from phalanx.operator import builders, names, supporting
from phalanx.operator.spec import parse_spec
from phalanx.operator.supporting import read_metrics_token

SETTINGS = OperatorSettings(command_prefix="/opt/bin/")


def job(**spec: Any) -> dict[str, Any]:
    base = {
        "nodes": {"min": 2, "max": 3},
        "nprocPerNode": 2,
        "template": {
            "metadata": {"labels": {"team": "ml"}},
            "spec": {
                "containers": [
                    {"name": "t", "image": "img", "command": ["python", "train.py"], "args": ["--lr", "0.1"]}
                ]
            },
        },
    }
    base.update(spec)
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": base,
    }


def test_every_object_is_owned_by_the_job() -> None:
    j = job()
    spec = parse_spec(j["spec"])
    objs = [
        supporting.token_secret(j, token="t"),
        supporting.state_config_map(j),
        supporting.master_service_account(j),
        supporting.master_role(j),
        supporting.master_role_binding(j),
        supporting.master_service(j, settings=SETTINGS),
        builders.master_pod(j, spec, settings=SETTINGS),
        builders.worker_pod(j, spec, slot=0, incarnation=0, settings=SETTINGS),
    ]
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "phalanx.dev/v1alpha1", "kind": "ElasticJob", "name": "j", "uid": "u-1",
            "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
        assert obj["metadata"]["namespace"] == "ns"
        assert obj["metadata"]["labels"]["phalanx.dev/job"] == "j"


def test_master_role_is_limited_to_its_own_objects() -> None:
    rules = supporting.master_role(job())["rules"]
    scoped = [r for r in rules if r["resources"] != ["events"]]
    assert all(r["resourceNames"] in (["j"], ["j-master-state"]) for r in scoped)
    assert not any("create" in r["verbs"] or "delete" in r["verbs"] for r in scoped)
    assert any(r["resources"] == ["elasticjobs/status"] and "patch" in r["verbs"] for r in rules)


def test_master_pod_runs_phalanx_master_with_k8s_state() -> None:
    j = job()
    pod = builders.master_pod(j, parse_spec(j["spec"]), settings=SETTINGS)
    c = pod["spec"]["containers"][0]
    assert c["command"][:2] == ["/opt/bin/phalanx", "master"]
    assert c["command"][c["command"].index("--state") + 1] == "k8s://ns/j"
    assert c["command"][c["command"].index("--nodes") + 1] == "2:3"
    assert pod["metadata"]["name"] == "j-master"
    assert pod["spec"]["serviceAccountName"] == "j-master"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PHALANX_HEARTBEAT_TIMEOUT_S"]["value"] == "10.0"


def test_the_master_has_a_liveness_probe_that_carries_no_secret_in_the_pod() -> None:
    """Every master endpoint wants the token; the probe execs phalanx.master.livez, which reads the mounted
    token file, so the Pod spec names the file and never the token."""
    j = job()
    spec = parse_spec(j["spec"])
    plain = builders.master_pod(j, spec, settings=SETTINGS)["spec"]["containers"][0]["livenessProbe"]
    assert plain["exec"]["command"] == [
        "/opt/bin/python", "-m", "phalanx.master.livez", "--port", str(SETTINGS.master_http_port),
        "--token-file", "/var/run/phalanx/token/token",
    ]  # fmt: skip
    assert plain["periodSeconds"] * plain["failureThreshold"] == 60, "a minute without an answer"
    with_tls = dataclasses.replace(SETTINGS, tls_ca_secret="phalanx-ca")
    pod = builders.master_pod(j, spec, settings=with_tls)
    command = pod["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
    assert command[-4:] == ["--ca-file", "/var/run/phalanx/tls/ca.crt", "--server-name", "phalanx-master"]
    (tls_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "phalanx-tls"]
    assert "ca.crt" in [item["key"] for item in tls_volume["secret"]["items"]]


def test_the_token_is_readable_by_the_images_user_without_a_fixed_fs_group() -> None:
    """Secret files belong to root and the images run as uid 10001. No Pod names an fsGroup (OpenShift's
    restricted policy assigns its own and refuses others), so the token is world-readable in both: only the
    container's own users can see the file."""
    j = job()
    spec = parse_spec(j["spec"])
    for pod in (
        builders.master_pod(j, spec, settings=SETTINGS)["spec"],
        builders.worker_pod(j, spec, slot=0, incarnation=0, settings=SETTINGS)["spec"],
    ):
        (vol,) = [v for v in pod["volumes"] if v["name"] == "phalanx-token"]
        assert vol["secret"]["defaultMode"] == 0o444
        assert "fsGroup" not in pod["securityContext"]
        assert "runAsUser" not in pod["securityContext"]


def test_the_metrics_token_is_in_a_secret_only_the_master_mounts() -> None:
    """The shared metrics token opens every job's /metrics: it never goes where the job author's code runs.
    The job's token Secret (mounted by every worker) holds the job token only; the master mounts a Secret
    of its own, <job>-metrics."""
    j = job()
    plain = builders.master_pod(j, parse_spec(j["spec"]), settings=SETTINGS)
    assert "--metrics-token-file" not in plain["spec"]["containers"][0]["command"]
    assert [v["name"] for v in plain["spec"]["volumes"]] == ["phalanx-token"]
    assert supporting.token_secret(j, token="t")["stringData"] == {"token": "t"}
    with_metrics = OperatorSettings(command_prefix="/opt/bin/", metrics_token_file="/var/run/m/token")
    master = builders.master_pod(j, parse_spec(j["spec"]), settings=with_metrics)
    command = master["spec"]["containers"][0]["command"]
    assert command[command.index("--metrics-token-file") + 1] == "/var/run/phalanx/metrics/token"
    assert {"name": "phalanx-metrics", "secret": {"secretName": "j-metrics", "defaultMode": 0o444}} in master[
        "spec"
    ]["volumes"]
    # The chart's way (the token in a Secret the operator reads) gives the master the same mount.
    from_secret = OperatorSettings(metrics_token_secret="rel-phalanx-metrics-token")
    via_secret = builders.master_pod(j, parse_spec(j["spec"]), settings=from_secret)
    assert "--metrics-token-file" in via_secret["spec"]["containers"][0]["command"]
    assert via_secret["spec"]["volumes"] == master["spec"]["volumes"]
    secret = supporting.metrics_secret(j, metrics_token="m" * 20)
    assert (secret["metadata"]["name"], secret["stringData"]) == ("j-metrics", {"token": "m" * 20})
    worker = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=with_metrics)
    secrets = [v["secret"]["secretName"] for v in worker["spec"]["volumes"] if "secret" in v]
    assert secrets == ["j-token"], "a worker mounts the job token and nothing else of the operator's"


def test_the_operator_refuses_an_unreadable_or_empty_metrics_token(tmp_path: Path) -> None:
    assert read_metrics_token("") == ""
    with pytest.raises(ConfigError, match="cannot read"):
        read_metrics_token(str(tmp_path / "absent"))
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        read_metrics_token(str(tmp_path / "short"))
    (tmp_path / "ok").write_text("x" * 32 + "\n")
    assert read_metrics_token(str(tmp_path / "ok")) == "x" * 32


def _master_env(pod: dict[str, Any]) -> dict[str, str]:
    """The master container's literal env (fieldRef values such as POD_IP left out)."""
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        (None, ProbeSettings()),
        (
            {"enabled": True, "probes": ["matmul"], "interval": "10m", "timeout": "45s"},
            ProbeSettings(
                enabled=True, on_round_complete=True, interval_s=600.0, timeout_s=45.0, kinds="matmul"
            ),
        ),
        ({"enabled": True}, ProbeSettings(enabled=True, on_round_complete=True)),
        (
            {"enabled": True, "confirmRounds": 1},
            ProbeSettings(
                enabled=True, on_round_complete=True, stragglers=StragglerSettings(confirm_rounds=1)
            ),
        ),
    ],
)
def test_master_pod_env_carries_health_checks_into_master_settings(
    health: dict[str, Any] | None, expected: ProbeSettings
) -> None:
    j = job(**({"healthChecks": health} if health is not None else {}))
    pod = builders.master_pod(j, parse_spec(j["spec"]), settings=SETTINGS)
    env = _master_env(pod)
    # The settings module's own env parser: the names are the ones the master reads.
    assert from_env(MasterSettings, {**env, "PHALANX_JOB_ID": "j"}).probes == expected
    # And the master's real start: its command line (flags) on top of that env.
    args = build_parser().parse_args(pod["spec"]["containers"][0]["command"][1:])
    assert build_settings(args, env).probes == expected


def test_worker_pod_wraps_the_template_in_phalanx_run() -> None:
    j = job(restart={"maxRestarts": 1, "gracePeriod": "2s"})
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=1, incarnation=4, settings=SETTINGS)
    assert pod["metadata"]["name"] == "j-worker-1-4"
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"][names.SLOT_LABEL] == "1"
    c = pod["spec"]["containers"][0]
    cmd = c["command"]
    assert cmd[0] == "/opt/bin/phalanx-run"
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "j-master.ns.svc:29400"
    assert cmd[cmd.index("--node-id") + 1] == "j-worker-1-4"
    assert cmd[cmd.index("--max-restarts") + 1] == "1"
    assert "args" not in c
    assert pod["spec"]["restartPolicy"] == "Never"
    assert {"name": "phalanx-token", "mountPath": builders.TOKEN_DIR, "readOnly": True} in c["volumeMounts"]
    assert "affinity" not in pod["spec"]


@pytest.mark.parametrize("instrument", [None, True, False])
def test_spec_hang_instrument_reaches_the_agent_as_parsed_by_phalanx_run(instrument: bool | None) -> None:
    """``spec.hang.instrument: false`` turns off the instrumentation of unmodified scripts: the worker's
    command line, read by phalanx-run's own parser, says so; unset or true leaves it on."""
    from phalanx.agent.config import parse

    j = job(**({"hang": {"instrument": instrument}} if instrument is not None else {}))
    cmd = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)["spec"][
        "containers"
    ][0]["command"]
    config = parse(cmd[1:], {})
    assert config.hang.instrument is (instrument is not False)


def test_workers_know_their_job_s_namespace_and_uid() -> None:
    """Two jobs ``j`` in two namespaces on one node must not share the flash checkpoint's files."""
    j = job()
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["PHALANX_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["PHALANX_JOB_UID"]["value"] == "u-1"


def test_worker_pod_grace_leaves_time_to_persist_the_newest_checkpoint() -> None:
    j = job(restart={"gracePeriod": "2s"})
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    # gracePeriod for stopping the workers, then 130 s for the agent's save at breakpoint and its host.
    assert pod["spec"]["terminationGracePeriodSeconds"] == 132
    j["spec"]["terminationGracePeriod"] = "10m"
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600, "spec.terminationGracePeriod sets it"
    j["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 300
    pod = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300, "the template's own value wins"


def test_worker_pod_keeps_off_excluded_machines() -> None:
    j = job()
    j["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
            }
        }
    }
    pod = builders.worker_pod(
        j, parse_spec(j["spec"]), slot=0, incarnation=1, settings=SETTINGS, excluded_machines=["m2", "m1"]
    )
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {"key": "gpu", "operator": "Exists"},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["m1", "m2"]},
    ]
    assert "affinity" not in job()["spec"]["template"]["spec"], "the template itself must not change"


@pytest.mark.parametrize(
    ("container", "entry"),
    [
        ({"command": ["python", "a.py", "x"]}, ["a.py", "x"]),
        ({"command": ["/usr/bin/python3.11"], "args": ["-m", "pkg.train"]}, ["-m", "pkg.train"]),
        ({"command": ["./train.sh"], "args": ["1"]}, ["--no-python", "./train.sh", "1"]),
    ],
)
def test_training_entry(container: dict[str, Any], entry: list[str]) -> None:
    assert builders.training_entry(container) == entry


def test_training_entry_needs_a_command() -> None:
    with pytest.raises(ConfigError, match="needs a command"):
        builders.training_entry({"image": "x"})


def test_worker_names_round_trip() -> None:
    assert elasticjob.parse_worker(elasticjob.worker("my-job", slot=12, incarnation=3)) == (12, 3)
    assert elasticjob.parse_worker("my-job-master") is None


def test_gang_scheduling_puts_every_worker_pod_in_one_pod_group() -> None:
    j = job(gangScheduling={"enabled": True})
    j["spec"]["template"]["spec"]["priorityClassName"] = "training"
    spec = parse_spec(j["spec"])
    group = builders.pod_group(j, spec)
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    assert group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == elasticjob.pod_group("j") == "j-workers"
    assert group["metadata"]["ownerReferences"][0]["uid"] == "u-1", "garbage-collected with the job"
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}, "nodes.min by default"
    assert group["spec"]["priorityClassName"] == "training", "the group has its Pods' priority"
    for slot in range(3):
        pod = builders.worker_pod(j, spec, slot=slot, incarnation=0, settings=SETTINGS)
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": "j-workers"}
    assert "schedulingGroup" not in builders.master_pod(j, spec, settings=SETTINGS)["spec"]
    plain = job()
    pod = builders.worker_pod(plain, parse_spec(plain["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    assert "schedulingGroup" not in pod["spec"]


def test_the_network_policy_admits_the_job_and_monitoring_only() -> None:
    """Tested as a built object: the test control plane has no network plugin that enforces policies."""
    j = job()
    policy = supporting.master_network_policy(
        j, settings=dataclasses.replace(SETTINGS, monitoring_namespace="prom")
    )
    assert policy["metadata"]["name"] == "j-master"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == j["metadata"]["uid"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"phalanx.dev/job": "j", "phalanx.dev/role": "master"}}
    assert spec["policyTypes"] == ["Ingress"], "egress stays open: the master calls the API server"
    (rule,) = spec["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"phalanx.dev/job": "j"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}},
    ]
    assert rule["ports"] == [
        {"protocol": "TCP", "port": SETTINGS.master_grpc_port},
        {"protocol": "TCP", "port": SETTINGS.master_http_port},
    ]
    worker = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    assert worker["metadata"]["labels"]["phalanx.dev/job"] == "j", "the job's own Pods match the policy"
    no_monitoring = dataclasses.replace(SETTINGS, monitoring_namespace="")
    bare = supporting.master_network_policy(j, settings=no_monitoring)
    assert bare["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"phalanx.dev/job": "j"}}}]


def test_the_workers_network_policy_admits_the_jobs_own_pods_on_every_port() -> None:
    """The rendezvous and probe stores of a rank-0 worker authenticate nobody: only the job's Pods reach
    them."""
    j = job()
    policy = supporting.workers_network_policy(j)
    assert policy["metadata"]["name"] == "j-workers"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == j["metadata"]["uid"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"phalanx.dev/job": "j", "phalanx.dev/role": "worker"}}
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule == {"from": [{"podSelector": {"matchLabels": {"phalanx.dev/job": "j"}}}]}, (
        "every port, no other"
    )


def test_a_template_cannot_take_the_job_label_off_its_pods() -> None:
    """The NetworkPolicy and the Pod lists rely on phalanx.dev/job: the operator's labels win."""
    j = job()
    j["spec"]["template"]["metadata"] = {"labels": {"phalanx.dev/job": "other", "team": "a"}}
    worker = builders.worker_pod(j, parse_spec(j["spec"]), slot=0, incarnation=0, settings=SETTINGS)
    assert worker["metadata"]["labels"]["phalanx.dev/job"] == "j"
    assert worker["metadata"]["labels"]["team"] == "a"


def test_a_metrics_token_from_a_file_and_a_secret_together_is_refused() -> None:
    with pytest.raises(ConfigError, match="not both"):
        OperatorSettings(metrics_token_file="/t", metrics_token_secret="s")
