"""The ``helm`` fixture of the chart tests."""

from __future__ import annotations

import pytest

from tests.gotools import go_built
from tests.shipping.helmchart import Helm


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """helm from scripts/go-tools (skips loudly without Go and a cached build; fails under CI=true)."""
    binary = go_built("helm", unchecked="the chart is not rendered")
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))
