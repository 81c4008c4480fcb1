"""The project's images, built on this machine by scripts/images (no registry), for the container nodes."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
NAMES = ("phalanx", "phalanx-train", "phalanx-pause", "phalanx-as-root")


@dataclass(frozen=True)
class Image:
    ref: str
    """The reference Pods name it by (``localhost/<name>:<tag>``)."""
    tarball: Path
    """A docker-archive that ``ctr images import`` takes."""


def built_images() -> dict[str, Image]:
    """Builds what changed (a warm build returns at once) and returns name -> image."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "images")], capture_output=True, text=True, timeout=3000, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"scripts/images failed:\n{result.stderr[-4000:]}")
    images = {}
    for line in result.stdout.splitlines():
        name, _, rest = line.partition("=")
        ref, _, tarball = rest.partition(" ")
        if name and ref and tarball:
            images[name] = Image(ref, Path(tarball))
    if not set(NAMES) <= images.keys():
        raise RuntimeError(f"scripts/images did not report {NAMES}: {result.stdout}")
    return images


def example_images() -> set[str]:
    """The worker images examples/elasticjob.yaml names. The nodes know the built worker image by these names
    too, as a team's nodes do once it pushed the image to its own registry: the example runs as written."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "elasticjob.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    return {c["image"] for c in job["spec"]["template"]["spec"]["containers"]}
