"""Modules stay small: no source module over 500 lines (generated code aside), and no import cycle
among the master's modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import phalanx
import phalanx.master

SOURCE = Path(phalanx.__file__).parent
GENERATED = SOURCE / "api" / "v1"  # protobuf and gRPC stubs
MASTER = Path(phalanx.master.__file__).parent
MAX_LINES = 500


def _module(path: Path) -> str:
    """``path``'s module name within the master (``job.core``; a package's ``__init__``: ``job``)."""
    parts = path.relative_to(MASTER).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p) for p in MASTER.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The master's modules ``path`` imports (``from phalanx.master.job import core`` is ``job.core``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phalanx.master"):
            base = str(node.module).removeprefix("phalanx.master").removeprefix(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("phalanx.master.")
                for a in node.names
                if a.name.startswith("phalanx.master.")
            }
    return found - {""}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports), or [] for none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_no_source_module_is_over_500_lines() -> None:
    sizes = {
        str(p.relative_to(SOURCE)): len(p.read_text().splitlines())
        for p in SOURCE.rglob("*.py")
        if GENERATED not in p.parents
    }
    assert len(sizes) > 100  # the whole package was found
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_master_modules_import_each_other_without_a_cycle() -> None:
    graph = {_module(p): _imports(p) for p in MASTER.rglob("*.py")}
    assert graph["job.job"] >= {"state.jobstate", "job.core", "job.rounds", "job.probes", "state.snapshot"}
    assert graph["job"] == {"job.job"}  # the walk sees the imports, of modules and of packages
    assert _cycle(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"core": {"snapshot"}, "snapshot": {"core"}, "job": {"core"}}) == [
        "core",
        "snapshot",
        "core",
    ]


def test_the_schema_names_every_event_kind_the_master_records() -> None:
    """The event kinds are the master's (`EventKind`); the view of an event, which the readers and the OpenAPI
    schema go by, lists them in its description: a kind added without it fails here."""
    from phalanx.api.views import EventView
    from phalanx.master.state.events import KINDS

    description = EventView.model_fields["kind"].description or ""
    named = set(re.findall(r"[a-z_]+", description))
    assert set(KINDS) <= named, sorted(set(KINDS) - named)
