"""The rules of the Chrome trace event format (JSON object form) that Perfetto's JSON importer applies, as a
checker for ``phalanx timeline``'s output: what a viewer would refuse or silently drop fails here."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

PHASES = {"X", "i", "I", "M", "B", "E", "C", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_trace(trace: Any) -> list[str]:
    """Every broken rule, as a sentence (empty when the trace is well formed)."""
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the top level must be an object with a traceEvents list"]
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit must be ms or ns, got {trace['displayTimeUnit']!r}")
    named_pids: set[int] = set()
    named_tids: set[tuple[int, int]] = set()
    slices: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    used: set[tuple[int, int]] = set()
    for i, e in enumerate(trace["traceEvents"]):
        where = f"event {i} ({e.get('name') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"{where}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            problems.append(f"{where}: name must be a string")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                problems.append(f"{where}: {key} must be an integer")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args must be an object")
        if ph == "M":
            if e.get("name") not in METADATA:
                problems.append(f"{where}: unknown metadata event")
            elif e["name"] in ("process_name", "thread_name") and not isinstance(
                e.get("args", {}).get("name"), str
            ):
                problems.append(f"{where}: a name metadata event needs args.name")
            if e.get("name") == "process_name":
                named_pids.add(e["pid"])
            if e.get("name") == "thread_name":
                named_tids.add((e["pid"], e["tid"]))
            continue
        if not _number(e.get("ts")) or e["ts"] < 0:
            problems.append(f"{where}: ts must be a non-negative number of microseconds")
            continue
        if ph == "X":
            if not _number(e.get("dur")) or e["dur"] < 0:
                problems.append(f"{where}: a complete event needs a non-negative dur")
                continue
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
            used.add((e["pid"], e["tid"]))
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: an instant event's scope s must be g, p or t")
    for pid, tid in sorted(used):
        if pid not in named_pids:
            problems.append(f"pid {pid} has slices but no process_name")
        if (pid, tid) not in named_tids:
            problems.append(f"pid {pid} tid {tid} has slices but no thread_name")
    for key, spans in slices.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1] + 1e-3:
                problems.append(f"pid/tid {key}: slice {start}-{end} overlaps its parent's end {stack[-1]}")
            stack.append(end)
    return problems
