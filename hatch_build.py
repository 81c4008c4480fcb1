"""Builds ``phalanx._ringwrite``, the interval recorder's write path in C, into the wheel (and into ``src/``
for an editable install), with the C compiler of the Python that builds it. ``python hatch_build.py``
compiles it in place, into ``src/phalanx/``, and builds nothing else: for a checkout run from ``src/`` on
``PYTHONPATH``.

The extension is optional: without a compiler (a slim image's builder, say) the wheel is built pure Python,
and the recorder uses its Python writer, which writes the same ring at about five times the cost on a
sub-millisecond CPU step (docs/benchmarks.md). The build says so on stderr; it never fails for it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside a build: `python hatch_build.py` compiles it in place
    BuildHookInterface = object

SOURCE = Path("src/phalanx/_ringwrite.c")


def compile_extension(root: Path, *, cc: str | None = None) -> Path | None:
    """Compiles the extension next to its source; returns its path, or None (and says why) when it cannot."""
    source = root / SOURCE
    target = source.with_name("_ringwrite" + str(sysconfig.get_config_var("EXT_SUFFIX")))
    compiler = shlex.split(cc or os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc"))
    include = sysconfig.get_paths()["include"]
    cmd = [*compiler, "-O2", "-shared", "-fPIC", "-std=c11", "-Wall", "-Werror", f"-I{include}"]
    cmd += [str(source), "-o", str(target)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        print(
            f"phalanx: not building the C interval writer ({shlex.join(cmd)}: {detail.strip()[:2000]}); "
            "the recorder will use its Python writer",
            file=sys.stderr,
        )
        target.unlink(missing_ok=True)
        return None
    return target


class RingWriterHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        built = compile_extension(Path(self.root))
        if built is None:
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True  # cp311-cp311-linux_x86_64: the extension is for this Python only
        if version != "editable":  # an editable install imports it from src/, where it was built
            build_data["force_include"][str(built)] = f"phalanx/{built.name}"


if __name__ == "__main__":
    sys.exit(0 if compile_extension(Path(__file__).resolve().parent) else 1)
