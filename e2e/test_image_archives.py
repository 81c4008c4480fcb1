"""The images' docker-archive tarballs, which the container nodes import (`make e2e` exports them; `make test`
runs the images with buildah and exports none): each names its image as a Pod does."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "images"

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("PHALANX_E2E_KUBECONFIG")),
    reason="the cluster under test (PHALANX_E2E_KUBECONFIG) pulls its images; no tarball is made here",
)


def test_each_image_is_a_docker_archive_named_by_its_ref_and_a_warm_export_returns_at_once() -> None:
    started = time.monotonic()
    result = subprocess.run([str(SCRIPT), "--json"], capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    images = json.loads(result.stdout)
    assert elapsed < 15, f"scripts/images after make e2e's prepare took {elapsed:.1f} s: it exported again"
    for name, image in images.items():
        ref, tar = image["ref"], image["tarball"]
        assert ref.startswith(f"{name}:"), ref
        assert tar is not None, f"{name}: no tarball"
        assert Path(tar).is_file(), tar
        with tarfile.open(tar) as archive:
            member = archive.extractfile("manifest.json")
            assert member is not None
            manifest = json.load(member)
        # ctr import stores the image under these names; a Pod that says `phalanx:<tag>` gets the first.
        assert f"docker.io/library/{ref}" in manifest[0]["RepoTags"]
