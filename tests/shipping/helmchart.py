"""helm, built by scripts/go-tools, run on the chart with homes of its own (tests/shipping/conftest.py
gives it to the chart tests as the ``helm`` fixture)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phalanx"
NAMESPACE = "phalanx-system"


class Helm:
    """A helm binary with its own empty config/cache/data homes (no user repositories or plugins)."""

    def __init__(self, binary: str, home: Path) -> None:
        self.binary = binary
        self.env = {
            "PATH": os.environ.get("PATH", ""),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=60, check=False, env=self.env
        )
        if check:
            assert result.returncode == 0, result.stderr + result.stdout
        return result

    def render(self, *sets: str) -> list[dict[str, Any]]:
        args = ["template", "rel", str(CHART), "--namespace", NAMESPACE, "--include-crds"]
        for s in sets:
            args += ["--set", s]
        return load_all(self(*args).stdout)


def load_all(text: str) -> list[dict[str, Any]]:
    """The documents of a rendered chart, parsed by libyaml: a render carries the CRD and the dashboards
    (about 1 MB), which pure-Python YAML parsed in 0.64 s against libyaml's 0.05 s, 40 renders a run."""
    return [d for d in yaml.load_all(text, Loader=_LOADER) if d]


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # a PyYAML built without libyaml still works


def one(objs: list[dict[str, Any]], kind: str, name: str = "") -> dict[str, Any]:
    """The one object of ``kind`` (named ``name``, when given) among ``objs``."""
    found = [o for o in objs if o["kind"] == kind and (not name or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} objects of kind {kind} {name}"
    return found[0]
