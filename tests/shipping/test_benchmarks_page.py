"""docs/benchmarks.md is generated from the committed results: it says what they say, and its plots exist."""

from __future__ import annotations

import re

from benchmarks import report


def test_the_benchmarks_page_is_generated_from_the_committed_results() -> None:
    page = (report.DOCS / "benchmarks.md").read_text()
    assert page == report.render(), "docs/benchmarks.md is stale: run `.venv/bin/python -m benchmarks.report`"
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page):
        assert (report.DOCS / image).is_file(), f"docs/benchmarks.md shows {image}, which is not committed"


def test_every_result_names_its_machine_and_date() -> None:
    page = (report.DOCS / "benchmarks.md").read_text()
    sections = page.split("\n### ")[1:]
    assert len(sections) == len(list(report.RESULTS.glob("*.json")))
    for text in sections:
        assert re.search(r"\*Machine:\* .+\. \*Date:\* \d{4}-\d{2}-\d{2}\.", text), text[:200]


def test_every_benchmark_has_a_quick_form_that_keeps_its_arguments_known() -> None:
    """`make bench QUICK=1` runs each benchmark `make bench` runs, with arguments the benchmark accepts."""
    from benchmarks import run_all

    assert run_all.QUICK.keys() == run_all.BENCHMARKS.keys()
    for name, args in run_all.QUICK.items():
        source = (report.HERE / f"{name}.py").read_text()
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"benchmarks/{name}.py has no {flag}"


def test_the_quick_run_fails_on_an_error_in_any_arm() -> None:
    from benchmarks.run_all import arm_errors

    assert arm_errors({"torchrun": {"median_s": 1.0}, "phalanx": {"median_s": 0.5}}) == []
    assert arm_errors({"name": "x", "error": "exit 1"}) == ["benchmark: exit 1"]
    nested = {"dlrover": {"error": "no DLRover environment"}, "runs": [{"ok": 1}, {"error": "timed out"}]}
    assert arm_errors(nested) == ["dlrover: no DLRover environment", "runs[1]: timed out"]
