"""The PromQL reader the dashboard tests rely on: if it missed names, the metric check could not fail."""

from __future__ import annotations

import pytest

from tests.shipping.promql import label_names, metric_names


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        ("up", {"up"}, set()),
        (
            "sum by (job, reason) "
            '(rate(phalanx_evictions_total{namespace=~"$ns", job=~"a,b"}[$__rate_interval]))',
            {"phalanx_evictions_total"},
            {"job", "reason", "namespace"},
        ),
        (
            "histogram_quantile(0.99, sum by (le, method) (rate(phalanx_rpc_duration_seconds_bucket[5m])))",
            {"phalanx_rpc_duration_seconds_bucket"},
            {"le", "method"},
        ),
        (
            "max by (job) (phalanx_training_step)"
            " - max by (job) (phalanx_checkpoint_committed_step offset 1m)",
            {"phalanx_training_step", "phalanx_checkpoint_committed_step"},
            {"job"},
        ),
        (
            'max by (job, phase) (phalanx_job_phase{phase!="Failed"}) == 1',
            {"phalanx_job_phase"},
            {"job", "phase"},
        ),
        ("a_total / on (job) group_left (x) b_total", {"a_total", "b_total"}, {"job", "x"}),
        ('clamp_min(deriv(phalanx_training_step{x="rate(y)"}[1m]), 0)', {"phalanx_training_step"}, {"x"}),
        ("increase(phalanx_restarts_total[$__range])", {"phalanx_restarts_total"}, set()),
    ],
)
def test_reads_metric_and_label_names(expr: str, metrics: set[str], labels: set[str]) -> None:
    assert metric_names(expr) == metrics
    assert label_names(expr) == labels
