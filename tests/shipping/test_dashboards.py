"""The Grafana dashboards under charts/phalanx/dashboards: well-formed, and every metric they query is one
the real master exports (scraped from a running ``phalanx master``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gotools import go_built
from tests.shipping.grafana import DASHBOARDS, exprs, load, panels
from tests.shipping.promql import label_names, metric_names
from tests.shipping.realmaster import TOKEN, exported_series, node_reports, running_master

ROOT = Path(__file__).resolve().parents[2]
METRICS_PY = ROOT / "src" / "phalanx" / "master" / "serve" / "metrics.py"
CHART_DASHBOARDS = ROOT / "charts" / "phalanx" / "dashboards"
# Series Prometheus itself adds to every target, and the labels it (or prometheus-operator) attaches;
# `elasticjob` is the scrape configurations' relabeling (the chart's PodMonitor and
# deploy/prometheus-scrape.yaml).
PROMETHEUS_SERIES = {"up"}
DCGM = "DCGM_FI_"
"""DCGM exporter's GPU series (its Kubernetes mapping labels them with the Pod that holds the GPU): the
dashboard's GPU row joins them to a job by its worker Pods' names, and shows nothing where it does not run."""
WORKER_PODS = 'pod=~"($elasticjob)-worker-[0-9]+-[0-9]+"'
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "elasticjob"}
# Which dashboard must show which metric family: the panels the brief of each dashboard promises.
REQUIRED = {
    "job-overview.json": {
        "phalanx_job_phase",
        "phalanx_world_size",
        "phalanx_nodes",
        "phalanx_rendezvous_round",
        "phalanx_training_step",
        "phalanx_restarts_total",
        "phalanx_failures_total",
        "phalanx_evictions_total",
        "phalanx_checkpoint_committed_step",
        "phalanx_checkpoint_failures_total",
        "phalanx_log_lines_total",
        "phalanx_log_lines_dropped_total",
        "phalanx_node_step_time_seconds",
        "phalanx_node_straggler_score",
        "phalanx_hang_verdicts_total",
        "phalanx_recovery_last_phase_seconds",
        "phalanx_recovery_phase_seconds_sum",
        "phalanx_recovery_phase_seconds_count",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_XID_ERRORS",
    },
    "master-health.json": {
        "phalanx_rpc_duration_seconds_bucket",
        "phalanx_event_loop_lag_seconds",
        "phalanx_heartbeats_total",
        "phalanx_actions_repeated_total",
    },
}


def test_there_are_two_dashboards() -> None:
    assert [p.name for p in DASHBOARDS] == sorted(REQUIRED)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    d = load(path)
    assert d["uid"].startswith("phalanx-")
    assert len(d["uid"]) <= 40
    assert d["title"].startswith("phalanx / ")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "elasticjob"} <= variables.keys()
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for panel in panels(d):
        where = f"{path.name} panel {panel['id']}"
        assert panel.get("title"), f"{where} has no title"
        assert panel.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{where} sticks out of the grid"
        if panel["type"] == "row":
            continue
        assert panel.get("description"), f"{where} has no description"
        assert panel["targets"], f"{where} queries nothing"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), where
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], where
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), where
            assert expr.count("{") == expr.count("}"), where
            # Every query is scoped by the variables, so one dashboard serves many jobs (a GPU's series by
            # the job's worker Pods).
            if all(name.startswith(DCGM) for name in metric_names(expr)):
                assert WORKER_PODS in expr, f"{where}: {expr}"
            else:
                assert 'elasticjob=~"$elasticjob"' in expr, f"{where}: {expr}"
            assert 'namespace=~"$namespace"' in expr, f"{where}: {expr}"
            # Counters only under rate()/increase(), never raw (a restart resets them).
            for name in metric_names(expr):
                if name.endswith(("_total", "_count", "_sum", "_bucket")):
                    assert re.search(rf"(rate|increase)\({name}\b", expr), f"{where}: raw counter {name}"


def _declared_labels() -> set[str]:
    """Label names metrics.py gives its families (series with no sample yet carry none in a scrape)."""
    source = METRICS_PY.read_text()
    declared = set()
    for group in re.findall(r"label(?:name)?s=\[([^\]]*)\]", source):
        declared.update(re.findall(r'"(\w+)"', group))
    return declared


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_every_queried_metric_is_exported_by_the_real_master(tmp_path: Path) -> None:
    with running_master(tmp_path, job_id="dash-test") as (grpc_addr, http_addr):
        node_reports(grpc_addr, job_id="dash-test")
        response = httpx.get(
            f"http://{http_addr}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        assert response.status_code == 200, response.text
    exported, seen_labels = exported_series(response.text)
    assert "phalanx_rpc_duration_seconds_bucket" in exported
    assert "method" in seen_labels
    known_labels = seen_labels | _declared_labels() | TARGET_LABELS
    for path in DASHBOARDS:
        used: set[str] = set()
        for expr in exprs(load(path)):
            names = metric_names(expr)
            assert names, f"{path.name}: no metric found in {expr!r}"
            used |= names
            unknown = {n for n in names - exported - PROMETHEUS_SERIES if not n.startswith(DCGM)}
            assert not unknown, f"{path.name}: {sorted(unknown)} not exported by the master ({expr})"
            unknown_labels = label_names(expr) - known_labels
            assert not unknown_labels, f"{path.name}: labels {sorted(unknown_labels)} do not exist ({expr})"
        missing = REQUIRED[path.name] - used
        assert not missing, f"{path.name} shows no panel for {sorted(missing)}"


@pytest.mark.integration
def test_the_gpu_row_shows_the_gpus_of_the_jobs_workers_only(tmp_path: Path) -> None:
    """The GPU row's queries, evaluated by promtool on DCGM exporter's series (as its Kubernetes mapping
    labels them): the workers of the chosen job, and not its master, another job's workers or a Pod of
    another namespace."""
    promtool = go_built("promtool", unchecked="the GPU row's queries")
    gpu = 'namespace="{ns}", pod="{pod}", gpu="0", Hostname="n1"'
    pods = [
        ("ml", "gpt-worker-0-1"), ("ml", "gpt-worker-1-3"), ("ml", "gpt-master"), ("ml", "gpt2-worker-0-1"),
        ("other", "gpt-worker-0-1"),
    ]  # fmt: skip
    series = [
        {"series": f"{name}{{{gpu.format(ns=ns, pod=pod)}}}", "values": "50x5"}
        for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_XID_ERRORS",
                     "DCGM_FI_DEV_GPU_TEMP")
        for ns, pod in pods
    ]  # fmt: skip
    tests = []
    for expr in exprs(load(CHART_DASHBOARDS / "job-overview.json")):
        if not all(name.startswith(DCGM) for name in metric_names(expr)):
            continue
        query = expr.replace("$namespace", "ml").replace("$elasticjob", "gpt")
        expected = [
            {"labels": f'{{pod="{pod}"}}', "value": 50} for pod in ("gpt-worker-0-1", "gpt-worker-1-3")
        ]
        tests.append({"expr": query, "eval_time": "2m", "exp_samples": expected})
    assert len(tests) == 4, tests
    unit = tmp_path / "gpu.yaml"
    unit.write_text(
        yaml.safe_dump({"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]})
    )
    result = subprocess.run(
        [promtool, "test", "rules", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
