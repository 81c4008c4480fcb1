"""``phalanx timeline``: the ranks' steps and collectives around a failure, as a trace and a picture.

Reads the master's ``GET /v1/timeline`` (what it keeps of the intervals the ranks' recorders send: the
last minutes per rank) and writes

* ``PREFIX.json``: a trace in the Chrome trace event format, which Perfetto (ui.perfetto.dev) and
  chrome://tracing open. One process per node (``pid``, named by a metadata event), one thread per rank
  (``tid`` = the global rank), a complete event (``ph: "X"``, ``ts`` and ``dur`` in microseconds from the
  window's start) per step or collective, and an instant event (``ph: "i"``) per failure. An interval
  still open when the master answered is drawn up to that moment, named ``... (open)`` with
  ``args.open``; one whose process went away first is marked ``args.unfinished``.
* ``PREFIX.png``: one row per rank, steps in grey, each collective in a colour of its own, open intervals
  hatched, failures as red vertical lines.
* ``PREFIX.flight-ID-rankR.json``: the flight-recorder dump a hung rank's recorder gave its agent (torch's
  own JSON: NCCL's on a GPU, gloo's on the CPU), per failure ``ID`` that kept one. The failure's instant
  event carries the rest of each rank's hang evidence in ``args.hang``: side, ages, the collective it was in.

``--around ID`` centres the window on failure ``ID`` (``phalanx status`` lists them, ``#ID``), ``--around
latest`` on the newest, ``--around UNIX`` on a time; without it, the last ``--window`` seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from phalanx.api.errors import ConfigError
from phalanx.cli.masterclient import add_kube_flags, add_master_flags, master_from_args

__all__ = ["draw_png", "flight_recorder_dumps", "png_size", "register", "trace_events"]

STEP = "step"
PNG_WIDTH_IN, PNG_DPI = 14.0, 100
ROW_IN, MARGIN_IN, MIN_HEIGHT_IN, MAX_HEIGHT_IN = 0.32, 1.6, 3.0, 160.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "timeline",
        help="Write a Perfetto/Chrome trace (JSON) and a PNG of the ranks' steps and collectives.",
        description=(
            "Reads what the master keeps of the ranks' intervals (the last minutes) and writes PREFIX.json "
            "(Chrome trace event format; open it in ui.perfetto.dev) and PREFIX.png. Reach the master with "
            "--master URL and the job token, or with --job NAME through the kube context."
        ),
    )
    add_master_flags(p)
    p.add_argument(
        "--job", default="", help="ElasticJob name: the master and token through the kube context."
    )
    add_kube_flags(p)
    p.add_argument(
        "--around",
        default="",
        help="Centre on a failure id (#ID in `phalanx status`), 'latest' (the newest failure) or a unix "
        "time.",
    )
    p.add_argument(
        "--window", type=float, default=60.0, help="Seconds each side of --around (else: the last ones)."
    )
    p.add_argument("--node", default="", help="Only this node's ranks.")
    p.add_argument(
        "-o", "--output", default="timeline", help="Output prefix: writes PREFIX.json, PREFIX.png."
    )
    p.add_argument("--no-png", action="store_true", help="Write the trace only (no matplotlib needed).")
    p.set_defaults(handler=_run)


# ----------------------------------------------------------------------------------------------------
# The trace


def _us(ns: int, origin_ns: int) -> float:
    return (ns - origin_ns) / 1000.0


def trace_events(timeline: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of a ``/v1/timeline`` answer. Pure.

    Complete events on one thread must nest (Perfetto drops a slice that overlaps its parent's end), so a
    collective that outlasts its step, which clock skew between CUDA events and the host can make, is cut
    at the step's end and marked ``args.clipped``.
    """
    origin_ns = int(timeline["start_unix"] * 1e9)
    now_ns = int(timeline["now_unix"] * 1e9)
    nodes = sorted(
        {r["node"] for r in timeline["ranks"]} | {f["node"] for f in timeline["failures"] if f["node"]}
    )
    pid_of = {node: i + 1 for i, node in enumerate(nodes)}
    events: list[dict[str, Any]] = []
    for node, pid in pid_of.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": node}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for r in timeline["ranks"]:
        pid, tid = pid_of[r["node"]], r["rank"]
        label = f"rank {r['rank']} (local {r['local_rank']})"
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
        slices = []
        for iv in r["intervals"]:
            is_open = iv["end_unix_ns"] == 0
            end_ns = max(iv["start_unix_ns"], now_ns if is_open else iv["end_unix_ns"])
            args = {"group": iv["group"], "seq": iv["seq"], "device": iv["device"]}
            if is_open:
                args["open"] = True
            if iv.get("unfinished"):
                args["unfinished"] = True
            slices.append(
                {
                    "name": iv["name"] + (" (open)" if is_open else ""),
                    "cat": STEP if iv["name"] == STEP else "collective",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(iv["start_unix_ns"], origin_ns),
                    "dur": (end_ns - iv["start_unix_ns"]) / 1000.0,
                    "args": args,
                }
            )
        events += _nested(slices)
    for f in timeline["failures"]:
        event: dict[str, Any] = {
            "name": f"{f['kind']} #{f['id']}",
            "cat": "failure",
            "ph": "i",
            "s": "g",
            "ts": _us(int(f["unix"] * 1e9), origin_ns),
            "pid": pid_of.get(f["node"], 0),
            "tid": max(0, int(f["rank"])),
            "args": {
                "node": f["node"],
                "rank": f["rank"],
                "round": f.get("round", 0),
                "message": f["message"],
            },
        }
        if f.get("hang"):  # a hang's evidence per rank; the dumps themselves go to files of their own
            event["args"]["hang"] = [
                {k: v for k, v in rank.items() if k != "nccl_trace"}
                | ({"nccl_trace_chars": len(rank["nccl_trace"])} if "nccl_trace" in rank else {})
                for rank in f["hang"]
            ]
        events.append(event)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "start_unix": timeline["start_unix"],
            "end_unix": timeline["end_unix"],
            "now_unix": timeline["now_unix"],
            "ts_origin": "microseconds since start_unix",
        },
    }


