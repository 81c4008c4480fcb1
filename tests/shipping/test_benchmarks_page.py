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
