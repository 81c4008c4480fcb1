"""Conditions keep their lastTransitionTime until their status flips."""

from __future__ import annotations

from phalanx.operator.conditions import get_condition, is_true, set_condition


def test_transition_time_changes_only_on_flip() -> None:
    c1 = set_condition([], kind="Running", status=True, reason="R", message="m", now=100.0, generation=1)
    c2 = set_condition(c1, kind="Running", status=True, reason="R2", message="m2", now=200.0, generation=2)
    assert c2[0]["lastTransitionTime"] == c1[0]["lastTransitionTime"] == "1970-01-01T00:01:40Z"
    assert (c2[0]["reason"], c2[0]["observedGeneration"]) == ("R2", 2)
    c3 = set_condition(c2, kind="Running", status=False, reason="X", message="", now=300.0, generation=2)
    assert c3[0]["lastTransitionTime"] == "1970-01-01T00:05:00Z"
    assert not is_true(c3, "Running")


def test_other_conditions_are_kept_in_order() -> None:
    cs = set_condition([], kind="Created", status=True, reason="a", message="", now=1.0, generation=1)
    cs = set_condition(cs, kind="Running", status=True, reason="b", message="", now=2.0, generation=1)
    cs = set_condition(cs, kind="Created", status=True, reason="c", message="", now=3.0, generation=1)
    assert [c["type"] for c in cs] == ["Created", "Running"]
    assert get_condition(cs, "Created") is not None
    assert get_condition(cs, "Failed") is None
