"""The order `make test` hands its lanes' units out in (tests/conftest.py): every long unit it names exists,
so that a renamed module does not silently fall back to the end of the run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_UNITS_S

ROOT = Path(__file__).resolve().parents[2]


def test_every_long_unit_is_a_test_module_of_the_suite() -> None:
    missing = [unit for unit in LONG_UNITS_S if not (ROOT / unit).is_file()]
    assert not missing, f"tests/conftest.py's LONG_UNITS_S names modules that do not exist: {missing}"
    assert list(LONG_UNITS_S.values()) == sorted(LONG_UNITS_S.values(), reverse=True)
