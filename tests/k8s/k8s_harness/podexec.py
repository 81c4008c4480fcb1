"""Runs one Pod's container process inside a private mount namespace (started by the test kubelet as
``unshare --mount --propagation private -- python podexec.py SPEC.json``).

The spec (JSON) lists bind mounts (volume directory -> the container's mountPath), the argv, the
environment and the working directory. Bind mounts make the paths in the Pod spec real for this process
only (its token at /var/run/phalanx/token, its service-account token at the standard path), so two Pods
on one machine each see their own files at the same path, as in a real cluster.

Like a container runtime, it also gives the Pod a private ``/dev/shm`` (tmpfs): beacons and flash-checkpoint
segments of a Pod vanish with it, even when its processes were SIGKILLed, and Pods never see each other's.
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
    os.chdir(spec["cwd"])
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main()
