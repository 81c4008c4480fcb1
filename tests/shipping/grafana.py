"""The Grafana dashboards the chart ships (charts/phalanx/dashboards), and the PromQL they run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts" / "phalanx" / "dashboards").glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            # label_values(<selector>, <label>): the selector is PromQL, the label must exist too.
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text)
            assert match, f"{var['name']}: unexpected variable query {text!r}"
            exprs.append(match[1])
    return exprs
