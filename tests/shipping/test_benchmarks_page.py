"""docs/benchmarks.md is generated from the committed results: it says what they say, and its plots exist."""

from __future__ import annotations

import json
import re

from benchmarks import report


def test_the_benchmarks_page_is_generated_from_the_committed_results() -> None:
    page = (report.DOCS / "benchmarks.md").read_text()
    assert page == report.render(), "docs/benchmarks.md is stale: run `.venv/bin/python -m benchmarks.report`"
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page):
        assert (report.DOCS / image).is_file(), f"docs/benchmarks.md shows {image}, which is not committed"


def test_every_result_names_its_machine_and_date_and_links_its_json() -> None:
    page = (report.DOCS / "benchmarks.md").read_text()
    sections = page.split("\n#### ")[1:]
    results = sorted(report.RESULTS.glob("*.json"))
    assert sorted(text.split("\n", maxsplit=1)[0] for text in sections) == sorted(p.stem for p in results)
    for text in sections:
        assert re.search(r"\*Machine:\* .+\. \*Date:\* \d{4}-\d{2}-\d{2}\.", text), text[:200]
    for path in results:
        link = f"benchmarks/results/{path.name}"
        assert f"[`{link}`](../{link})" in page, f"docs/benchmarks.md does not link {link}"
        assert (report.DOCS / ".." / link).is_file()


def test_every_declared_figure_is_in_a_result_of_its_family() -> None:
    """A figure renamed or dropped in a benchmark's JSON fails here rather than vanishing from the page."""
    results: dict[str, list[object]] = {family.name: [] for family in report.FAMILIES}
    for path in report.RESULTS.glob("*.json"):
        family = report.family_of(path)
        assert family is not None, f"{path.name}: no family in benchmarks/figures.py declares its figures"
        results[family.name].append(json.loads(path.read_text()))
    missing = []
    for family in report.FAMILIES:
        assert results[family.name], f"{family.name}: declared, but no result in benchmarks/results/"
        for template, paths in report.declared_figures(family):
            if all(report.figure(r, p) is report.MISSING for r in results[family.name] for p in paths):
                missing.append(f"{family.name}: {template}")
        for key in report.declared_runs(family):
            if all(report.find(r, key) is report.MISSING for r in results[family.name]):
                missing.append(f"{family.name}: run {key}")
    assert not missing, "declared figures that no result of their family holds:\n" + "\n".join(missing)


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
