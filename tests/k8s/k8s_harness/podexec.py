"""Runs one Pod's container process inside a private mount namespace (started by the test kubelet as
``unshare --mount --propagation private -- python podexec.py SPEC.json``).

The spec (JSON) lists bind mounts (volume directory -> the container's mountPath), the argv, the
environment and the working directory. Bind mounts make the paths in the Pod spec real for this process
only (its token at /var/run/phalanx/token, its service-account token at the standard path), so two Pods
on one machine each see their own files at the same path, as in a real cluster.

Like a container runtime, it also gives the Pod a private ``/dev/shm`` (tmpfs): beacons and flash-checkpoint
segments of a Pod vanish with it, even when its processes were SIGKILLed, and Pods never see each other's.

Then it becomes the container's user (the spec's uid, gid and supplementary groups) and execs the argv. The
"image" is this machine's interpreter and checkout; when one of them lies under a directory that other users
cannot enter (/root, mode 700), that directory is covered with an empty tmpfs in this mount namespace and
only those two are bind-mounted back, so the container's user reaches them and nothing else of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=1777", "tmpfs", "/dev/shm"], check=True)
    for source, target, read_only in spec["mounts"]:
        Path(target).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", source, target], check=True)
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
    _expose(spec["expose"], stage=Path(sys.argv[1]).parent / "exposed")
    user = spec["user"]
    os.setgroups(user["groups"])
    os.setgid(user["gid"])
    os.setuid(user["uid"])
    os.chdir(spec["cwd"])
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost directory above ``path`` that others may not enter (no o+x), or None."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not parent.stat().st_mode & 0o001:
            return parent
    return None


def _expose(paths: list[str], *, stage: Path) -> None:
    """Makes ``paths`` reachable by any user in this mount namespace (see the module's docstring)."""
    covered: dict[Path, list[Path]] = {}
    for text in paths:
        path = Path(text).resolve()
        if (closed := _closed_ancestor(path)) is not None:
            covered.setdefault(closed, []).append(path)
    for closed, inside in covered.items():
        staged = []
        for i, path in enumerate(inside):  # set aside before the tmpfs hides them
            held = stage / str(i)
            held.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--bind", str(path), str(held)], check=True)
            staged.append((held, path))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", str(closed)], check=True)
        for held, path in staged:
            path.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--move", str(held), str(path)], check=True)


if __name__ == "__main__":
    main()
