"""The Grafana dashboards under charts/phalanx/dashboards: well-formed, and every metric they query is one
the real master exports (scraped from a running ``phalanx master``)."""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc
from tests.shipping.promql import label_names, metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts" / "phalanx" / "dashboards").glob("*.json"))
METRICS_PY = ROOT / "src" / "phalanx" / "master" / "metrics.py"
TOKEN = "dash-test-token"
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
    },
    "master-health.json": {
        "phalanx_rpc_duration_seconds_bucket",
        "phalanx_event_loop_lag_seconds",
        "phalanx_heartbeats_total",
        "phalanx_actions_repeated_total",
    },
}


def _load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            # label_values(<selector>, <label>): the selector is PromQL, the label must exist too.
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text)
            assert match, f"{var['name']}: unexpected variable query {text!r}"
            exprs.append(match[1])
    return exprs


def test_there_are_two_dashboards() -> None:
    assert [p.name for p in DASHBOARDS] == sorted(REQUIRED)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    d = _load(path)
    assert d["uid"].startswith("phalanx-")
    assert len(d["uid"]) <= 40
    assert d["title"].startswith("phalanx / ")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= variables.keys()
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for panel in _panels(d):
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


def _start_master(tmp: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    phalanx = Path(sys.executable).parent / "phalanx"
    cmd = [str(phalanx), "master", "--job-id", "dash-test", "--nodes", "1:1", "--port", "0"]
    cmd += ["--http-port", "0", "--token-file", str(token_file), "--state", str(tmp / "state.json")]
    with (tmp / "master.stderr").open("wb") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + 30
    while buf.count(b"\n") < 2:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise AssertionError(f"master printed no addresses: {(tmp / 'master.stderr').read_text()}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            proc.stdout.close()
            raise AssertionError(f"master exited {proc.wait()}: {(tmp / 'master.stderr').read_text()}")
        buf += chunk
    sel.close()
    grpc_line, http_line = buf.decode().splitlines()[:2]
    assert grpc_line.startswith("PHALANX_MASTER_GRPC=")
    assert http_line.startswith("PHALANX_MASTER_HTTP=")
    return proc, grpc_line.split("=", 1)[1], http_line.split("=", 1)[1]


def _exported(text: str) -> tuple[set[str], set[str]]:
    """(sample names, label names) a Prometheus text exposition offers, families without samples included."""
    names: set[str] = set()
    labels: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            base = family.removesuffix("_total")
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count", ""],
            }.get(kind, [""])
            names.update(base + s for s in suffixes)
        elif line and not line.startswith("#"):
            sample = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?", line)
            assert sample, line
            names.add(sample[1])
            labels.update(re.findall(r'(\w+)="', sample[2] or ""))
    return names, labels


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_every_queried_metric_is_exported_by_the_real_master(tmp_path: Path) -> None:
    proc, grpc_addr, http_addr = _start_master(tmp_path)
    try:
        # One registered node and a heartbeat, so the RPC histogram has real series (with `method`).
        auth = (("authorization", f"Bearer {TOKEN}"),)
        with grpc.insecure_channel(grpc_addr) as channel:
            stub = pb_grpc.MasterStub(channel)
            stub.RegisterNode(
                pb.RegisterNodeRequest(
                    job_id="dash-test", node_id="n0", incarnation="i0", host="127.0.0.1", nproc_per_node=1
                ),
                metadata=auth,
                timeout=10,
            )
            stub.Heartbeat(pb.HeartbeatRequest(node_id="n0", incarnation="i0"), metadata=auth, timeout=10)
        response = httpx.get(
            f"http://{http_addr}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        assert response.status_code == 200, response.text
    finally:
        proc.terminate()
        proc.wait(20)
        assert proc.stdout is not None
        proc.stdout.close()
    exported, seen_labels = _exported(response.text)
    assert "phalanx_rpc_duration_seconds_bucket" in exported
    assert "method" in seen_labels
    known_labels = seen_labels | _declared_labels() | TARGET_LABELS
    for path in DASHBOARDS:
        used: set[str] = set()
        for expr in _exprs(_load(path)):
            names = metric_names(expr)
            assert names, f"{path.name}: no metric found in {expr!r}"
            used |= names
            unknown = names - exported - PROMETHEUS_SERIES
            assert not unknown, f"{path.name}: {sorted(unknown)} not exported by the master ({expr})"
            unknown_labels = label_names(expr) - known_labels
            assert not unknown_labels, f"{path.name}: labels {sorted(unknown_labels)} do not exist ({expr})"
        missing = REQUIRED[path.name] - used
        assert not missing, f"{path.name} shows no panel for {sorted(missing)}"
