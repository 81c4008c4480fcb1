"""Runs one Pod's container process inside a private mount namespace (started by the test kubelet as
``unshare --mount --propagation private -- python podexec.py SPEC.json``).

The spec (JSON) lists bind mounts (volume directory -> the container's mountPath), the argv, the
environment and the working directory. Bind mounts make the paths in the Pod spec real for this process
only (its token at /var/run/phalanx/token, its service-account token at the standard path), so two Pods
on one machine each see their own files at the same path, as in a real cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
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
