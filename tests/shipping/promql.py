"""Just enough PromQL reading for the dashboard tests: which metrics and labels an expression uses.

Not a parser: it removes what cannot be a metric name (strings, label matchers, range selectors,
grouping clauses, function calls' names, keywords, numbers) and keeps the identifiers left over. The
tests in test_promql.py pin the cases the dashboards use.
"""

from __future__ import annotations

import re

# Keywords and aggregation/binary modifiers: identifiers that are never metric names.
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENT = re.compile(r"(?<![\w$.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_LABEL_IN_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (``rate(foo_total{a="b"}[5m])`` -> ``{"foo_total"}``)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name in _KEYWORDS or name.startswith("__"):
            continue
        names.add(name)
    return names


def label_names(expr: str) -> set[str]:
    """Label names used in matchers and in by/without/on/ignoring/group_* clauses."""
    text = _STRING.sub('""', expr)
    labels = set()
    for block in _MATCHERS.findall(text):
        labels.update(_LABEL_IN_MATCHER.findall(block))
    for _, inner in _GROUPING.findall(text):
        labels.update(part.strip() for part in inner.split(",") if part.strip())
    return labels
