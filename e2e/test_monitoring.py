"""Monitoring without the prometheus-operator: a Prometheus configured with deploy/prometheus-scrape.yaml, as
a cluster without the monitoring.coreos.com CRDs would run it, finds the masters and the operator through the
API server, scrapes them over TLS with the metrics token the operator keeps, and labels the series as the
chart's dashboards and alerts select them (`elasticjob`, `namespace`), `job` left to the scrape job."""

from __future__ import annotations

import base64
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.eventually import eventually
from tests.gotools import go_built

from e2e.conftest import RELEASE_NAMESPACE, Target
from e2e.test_elasticjob import _apply_example, _training
from phalanx.api.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(480)]

ROOT = Path(__file__).resolve().parents[1]
SCRAPE = ROOT / "deploy" / "prometheus-scrape.yaml"
RULES = ROOT / "charts" / "phalanx" / "alerts" / "phalanx.rules.yaml"


def _secret_key(t: Target, suffix: str, key: str) -> str:
    """The value of ``key`` of the release namespace's Secret whose name ends with ``suffix``."""
    secrets = t.kube.get("secrets", "-n", RELEASE_NAMESPACE)["items"]
    (secret,) = [s for s in secrets if s["metadata"]["name"].endswith(suffix)]
    return base64.b64decode(secret["data"][key]).decode()


@contextlib.contextmanager
def _prometheus(t: Target, folder: Path) -> Iterator[str]:
    """Prometheus on this machine with deploy/prometheus-scrape.yaml's jobs as written, but for where it finds
    the API server (a kubeconfig instead of its Pod's service account) and its files (here, not /etc)."""
    (folder / "token").write_text(_secret_key(t, "-metrics-token", "token"))
    (folder / "ca.crt").write_text(_secret_key(t, "-ca", "tls.crt"))
    jobs: list[dict[str, Any]] = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    for job in jobs:
        job["authorization"]["credentials_file"] = str(folder / "token")
        if "tls_config" in job:
            job["tls_config"]["ca_file"] = str(folder / "ca.crt")
        for sd in job["kubernetes_sd_configs"]:
            sd["kubeconfig_file"] = str(t.kube.kubeconfig)
    config = folder / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
                "rule_files": [str(RULES)],
                "scrape_configs": jobs,
            }
        )
    )
    address = f"127.0.0.1:{free_port()}"
    argv = [
        go_built("prometheus", unchecked="monitoring unchecked"),
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={address}",
    ]
    with (folder / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://{address}"

        def ready() -> bool:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        eventually(ready, timeout=60, what="Prometheus ready", interval=0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _query(url: str, query: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_a_prometheus_without_the_operator_scrapes_the_masters_with_the_deploy_config(
    phalanx: Target, ns: str, tmp_path: Path
) -> None:
    if not phalanx.pods_reachable:
        pytest.skip("this machine does not reach the cluster's Pod IPs (Target.pods_reachable)")
    _apply_example(phalanx, ns, steps=300, step_s=0.2)
    _training(phalanx, ns)
    with _prometheus(phalanx, tmp_path) as url:
        selector = f'job="phalanx-masters", namespace="{ns}", elasticjob="tiny"'
        (up,) = eventually(
            lambda: _query(url, f"up{{{selector}}} == 1"),
            timeout=60,
            what="the master found and scraped over TLS with the token",
            interval=1,
        )
        (master,) = phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"]
        assert up["metric"]["pod"] == master["metadata"]["name"], up["metric"]
        step = eventually(
            lambda: _query(url, f"phalanx_training_step{{{selector}}} >= 3"),
            timeout=60,
            what="the job's step",
            interval=1,
        )
        assert step, step
        operator = eventually(
            lambda: _query(url, f'up{{job="phalanx-operator", namespace="{RELEASE_NAMESPACE}"}} == 1'),
            timeout=60,
            what="the operator scraped with the token",
            interval=1,
        )
        assert len(operator) == 1, operator
        # The chart's dashboards and alerts select by these labels: the job-overview step query answers, and
        # every alert rule evaluates on the scraped series without error.
        assert _query(
            url, f'max by (elasticjob) (phalanx_training_step{{namespace=~"{ns}", elasticjob=~"tiny"}})'
        )
        rules = eventually(
            lambda: [
                r
                for g in httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
                for r in g["rules"]
                if r.get("lastEvaluation", "").startswith("2")
            ],
            timeout=30,
            what="the rules evaluated",
            interval=1,
        )
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad
