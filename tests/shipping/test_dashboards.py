"""The Grafana dashboards under charts/phalanx/dashboards: well-formed, and every metric they query is one
the real master exports (scraped from a running ``phalanx master``)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.shipping.grafana import DASHBOARDS, exprs, load, panels
from tests.shipping.promql import label_names, metric_names
from tests.shipping.realmaster import TOKEN, exported_series, node_reports, running_master

ROOT = Path(__file__).resolve().parents[2]
METRICS_PY = ROOT / "src" / "phalanx" / "master" / "metrics.py"
# Series Prometheus itself adds to every target, and the labels it (or prometheus-operator) attaches.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}
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
    assert {"namespace", "job"} <= variables.keys()
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
            # Every query is scoped by the variables, so one dashboard serves many jobs.
            assert 'job=~"$job"' in expr, f"{where}: {expr}"
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
            unknown = names - exported - PROMETHEUS_SERIES
            assert not unknown, f"{path.name}: {sorted(unknown)} not exported by the master ({expr})"
            unknown_labels = label_names(expr) - known_labels
            assert not unknown_labels, f"{path.name}: labels {sorted(unknown_labels)} do not exist ({expr})"
        missing = REQUIRED[path.name] - used
        assert not missing, f"{path.name} shows no panel for {sorted(missing)}"
