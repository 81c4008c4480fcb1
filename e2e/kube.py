"""kubectl and helm for the e2e scenarios: only what any cluster offers (no access to the nodes' processes),
so the same scenarios run on kind, on a real cluster and on the project's own control plane."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.eventually import eventually

T = TypeVar("T")


@dataclass(frozen=True)
class Kube:
    kubectl_binary: str
    kubeconfig: Path

    def __call__(self, *args: str, input_text: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [self.kubectl_binary, "--kubeconfig", str(self.kubeconfig), *args],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}{result.stdout}")
        return result.stdout if result.returncode == 0 else result.stderr + result.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self("get", *args, "-o", "json"))

    def wait_for(self, what: str, probe: Callable[[], T], *, timeout: float, namespace: str = "") -> T:
        """Polls ``probe`` until it returns something true; on timeout the error shows the namespace."""
        return eventually(
            probe, timeout=timeout, what=what, interval=1.0,
            diagnose=lambda: self("get", "ej,pods,events", "-n", namespace, check=False) if namespace else "",
        )  # fmt: skip


@dataclass(frozen=True)
class Helm:
    """A helm binary with its own empty config/cache/data homes (no user repositories or plugins)."""

    binary: str
    home: Path
    kubeconfig: Path

    def __call__(self, *args: str) -> str:
        env = {
            "PATH": os.environ.get("PATH", ""),
            # client-go caches API discovery under $HOME/.kube: without a HOME, under the working directory.
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(self.kubeconfig),
        }
        result = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=180, check=False, env=env
        )
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {result.stderr}{result.stdout}")
        return result.stdout
