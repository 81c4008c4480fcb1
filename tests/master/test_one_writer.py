"""The job's state has one writer: no component of the job but its writer (``job/core.py``) assigns to the
state or calls a mutating method on it. Components decide, and hand what they decided to the writer as
effects (:mod:`phalanx.master.job.effects`); their own fields (``self.x``) are theirs to write.

Read from the source (a pure-logic check: the dynamic one, on real request handlers, is
``test_failure_walk.py``). A value is *of the state* when it is read from ``s``/``state``/``self.state`` or
the writer (``self.core``), or from a local that was.
"""

from __future__ import annotations

import ast
from pathlib import Path

import phalanx.master.job

JOB = Path(phalanx.master.job.__file__).parent
WRITER = {"core.py"}
STATE_NAMES = {"s", "state"}
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "add", "discard", "update",
    "setdefault", "sort", "reverse",
    # the state's own records: the recovery tracker, the timeline, the event log, the checkpoint tracker,
    # a breakpoint
    "start", "reformed", "stepped", "observe", "note_event", "record", "report", "settle", "commit",
    "persisted", "failed",
}  # fmt: skip
"""Methods that change what they are called on."""


def _of_state(node: ast.expr, tainted: set[str]) -> bool:
    """Whether ``node`` is (a part of) the job's state: reached from ``s``/``state``, ``self.state``, the
    writer ``self.core``, or a local that holds such a part, through attributes, items and calls."""
    while True:
        if isinstance(node, ast.Attribute):
            if (
                node.attr in ("state", "core")
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return True
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return isinstance(node, ast.Name) and (node.id in STATE_NAMES or node.id in tainted)


def _is_own(target: ast.expr) -> bool:
    """``self.x`` or below it, where ``x`` is the component's own field (not its state or its writer)."""
    chain = target
    while isinstance(chain, (ast.Attribute, ast.Subscript)) and not (
        isinstance(chain, ast.Attribute) and isinstance(chain.value, ast.Name)
    ):
        chain = chain.value
    return (
        isinstance(chain, ast.Attribute)
        and isinstance(chain.value, ast.Name)
        and chain.value.id == "self"
        and chain.attr not in ("state", "core")
    )


def writes(source: str) -> list[str]:
    """Every line of ``source`` that writes the job's state outside the writer."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted: set[str] = set()
        for node in ast.walk(fn):  # the locals that hold a part of the state
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _of_state(node.value, tainted):  # a local bound to a part of the state
                    tainted |= {
                        n.id
                        for t in targets
                        for n in (t.elts if isinstance(t, ast.Tuple) else [t])
                        if isinstance(n, ast.Name)
                    }
            elif isinstance(node, (ast.For, ast.comprehension)) and _of_state(node.iter, tainted):
                tainted |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        # self.x = ...: the component binds a field of its own (or its state and writer)
                        binds = isinstance(el, ast.Attribute) and ast.unparse(el.value) == "self"
                        if (
                            isinstance(el, (ast.Attribute, ast.Subscript))
                            and not binds
                            and _of_state(el, tainted)
                        ):
                            found.append(f"{node.lineno}: {ast.unparse(el)} assigned")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
                and _of_state(node.func.value, tainted)
            ):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_only_the_writer_writes_the_job_state() -> None:
    found = {
        path.name: lines
        for path in sorted(JOB.glob("*.py"))
        if path.name not in WRITER and (lines := writes(path.read_text()))
    }
    assert found == {}


def test_the_check_sees_each_kind_of_write() -> None:
    source = """
class C:
    def f(self, req):
        s = self.state
        s.phase = 1
        self.state.round_open = False
        self.state = None
        node = s.nodes[req.node_id]
        node.last_seen = 2
        s.joiners.pop("a")
        bp = s.breakpoint
        bp.report("a")
        s.stats.failures["x"] += 1
        self.cache = {}
        self.cache["k"] = 1
        effects = []
        effects.append(1)
        local = [1]
        local[0] = 2
"""
    assert [w.split(": ", 1)[1] for w in writes(source)] == [
        "s.phase assigned",
        "self.state.round_open assigned",
        "node.last_seen assigned",
        "s.joiners.pop()",
        "bp.report()",
        "s.stats.failures['x'] assigned",
    ]
