"""What the master's interval timeline costs at its bound, and what ``phalanx timeline`` takes to draw it.

* memory: 1,000 ranks (125 nodes x 8) each sending the most a beat may carry (256 intervals) twice, so
  every rank holds its share of the default budget (262,144 intervals): bytes traced by tracemalloc and
  the process's RSS growth;
* the master's cost per heartbeat: one node's beat of 8 ranks x 256 intervals into a full timeline;
* ``GET /v1/timeline``'s work at the bound: the answer of everything (cut to 65,536 intervals), its JSON;
* the CLI's work for 64 ranks x 5 minutes of 0.5 s steps with 4 collectives each: the trace, and the PNG.

Writes benchmarks/results/timeline.json and prints it as one JSON line.

    .venv/bin/python -m benchmarks.timeline
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from phalanx.api.v1 import master_pb2 as pb
from phalanx.cli.timeline import draw_png, trace_events
from phalanx.master.state.beat import BeatRanks, read_ranks
from phalanx.master.state.timeline import Timeline

NS = 1_000_000_000
OUT = Path(__file__).resolve().parent / "results" / "timeline.json"


def _beat(first_rank: int, now: float, *, ranks: int = 8, per_rank: int = 256) -> BeatRanks:
    """One heartbeat's ranks, as the master's writer hands them to the timeline (read once)."""
    progress = [
        pb.RankProgress(
            rank=first_rank + r,
            local_rank=r,
            pid=10_000 + first_rank + r,
            activity=pb.RankActivity(last_record_unix_ns=int(now * NS)),  # a recorder's rank
            intervals=[
                pb.Interval(
                    name="all_reduce",
                    group="dp:0-999",
                    seq=i,
                    start_unix_ns=int((now - 60 + i * 1e-3) * NS),
                    end_unix_ns=int((now - 60 + i * 1e-3 + 5e-4) * NS),
                )
                for i in range(per_rank)
            ],
        )
        for r in range(ranks)
    ]
    return read_ranks(pb.HeartbeatRequest(ranks=progress))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_and_beat_cost() -> dict[str, Any]:
    now = time.time()
    beats = [(f"node-{n}", _beat(n * 8, now)) for n in range(125)]
    # RSS first, without tracemalloc (whose own records would count): the peak grows only by the timeline.
    tl = Timeline()
    rss0 = _rss_mib()
    for _ in range(2):
        for node, ranks in beats:
            tl.observe(node, ranks, now=now)
    rss_growth = _rss_mib() - rss0
    costs = []
    for node, ranks in beats[:50]:
        start = time.perf_counter()
        tl.observe(node, ranks, now=now)
        costs.append(time.perf_counter() - start)
    start = time.perf_counter()
    window = tl.window(start=now - 600, end=now, now=now)
    window_s = time.perf_counter() - start
    start = time.perf_counter()
    body = json.dumps(window)
    json_s = time.perf_counter() - start
    kept, cap = tl.total, tl.cap()
    del tl, window, body
    fresh = Timeline()
    tracemalloc.start()
    for _ in range(2):
        for node, ranks in beats:
            fresh.observe(node, ranks, now=now)
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "ranks": 1000,
        "kept_intervals": kept,
        "per_rank_cap": cap,
        "traced_mib": round(traced / 2**20, 1),
        "bytes_per_interval": round(traced / fresh.total),
        "rss_growth_mib": round(rss_growth, 1),
        "beat_8x256_ms_median": round(statistics.median(costs) * 1e3, 2),
        "beat_8x256_ms_max": round(max(costs) * 1e3, 2),
        "answer_intervals": sum(len(r["intervals"]) for r in tl_window_ranks(fresh, now)),
        "answer_build_s": round(window_s, 3),
        "answer_json_s": round(json_s, 3),
    }


def tl_window_ranks(tl: Timeline, now: float) -> list[dict[str, Any]]:
    ranks: list[dict[str, Any]] = tl.window(start=now - 600, end=now, now=now)["ranks"]
    return ranks


def draw_cost() -> dict[str, Any]:
    now = time.time()
    ranks = []
    for r in range(64):
        intervals = []
        for k in range(600):
            t = now - 300 + k * 0.5
            intervals.append(
                {"name": "step", "group": "", "seq": k, "start_unix_ns": int(t * NS),
                 "end_unix_ns": int((t + 0.45) * NS), "device": False, "open": False, "unfinished": False}
            )  # fmt: skip
            for c, op in enumerate(("all_reduce", "all_gather", "reduce_scatter", "broadcast")):
                s = t + 0.05 + c * 0.1
                intervals.append(
                    {"name": op, "group": "dp", "seq": 4 * k + c, "start_unix_ns": int(s * NS),
                     "end_unix_ns": int((s + 0.05) * NS), "device": True, "open": False, "unfinished": False}
                )  # fmt: skip
        ranks.append({"node": f"node-{r // 8}", "rank": r, "local_rank": r % 8, "intervals": intervals})
    timeline = {"start_unix": now - 300, "end_unix": now, "now_unix": now, "ranks": ranks, "failures": []}
    start = time.perf_counter()
    trace = json.dumps(trace_events(timeline))
    trace_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        size = draw_png(timeline, Path(tmp) / "t.png", origin_unix=now, origin_label="seconds before now")
        png_s = time.perf_counter() - start
        png_kib = (Path(tmp) / "t.png").stat().st_size / 1024
    return {
        "ranks": 64,
        "intervals": 64 * 600 * 5,
        "trace_s": round(trace_s, 2),
        "trace_mib": round(len(trace) / 2**20, 1),
        "png_s": round(png_s, 2),
        "png_px": list(size),
        "png_kib": round(png_kib),
    }


def main() -> None:
    result = {
        "benchmark": "timeline",
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 1) for x in os.getloadavg()],
        "master": memory_and_beat_cost(),
        "cli": draw_cost(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