def _nested(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``slices`` of one thread in start order with every slice inside the one it starts in."""
    slices.sort(key=lambda s: (s["ts"], -s["dur"]))
    stack: list[float] = []  # end times of the enclosing slices
    for s in slices:
        while stack and stack[-1] <= s["ts"]:
            stack.pop()
        end = s["ts"] + s["dur"]
        if stack and end > stack[-1]:
            s["dur"] = stack[-1] - s["ts"]
            s["args"]["clipped"] = True
            end = stack[-1]
        stack.append(end)
    return slices


# ----------------------------------------------------------------------------------------------------
# The picture


def png_size(rows: int) -> tuple[int, int]:
    """Width and height in pixels of the PNG of ``rows`` ranks."""
    height = min(MAX_HEIGHT_IN, max(MIN_HEIGHT_IN, MARGIN_IN + ROW_IN * max(1, rows)))
    return round(PNG_WIDTH_IN * PNG_DPI), round(height * PNG_DPI)


def draw_png(
    timeline: dict[str, Any], path: Path, *, origin_unix: float, origin_label: str
) -> tuple[int, int]:
    """Draws ``timeline`` into ``path``; x is seconds from ``origin_unix``. Returns the size in pixels."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "drawing the PNG needs matplotlib: pip install 'phalanx[timeline]' (or use --no-png)"
        ) from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ranks = timeline["ranks"]
    width, height = png_size(len(ranks))
    fig, ax = plt.subplots(figsize=(width / PNG_DPI, height / PNG_DPI), dpi=PNG_DPI)
    try:
        now = timeline["now_unix"]
        palette = [plt.get_cmap("tab10")(i) for i in range(10)]
        colours: dict[str, Any] = {}
        # One bar collection per (row, kind, open): a call per interval would take minutes for 64 ranks.
        bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
        for row, r in enumerate(ranks):
            for iv in r["intervals"]:
                start = iv["start_unix_ns"] / 1e9
                is_open = iv["end_unix_ns"] == 0
                end = now if is_open else iv["end_unix_ns"] / 1e9
                bars.setdefault((row, iv["name"], is_open), []).append(
                    (start - origin_unix, max(end - start, 1e-4))
                )
        for (row, name, is_open), xranges in sorted(bars.items(), key=lambda kv: kv[0][1] != STEP):
            if name == STEP:
                colour, y, h = "#c8c8c8", row - 0.4, 0.8
            else:
                if name not in colours:
                    colours[name] = palette[len(colours) % len(palette)]
                colour, y, h = colours[name], row - 0.25, 0.5
            ax.broken_barh(
                xranges,
                (y, h),
                facecolors=colour,
                edgecolor="#b00000" if is_open else "none",
                hatch="//" if is_open else None,
                linewidth=0.8,
            )
        for f in timeline["failures"]:
            x = f["unix"] - origin_unix
            ax.axvline(x, color="#d00000", linewidth=1.5)
            ax.annotate(
                f"{f['kind']} #{f['id']} {f['node']}",
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="#d00000",
            )
        ax.set_yticks(range(len(ranks)), [f"{r['node']} r{r['rank']}" for r in ranks], fontsize=8)
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_xlim(*_x_range(timeline, origin_unix))
        ax.set_xlabel(origin_label)
        ax.grid(axis="x", color="#eeeeee")
        legend: list[Any] = [Patch(facecolor="#c8c8c8", label="step")]
        legend += [Patch(facecolor=c, label=name) for name, c in colours.items()]
        legend.append(Patch(facecolor="white", edgecolor="#b00000", hatch="//", label="open"))
        legend.append(Line2D([0], [0], color="#d00000", label="failure"))
        ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        if not ranks:
            ax.text(0.5, 0.5, "no intervals in this window", transform=ax.transAxes, ha="center")
        fig.subplots_adjust(left=0.1, right=0.86, top=0.95, bottom=min(0.4, 0.55 / (height / PNG_DPI)))
        fig.savefig(path, dpi=PNG_DPI)  # no bbox_inches="tight": the size stays what png_size says
    finally:
        plt.close(fig)
    return width, height


