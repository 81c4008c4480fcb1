"""Writes ``docs/benchmarks.md`` and its plots from ``benchmarks/results/*.json`` (`make bench`'s last step).

The page is generated, never edited by hand: each result file gets a section with the benchmark's purpose
(the first paragraph of its module's docstring), the machine it ran on and the date it was committed, and its
headline figures (medians, ratios, rates) flattened from the JSON. Three plots put phalanx beside the peers
that ran in the same run: recovery after a worker kill, goodput under a failure schedule, and the time a
checkpoint blocks training.

    .venv/bin/python -m benchmarks.report
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS = ROOT / "docs"
PLOTS = DOCS / "benchmarks"

# A figure is a headline when its key names a median, a ratio, a rate or a share; raw samples are not.
HEADLINE = re.compile(r"median|ratio|per_s|per_core|effective|goodput|overhead$|blocking_s$|p50|p99")
MAX_FIGURES = 24
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


def module_purpose(result_name: str) -> str:
    """The first paragraph of the docstring of the benchmark that wrote ``result_name`` (``recovery-512mb``
    was written by ``recovery.py``; ``master-capacity`` by ``master_capacity.py``)."""
    stem = result_name.replace("-", "_")
    candidates = sorted((p for p in HERE.glob("*.py") if stem.startswith(p.stem)), key=lambda p: -len(p.stem))
    for path in candidates:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            return " ".join(doc.split("\n\n")[0].split())
    return ""


def machine_of(result: dict[str, Any]) -> str:
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


def headline_figures(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted.key, value)`` for every scalar whose key reads as a headline figure."""
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from headline_figures(sub, f"{prefix}.{key}" if prefix else str(key))
    elif (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and HEADLINE.search(prefix.rsplit(".", maxsplit=1)[-1])
    ):
        yield prefix, value


def fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def section(path: Path) -> str:
    result = json.loads(path.read_text())
    figures = list(headline_figures(result))
    lines = [f"### {path.stem}", ""]
    purpose = module_purpose(path.stem)
    if purpose:
        lines += [purpose, ""]
    lines += [
        f"*Machine:* {machine_of(result)}. *Date:* {dated(path, result)}."
        f" *Source:* `benchmarks/results/{path.name}`.",
        "",
    ]
    if figures:
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| `{key}` | {fmt(value)} |" for key, value in figures[:MAX_FIGURES]]
        if len(figures) > MAX_FIGURES:
            lines.append(f"| ... | {len(figures) - MAX_FIGURES} more in the JSON |")
        lines.append("")
    return "\n".join(lines)


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
    plots = [p for p in (recovery_plot(draw_in), goodput_plot(draw_in), checkpoint_plot(draw_in)) if p]
    sections = [section(path) for path in sorted(RESULTS.glob("*.json"))]
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Generated by `make bench` (`benchmarks/report.py`) from `benchmarks/results/*.json`;"
            " do not edit by hand. Every benchmark runs phalanx and the peers it is compared with in"
            " the same run, on the same machine, and reports medians: the development machine has"
            " 2 cores and is noisy.",
            "",
            "## Beside the peers",
            "",
            *plots,
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
