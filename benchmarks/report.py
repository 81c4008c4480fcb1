"""Writes ``docs/benchmarks.md`` and its plots from ``benchmarks/results/*.json`` (`make bench`'s last step).

The page is generated, never edited by hand, and written for a reader rather than as a dump of the JSON:
per benchmark (a family of result files, one per run of ``benchmarks/<name>.py``) it gives what the
benchmark shows in one sentence (the first sentence of its module's docstring), then per result file the
machine, the date and the notes the run recorded, a few tables of the figures that matter, each with a
label and a unit, phalanx and the peers that ran in the same run side by side, and a link to the full JSON.

Which figures matter is declared per family in :mod:`benchmarks.figures` (``FAMILIES``): a table names
its columns (phalanx, the peers, the code before a change) and, per row, the JSON path of each column's
figure. The figures themselves are only ever read from the JSON, so a changed result regenerates the page;
a figure a file lacks is left out of its table, and a declared path that no result of its family holds fails
tests/shipping/test_benchmarks_page.py, so a renamed field cannot silently vanish from the page.

Three plots put phalanx beside the peers at the top: recovery after a worker kill, goodput under a
failure schedule, and the time a checkpoint blocks training.

    .venv/bin/python -m benchmarks.report
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.figures import FAMILIES, Family, Row, Run, Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS = ROOT / "docs"
PLOTS = DOCS / "benchmarks"

DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
# What a run says about itself beside its figures: shown under its machine line, in this order.
NOTES = ("note", "notes", "what", "provenance", "running_beside")
# Stands for a path that a result does not hold (a JSON null is a recorded outcome, so it cannot).
MISSING: Any = object()


def family_of(path: Path) -> Family | None:
    """The family of a result file: ``recovery-512mb.json`` is ``recovery``'s, ``master-capacity.json``
    ``master_capacity``'s (the longest family name that the file's name starts with, then ends or goes on
    with a variant)."""
    stem = path.stem.replace("-", "_")
    matches = [f for f in FAMILIES if stem == f.name or stem.startswith(f"{f.name}_")]
    return max(matches, key=lambda f: len(f.name)) if matches else None


def module_purpose(name: str) -> str:
    """What benchmark ``name`` shows, in one sentence: the first sentence of its module's docstring, where
    its author says it (and where a change of the benchmark changes it too)."""
    path = HERE / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None
    if not doc:
        return ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z])", paragraph, maxsplit=1)[0]


def find(result: object, path: str) -> Any:
    """What ``path`` (keys and list indices joined by dots; empty parts skipped, so an empty ``{run}``
    adds nothing) names in ``result``, or :data:`MISSING`."""
    node: Any = result
    for part in (p for p in path.split(".") if p):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def figure(result: object, path: str) -> Any:
    """The figure at ``path``: a number, a list of numbers (one per run), a string, a flag or a JSON null;
    :data:`MISSING` where the result holds none there (or holds a whole object: no figure by itself)."""
    value = find(result, path)
    if value is MISSING or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and value and all(is_number(v) for v in value):
        return value
    return MISSING


def is_number(value: object) -> bool:
    """A figure that can be scaled and divided (a JSON true is a flag, though Python counts it an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def declared_figures(family: Family) -> Iterator[tuple[str, list[str]]]:
    """Every figure path ``family`` declares, with the paths it stands for (one per run of its table): the
    test holds each to be found in at least one of the family's results."""
    for fact in family.setup:
        yield fact.path, [fact.path]
    for table in family.tables:
        for row in table.rows:
            for template in row.cells.values():
                yield template, [template.replace("{run}", run.key) for run in table.runs]


def declared_runs(family: Family) -> Iterator[str]:
    """The JSON path of every run ``family`` declares (the whole file's, "", aside)."""
    for table in family.tables:
        yield from (run.key for run in table.runs if run.key)


def fmt(value: float) -> str:
    """Three significant digits (a count exactly), with thousands separated: what the noise of a 2-core
    machine leaves meaningful, and what a reader takes in at a glance."""
    if isinstance(value, int):
        return f"{value:,}"
    rounded = float(f"{value:.3g}")
    if rounded.is_integer() and abs(rounded) < 1e15:
        return f"{int(rounded):,}"
    return f"{rounded:.3g}"


# A unit's suffix, and the factor the JSON's figure is shown with ("share" is a fraction shown as %).
UNITS: dict[str, tuple[float, str]] = {
    "": (1, ""),
    "share": (100, "%"),
    "%": (1, "%"),
    "x": (1, "x"),
    "/s": (1, "/s"),
    "/min": (1, "/min"),
}


def with_unit(value: Any, unit: str) -> str:
    """A figure as the page shows it: with its unit, seconds below 0.1 s as ms, bytes as MiB or GiB,
    fractions as %, a list (one figure per run) joined by "; "."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) or unit == "text":
        return str(value)
    numbers = value if isinstance(value, list) else [value]
    largest = max(abs(n) for n in numbers)
    scale, suffix = UNITS.get(unit, (1, f" {unit}"))
    if unit == "s" and 0 < largest < 0.1:
        scale, suffix = 1000, " ms"
    elif unit == "B":
        scale, suffix = (2**-30, " GiB") if largest >= 2**30 else (2**-20, " MiB")
    return "; ".join(fmt(n * scale if scale != 1 else n) for n in numbers) + suffix


def cell_text(value: Any, unit: str, row: Row) -> str:
    """A table cell: empty where the result lacks the figure, the row's word for a recorded null."""
    if value is MISSING:
        return ""
    if value is None:
        return row.null
    return with_unit(value, unit).replace("|", "\\|")


def ratio(result: object, table: Table, row: Row, run: Run) -> str:
    """The table's ratio for ``row``, where both its figures are numbers and the divisor is not zero."""
    if table.ratio is None or not row.compare:
        return ""
    top, bottom = (figure(result, path(row, column, run)) for column in table.ratio)
    if not (is_number(top) and is_number(bottom)) or bottom == 0:
        return ""
    return f"{fmt(top / bottom)}x"


def path(row: Row, column: str, run: Run) -> str:
    """The JSON path of ``row``'s figure in ``column`` for ``run`` ("" where the row has none there)."""
    return row.cells.get(column, "").replace("{run}", run.key)


def run_label(result: object, run: Run) -> str:
    """The run's label, its ``{field}``s filled from the run's own scalars (e.g. which operator a run of the
    operator's load measured: the JSON says it, so the page need not repeat it) and ``{key}`` from its key."""
    node = find(result, run.key)
    fields = (
        {k: v for k, v in node.items() if not isinstance(v, (dict, list))} if isinstance(node, dict) else {}
    )
    fields["key"] = run.key.rsplit(".", maxsplit=1)[-1]

    def fill(match: re.Match[str]) -> str:
        value = fields.get(match[1], match[0])
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        return fmt(value) if is_number(value) else str(value)

    return re.sub(r"\{(\w+)\}", fill, run.label)


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """GitHub Markdown: a header, its rule, a line per row; an empty cell stays one space wide."""

    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return [line(header), "|" + "---|" * len(header), *(line(cells) for cells in body)]


def figures_table(result: object, table: Table) -> list[str]:
    """A row per quantity, grouped under each run's label, a column per arm (those with a figure here),
    and the ratio column; nothing where the result holds none of the table's figures."""
    groups: list[tuple[str, Run, list[Row]]] = []
    for run in table.runs:
        rows = [
            row
            for row in table.rows
            if any(figure(result, path(row, column, run)) is not MISSING for column in table.columns)
        ]
        if rows:
            groups.append((run_label(result, run), run, rows))
    columns = [
        column
        for column in table.columns
        if any(
            figure(result, path(row, column, run)) is not MISSING for _, run, rows in groups for row in rows
        )
    ]
    if not columns:
        return []
    with_ratio = any(ratio(result, table, row, run) for _, run, rows in groups for row in rows)
    header = [table.title, *columns]
    if with_ratio and table.ratio:
        header.append(" / ".join(table.ratio))
    body: list[list[str]] = []
    for label, run, rows in groups:
        if label:
            body.append([f"**{label}**"] + [""] * (len(header) - 1))
        for row in rows:
            cells = [
                cell_text(figure(result, path(row, column, run)), table.units.get(column, row.unit), row)
                for column in columns
            ]
            body.append([row.label, *cells, *([ratio(result, table, row, run)] if with_ratio else [])])
    return markdown_table(header, body)


def runs_table(result: object, table: Table) -> list[str]:
    """A row per run (those with a figure here), a column per quantity of the table's one column."""
    (column,) = table.columns
    runs = [
        run
        for run in table.runs
        if any(figure(result, path(row, column, run)) is not MISSING for row in table.rows)
    ]
    rows = [
        row
        for row in table.rows
        if any(figure(result, path(row, column, run)) is not MISSING for run in runs)
    ]
    if not rows:
        return []
    body = [
        [run_label(result, run)]
        + [cell_text(figure(result, path(row, column, run)), row.unit, row) for row in rows]
        for run in runs
    ]
    return markdown_table([table.title, *(row.label for row in rows)], body)


def machine_of(result: dict[str, Any]) -> str:
    """The machine a result ran on, in its own words where it has them: figures of a 2-core VM and of a
    16-core GPU host are not comparable, and the reader has to know which one a figure is from."""
    for key in ("machine", "device"):
        if isinstance(result.get(key), str):
            return str(result[key])
    cpus = (
        result.get("cpus")
        or result.get("cores")
        or result.get("cpu_count")
        or result.get("setup", {}).get("cpus")
    )
    return f"{cpus} cores, no GPU" if cpus else "the 2-core development machine, no GPU"


def dated(path: Path, result: dict[str, Any]) -> str:
    """The date of a result: the one it records, else the day it was committed; one not committed yet (new,
    or changed since) is dated by its file, which is the day it will be committed on."""
    for key in ("date", "date_utc"):
        if isinstance(result.get(key), str) and DATE.match(result[key]):
            return str(result[key])[:10]
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    committed = subprocess.run(
        ["git", "log", "-1", "--format=%cs", "--", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if committed and not changed:
        return committed
    return datetime.fromtimestamp(path.stat().st_mtime, tz=UTC).date().isoformat()


def result_section(path: Path, family: Family | None) -> str:
    """One result file: its machine, date and notes, its set-up in a line, its tables, and the link to the
    whole JSON (every figure the tables leave out is there)."""
    result = json.loads(path.read_text())
    link = f"benchmarks/results/{path.name}"
    lines = [
        f"#### {path.stem}",
        "",
        f"*Machine:* {machine_of(result)}. *Date:* {dated(path, result)}."
        f" *Full result:* [`{link}`](../{link}).",
        "",
    ]
    lines += [
        f"*{key.replace('_', ' ').capitalize()}:* {result[key]}\n"
        for key in NOTES
        if isinstance(result.get(key), str)
    ]
    if family is None:
        return "\n".join([*lines, "*No figures of this benchmark are declared in benchmarks/report.py.*", ""])
    facts = [
        f"{fact.label}: {with_unit(value, fact.unit)}"
        for fact in family.setup
        if (value := figure(result, fact.path)) is not MISSING and value is not None
    ]
    if facts:
        lines += [f"*Set-up:* {'; '.join(facts)}.", ""]
    for table in family.tables:
        rendered = runs_table(result, table) if table.by_run else figures_table(result, table)
        if rendered:
            lines += [*rendered, ""]
    return "\n".join(lines)


def family_section(family: Family, paths: list[Path], plots: Mapping[str, str]) -> str:
    """A benchmark: what it shows, its plot beside the peers where it has one, then each of its results."""
    lines = [f"### {family.title}", ""]
    purpose = module_purpose(family.name)
    if purpose:
        lines += [purpose, ""]
    if family.plot and family.plot in plots:
        lines += [plots[family.plot].split("\n", maxsplit=1)[0], ""]
    # The plain run (recovery.json) first, then its variants (recovery-512mb.json, ...).
    paths = sorted(paths, key=lambda p: (p.stem.replace("-", "_") != family.name, p.name))
    return "\n".join([*lines, *(result_section(path, family) for path in paths)])


def bar_plot(
    name: str, title: str, unit: str, bars: dict[str, float], note: str, *, draw_in: Path | None
) -> str | None:
    """The Markdown of a bar chart of ``bars`` (None without data); with ``draw_in``, also its PNG there."""
    if not bars:
        return None
    if draw_in is not None:
        draw(draw_in / f"{name}.png", title, unit, bars, note)
    return f"![{title}](benchmarks/{name}.png)\n\n*{note}*\n"


def draw(path: Path, title: str, unit: str, bars: dict[str, float], note: str) -> None:
    import matplotlib  # the `timeline` extra; only `make bench` draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.45 * len(bars)))
    labels = list(bars)
    colors = ["#2b6cb0" if label.startswith("phalanx") else "#a0aec0" for label in labels]
    ax.barh(labels, [bars[k] for k in labels], color=colors)
    for i, label in enumerate(labels):
        ax.text(bars[label], i, f" {fmt(bars[label])}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.2)
    fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def recovery_plot(draw_in: Path | None) -> str | None:
    bars: dict[str, float] = {}
    small, large = load("recovery"), load("recovery-512mb")
    if small:
        bars["phalanx-run, small state"] = small["phalanx"]["median_recovery_s"]
        bars["torchrun, small state"] = small["torchrun"]["median_recovery_s"]
    if large:
        newest = (
            large.get("after_replayed_imports") or large.get("after_warm_spares_preimport_dynamo") or large
        )
        bars["phalanx-run, 512 MiB per rank"] = newest["phalanx"]["median_recovery_s"]
        bars["torchrun, 512 MiB per rank"] = newest["torchrun"]["median_recovery_s"]
    note = f"worker SIGKILL -> next step, median; same run per pair; {machine_of(small or {})}"
    return bar_plot(
        "recovery", "Recovery after a worker kill (lower is better)", "seconds", bars, note, draw_in=draw_in
    )


def goodput_plot(draw_in: Path | None) -> str | None:
    result = load("goodput")
    if not result:
        return None
    bars = {
        name: float(entry["effective_training_time"]) * 100
        for name, entry in (result.get("launchers") or {}).items()
        if isinstance(entry, dict) and isinstance(entry.get("effective_training_time"), (int, float))
    }
    note = f"effective training time under one failure schedule, same run; {machine_of(result)}"
    return bar_plot(
        "goodput",
        "Goodput under failures (higher is better)",
        "% of wall time training",
        bars,
        note,
        draw_in=draw_in,
    )


def checkpoint_plot(draw_in: Path | None) -> str | None:
    result = load("checkpoint")
    if not result:
        return None
    names = {
        "phalanx": "phalanx flash",
        "dlrover": "DLRover flash",
        "dcp_async": "torch DCP async",
        "torch_save_shm": "torch.save to /dev/shm",
        "torch_save_disk": "torch.save to disk",
    }
    runs = result.get("results", {})
    bars = {
        label: runs[key]["blocking_s"] for key, label in names.items() if "blocking_s" in runs.get(key, {})
    }
    size_gib = result.get("size_bytes", 0) / 2**30
    note = f"training blocked per save of {size_gib:.1f} GiB, median; {machine_of(result)}"
    return bar_plot(
        "checkpoint", "Checkpoint stall (lower is better)", "seconds", bars, note, draw_in=draw_in
    )


def render(draw_in: Path | None = None) -> str:
    """The page; with ``draw_in``, the plots are drawn there too."""
    plots = {
        name: markdown
        for name, markdown in (
            ("recovery", recovery_plot(draw_in)),
            ("goodput", goodput_plot(draw_in)),
            ("checkpoint", checkpoint_plot(draw_in)),
        )
        if markdown
    }
    by_family: dict[str, list[Path]] = {}
    undeclared: list[Path] = []
    for path in sorted(RESULTS.glob("*.json")):
        family = family_of(path)
        if family is None:
            undeclared.append(path)
        else:
            by_family.setdefault(family.name, []).append(path)
    sections = [family_section(f, by_family[f.name], plots) for f in FAMILIES if f.name in by_family]
    if undeclared:
        sections += ["### Other results\n", *(result_section(path, None) for path in undeclared)]
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Generated by `make bench` (`benchmarks/report.py`) from `benchmarks/results/*.json`;"
            " do not edit by hand. Every benchmark runs phalanx and the peers it is compared with in"
            " the same run, on the same machine, and reports medians: the development machine has"
            " 2 cores and is noisy.",
            "",
            "Each benchmark below says what it shows, then gives per result file the machine and date it ran"
            " on, the figures that matter with their units (phalanx first, the peers beside it; a column"
            " headed `a / b` divides the first by the second; `a; b` are the figures of two runs) and a link"
            " to the whole JSON, which holds every sample and setting the tables leave out.",
            "",
            "## Beside the peers",
            "",
            *plots.values(),
            "## Every result",
            "",
            *sections,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    args = parser.parse_args()
    args.out.write_text(render(draw_in=PLOTS))
    print(f"wrote {args.out} and {len(list(PLOTS.glob('*.png')))} plots under {PLOTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