def _x_range(timeline: dict[str, Any], origin_unix: float) -> tuple[float, float]:
    """The window, narrowed to where something happened (a window of minutes with seconds of data would
    draw a sliver), with a margin."""
    now = timeline["now_unix"]
    lo, hi = timeline["start_unix"], min(timeline["end_unix"], now)
    times = [iv["start_unix_ns"] / 1e9 for r in timeline["ranks"] for iv in r["intervals"]]
    times += [f["unix"] for f in timeline["failures"]]
    if times:
        first = max(lo, min(times))
        lo = max(lo, first - 0.05 * max(hi - first, 1.0))
    return lo - origin_unix, hi - origin_unix


# ----------------------------------------------------------------------------------------------------
# The command


def flight_recorder_dumps(timeline: dict[str, Any]) -> list[tuple[str, str]]:
    """The hung ranks' flight-recorder dumps in a ``/v1/timeline`` answer: (``flight-ID-rankR``, the
    dump as torch wrote it), per failure and rank. Pure."""
    return [
        (f"flight-{int(f['id'])}-rank{int(rank['rank'])}", rank["nccl_trace"])
        for f in timeline["failures"]
        for rank in f.get("hang", [])
        if rank.get("nccl_trace")
    ]


def _run(args: argparse.Namespace) -> int:
    if not args.window > 0:
        raise ConfigError("--window must be a positive number of seconds", field="window")
    api = master_from_args(args, job=args.job)
    around = args.around.strip()
    timeline = api.get("/v1/timeline", around=around, window_s=args.window, node=args.node)
    if around == "latest":
        around = str(timeline["around_failure"]["id"])
    prefix = Path(args.output)
    if prefix.suffix in (".json", ".png"):
        prefix = prefix.with_suffix("")
    trace_path = prefix.with_name(prefix.name + ".json")
    trace_path.write_text(json.dumps(trace_events(timeline)))
    intervals = sum(len(r["intervals"]) for r in timeline["ranks"])
    print(
        f"wrote {trace_path} ({len(timeline['ranks'])} ranks, {intervals} intervals, "
        f"{len(timeline['failures'])} failures); open it in ui.perfetto.dev"
    )
    for name, text in flight_recorder_dumps(timeline):
        dump_path = prefix.with_name(f"{prefix.name}.{name}.json")
        dump_path.write_text(text)
        print(f"wrote {dump_path} (a hung rank's flight recorder, {len(text)} characters)")
    if not args.no_png:
        if around:
            origin, label = timeline["start_unix"] + args.window, f"seconds from {_label(around)}"
        else:
            origin, label = timeline["now_unix"], "seconds before now"
        png_path = prefix.with_name(prefix.name + ".png")
        w, h = draw_png(timeline, png_path, origin_unix=origin, origin_label=label)
        print(f"wrote {png_path} ({w}x{h})")
    return 0


def _label(around: str) -> str:
    return f"failure #{around}" if float(around) < 1e9 else f"unix {around}"
