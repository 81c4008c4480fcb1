"""The alerting rules (charts/phalanx/alerts/phalanx.rules.yaml) and the dashboards, against the real thing.

* ``promtool check rules`` accepts the file;
* ``promtool test rules``: each alert fires on the situation it names, with its labels and rendered
  annotations, and stays quiet on the healthy case next to it (synthetic series, Prometheus' own evaluator);
* a real Prometheus scrapes a real ``phalanx master`` with the metrics bearer token, evaluates every rule
  without error (and fires the one the master's state calls for), and answers every dashboard query.

prometheus and promtool are built from the Go module proxy by scripts/go-tools (cached). Without Go
and without a cached build the tests skip with a loud reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from phalanx.api.ports import free_port as _free_port
from tests.eventually import eventually
from tests.gotools import go_built
from tests.shipping.grafana import DASHBOARDS, exprs, load
from tests.shipping.promql import metric_names
from tests.shipping.realmaster import TOKEN, node_reports, nodes_step, persist_fails, running_master

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "phalanx" / "alerts" / "phalanx.rules.yaml"
LABELS = {"namespace": "ml", "job": "ml/phalanx-masters", "elasticjob": "gpt", "instance": "10.0.0.7:8080"}
"""A master's series as the chart's PodMonitor labels them: `job` prometheus-operator's, `elasticjob` the
ElasticJob's name."""

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # a cold build of Prometheus is slow


@pytest.fixture(scope="module")
def prometheus_bin() -> Path:
    return Path(go_built("promtool", unchecked="alerts unchecked")).parent


def _rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def test_promtool_accepts_the_rules(prometheus_bin: Path) -> None:
    result = subprocess.run(
        [str(prometheus_bin / "promtool"), "check", "rules", "--lint-fatal", str(RULES)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    pairs = ", ".join(f'{k}="{v}"' for k, v in {**LABELS, **labels}.items())
    return {"series": f"{name}{{{pairs}}}", "values": values}


def _firing(alert: str, value: str = "", **labels: str) -> dict[str, Any]:
    """The alert as promtool must see it: the rule's labels plus the series' that its aggregation keeps (the
    first ``by (...)`` of its expression), and its annotations rendered for them (``$value | humanize`` as
    ``value``)."""
    rule = _rules()[alert]
    by = re.search(r"\bby \(([^)]*)\)", rule["expr"])
    assert by, f"{alert}: every rule aggregates by its labels"
    kept = {name.strip() for name in by[1].split(",")}
    seen = {k: v for k, v in {**LABELS, **labels}.items() if k in kept}

    def render(text: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: seen[m[1]], text)
        text = text.replace("{{ $value | humanize }}", value)
        assert "{{" not in text, f"{alert}: a template the test does not render: {text}"
        return text

    return {
        "exp_labels": {**rule["labels"], **seen},
        "exp_annotations": {k: render(v) for k, v in rule["annotations"].items()},
    }


# (alert, input series, [(eval time, expected firing alerts)]): each fires on its case and not on the
# healthy or resolved one next to it.
CASES: list[tuple[str, list[dict[str, str]], list[tuple[str, list[dict[str, Any]]]]]] = [
    (
        "PhalanxJobFailed",
        [
            _series("phalanx_job_phase", "0 0 1", phase="Failed"),
            _series("phalanx_job_phase", "1 1 0", phase="Running"),
        ],
        # Held 10 minutes after the last scrape that showed it (the master Pod is cleaned up), then resolved.
        [("3m", [_firing("PhalanxJobFailed")]), ("11m", [_firing("PhalanxJobFailed")]), ("13m", [])],
    ),
    (
        "PhalanxJobStuckRestarting",
        [
            _series("phalanx_job_phase", "1x14", phase="Restarting"),
            _series("phalanx_job_phase", "0 1 1 0x12", phase="Restarting", elasticjob="brief"),
        ],
        [("5m", []), ("12m", [_firing("PhalanxJobStuckRestarting")])],
    ),
    (
        "PhalanxJobRestartingOften",
        [
            _series("phalanx_restarts_total", "0+1x40"),
            _series("phalanx_restarts_total", "0+0.05x40", elasticjob="steady"),
        ],
        [("40m", [_firing("PhalanxJobRestartingOften", "30")])],
    ),
    (
        "PhalanxNodesEvicted",
        [
            _series("phalanx_evictions_total", "0 1 2 3 3 3", reason="probe_failed"),
            _series(
                "phalanx_evictions_total",
                "0 1 1 1 1 1",
                reason="heartbeat_timeout",
                elasticjob="one-bad-node",
            ),
        ],
        [("5m", [_firing("PhalanxNodesEvicted", "3")])],
    ),
    (
        "PhalanxTrainingStalled",
        [
            _series("phalanx_job_phase", "1x40", phase="Running"),
            _series("phalanx_training_step", "0+1x10 10x30"),
            _series("phalanx_job_phase", "1x40", phase="Running", elasticjob="healthy"),
            _series("phalanx_training_step", "0+1x40", elasticjob="healthy"),
            _series("phalanx_job_phase", "1x40", phase="Running", elasticjob="silent"),
            _series("phalanx_training_step", "-1x40", elasticjob="silent"),  # its script never reports steps
        ],
        [("20m", []), ("30m", [_firing("PhalanxTrainingStalled")])],
    ),
    (
        "PhalanxCheckpointPersistFailing",
        [_series("phalanx_checkpoint_failures_total", "0 0 0 1x25")],
        [("5m", [_firing("PhalanxCheckpointPersistFailing")]), ("25m", [])],
    ),
    (
        "PhalanxMasterDown",
        [
            _series("up", "1 1 1 0x10"),
            _series("phalanx_job_phase", "1 1 1", phase="Running"),
            _series(
                "up", "0x10", job="some-exporter", elasticjob=""
            ),  # never exported phalanx series: not a master
        ],
        [("4m", []), ("6m", [_firing("PhalanxMasterDown")])],
    ),
    (
        "PhalanxMasterSlow",
        [
            _series("phalanx_event_loop_lag_seconds", "2x10"),
            _series("phalanx_event_loop_lag_seconds", "0.5x10", elasticjob="ok"),
        ],
        [("4m", []), ("6m", [_firing("PhalanxMasterSlow")])],
    ),
    (
        "PhalanxOperatorReconcileFailing",
        [
            _series("phalanx_operator_reconcile_passes_total", "0+6x30", result="error", namespace="ops"),
            _series("phalanx_operator_reconcile_passes_total", "0+60x30", result="ok", namespace="ops"),
            _series("phalanx_operator_reconcile_passes_total", "0+60x30", result="ok", namespace="fine"),
        ],
        [("5m", []), ("20m", [_firing("PhalanxOperatorReconcileFailing", namespace="ops")])],
    ),
    (
        "PhalanxOperatorActionsRefused",
        [
            _series("phalanx_operator_action_failures_total", "0+1x40", action="Create", namespace="ops"),
            _series("phalanx_operator_action_failures_total", "0 1 1x38", action="Event", namespace="ops"),
        ],
        [("5m", []), ("30m", [_firing("PhalanxOperatorActionsRefused", namespace="ops", action="Create")])],
    ),
    (
        "PhalanxLogLinesDropped",
        [
            _series("phalanx_log_lines_dropped_total", "0+10x30"),
            _series("phalanx_log_lines_dropped_total", "0x30", elasticjob="ok"),
        ],
        [("5m", []), ("15m", [_firing("PhalanxLogLinesDropped")])],
    ),
]


def test_every_alert_has_a_case() -> None:
    assert sorted(c[0] for c in CASES) == sorted(_rules())


@pytest.mark.parametrize(("alert", "series", "evals"), CASES, ids=[c[0] for c in CASES])
def test_the_alert_fires_on_its_case_and_not_on_the_healthy_one(
    prometheus_bin: Path,
    tmp_path: Path,
    alert: str,
    series: list[dict[str, str]],
    evals: list[tuple[str, list[dict[str, Any]]]],
) -> None:
    unit = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": alert, "exp_alerts": expected} for at, expected in evals
                ],
            }
        ],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = subprocess.run(
        [str(prometheus_bin / "promtool"), "test", "rules", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def prometheus(prometheus_bin: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real Prometheus (1 s scrape and rule intervals) with phalanx's rules; the test writes the scrape
    config into the returned path before reloading it through :func:`_reload`."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}}))
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            str(prometheus_bin / "prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: _ok(f"{url}/-/ready"), timeout=60, what="Prometheus ready", interval=0.5)
        yield config, url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _api(url: str, path: str, **params: str) -> Any:
    response = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    body = response.json()
    assert body["status"] == "success", f"{path} {params}: {body}"
    return body["data"]


@pytest.mark.timeout(120)
def test_a_real_prometheus_scrapes_the_master_evaluates_the_rules_and_answers_the_dashboards(
    prometheus: tuple[Path, str], tmp_path: Path
) -> None:
    config, url = prometheus
    with running_master(tmp_path, job_id="gpt") as (grpc_addr, http_addr):
        node_reports(grpc_addr, job_id="gpt", step=5)
        token = tmp_path / "metrics-token"
        token.write_text(TOKEN)
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    # As the chart's PodMonitor labels a master: elasticjob, and its namespace.
                    "scrape_configs": [
                        {
                            "job_name": "phalanx-masters",
                            "authorization": {"type": "Bearer", "credentials_file": str(token)},
                            "static_configs": [
                                {"targets": [http_addr], "labels": {"namespace": "ml", "elasticjob": "gpt"}}
                            ],
                        }
                    ],
                }
            )
        )
        assert httpx.post(f"{url}/-/reload", timeout=10).status_code == 200
        eventually(
            lambda: any(t["health"] == "up" for t in _api(url, "targets")["activeTargets"]),
            timeout=30,
            what="the master scraped with the token",
            interval=0.5,
        )
        # A persist fails once Prometheus has seen the counter at 0: PhalanxCheckpointPersistFailing is then
        # what the job's state calls for, and nothing else.
        eventually(
            lambda: _api(url, "query", query='phalanx_checkpoint_failures_total{elasticjob="gpt"} == 0')[
                "result"
            ],
            timeout=30,
            what="a scrape of the counter at 0",
            interval=0.5,
        )
        persist_fails(grpc_addr, step=5)
        eventually(
            lambda: _api(
                url, "query", query='increase(phalanx_checkpoint_failures_total{elasticjob="gpt"}[1m]) > 0'
            )["result"],
            timeout=30,
            what="its increase seen",
            interval=0.5,
        )
        firing = eventually(
            lambda: [
                a
                for a in _api(url, "alerts")["alerts"]
                if a["labels"]["alertname"] == "PhalanxCheckpointPersistFailing" and a["state"] == "firing"
            ],
            timeout=30,
            what="the checkpoint alert",
            interval=0.5,
        )
        assert (
            firing[0]["labels"].items()
            >= {"elasticjob": "gpt", "namespace": "ml", "severity": "warning"}.items()
        )
        rules = [r for g in _api(url, "rules")["groups"] for r in g["rules"]]
        assert len(rules) == len(_rules())
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, f"rules that fail on the real master's series: {bad}"
        others = {a["labels"]["alertname"] for a in _api(url, "alerts")["alerts"]} - {
            "PhalanxCheckpointPersistFailing"
        }
        assert not others, f"alerts a healthy job should not raise: {others}"

        exposition = httpx.get(
            f"http://{http_addr}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        ).text
        with_samples = {
            line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and line[0] != "#"
        }
        empty = []
        for path in DASHBOARDS:
            for expr in exprs(load(path)):
                query = expr.replace("$namespace", "ml").replace("$elasticjob", "gpt")
                query = query.replace("$__rate_interval", "1m").replace("$__range", "5m")
                result = _api(url, "query", query=query)["result"]
                # A query of series the master exports with samples must show something.
                if metric_names(expr) <= with_samples and not result:
                    empty.append(f"{path.name}: {query}")
        assert not empty, "dashboard queries with no data on a live master:\n" + "\n".join(empty)


@pytest.mark.timeout(120)
def test_a_real_prometheus_shows_the_step_times_and_straggler_scores_of_each_node(
    prometheus: tuple[Path, str], tmp_path: Path
) -> None:
    """Two nodes report steps to a real master, one three times slower: the dashboards' per-node step-time
    and straggler-score queries answer with both nodes, and the slow node's relative score stands out."""
    config, url = prometheus
    args = ["--nodes", "2:2", "--probes-stragglers-step-check-interval-s=0.5", "--heartbeat-timeout-s=300"]
    with running_master(tmp_path, job_id="gpt", args=args) as (grpc_addr, http_addr):
        nodes_step(grpc_addr, job_id="gpt", step_s={"n0": 0.1, "n1": 0.3})
        token = tmp_path / "metrics-token"
        token.write_text(TOKEN)
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "phalanx-masters",
                            "authorization": {"type": "Bearer", "credentials_file": str(token)},
                            "static_configs": [
                                {"targets": [http_addr], "labels": {"namespace": "ml", "elasticjob": "gpt"}}
                            ],
                        }
                    ],
                }
            )
        )
        assert httpx.post(f"{url}/-/reload", timeout=10).status_code == 200
        relative = eventually(
            lambda: _api(
                url, "query", query='phalanx_node_straggler_score{elasticjob="gpt", kind="relative"} > 1.5'
            )["result"],
            timeout=30,
            what="the slow node's relative score",
            interval=0.5,
        )
        assert [r["metric"]["node"] for r in relative] == ["n1"]
        assert float(relative[0]["value"][1]) == pytest.approx(3.0, rel=0.05)
        nodes = httpx.get(
            f"http://{http_addr}/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        ).json()["nodes"]
        straggler = {n["node_id"]: n["straggler"] for n in nodes}
        assert straggler["n1"]["verdict"] in ("suspect", "slow"), straggler
        assert straggler["n1"]["relative"] == pytest.approx(3.0, rel=0.05)
        assert straggler["n0"]["verdict"] == "ok", straggler
        per_node = {
            "phalanx_node_step_time_seconds": {("n0",), ("n1",)},
            "phalanx_node_straggler_score": {
                (n, k) for n in ("n0", "n1") for k in ("relative", "individual")
            },
        }
        for path in DASHBOARDS:
            for expr in exprs(load(path)):
                names = metric_names(expr) & set(per_node)
                if not names or "$" not in expr:
                    continue
                query = expr.replace("$namespace", "ml").replace("$elasticjob", "gpt")
                result = _api(url, "query", query=query)["result"]
                [name] = names
                labels = ("node",) if name == "phalanx_node_step_time_seconds" else ("node", "kind")
                shown = {tuple(r["metric"][k] for k in labels) for r in result}
                assert shown == per_node[name], f"{path.name}: {query} -> {result}"
