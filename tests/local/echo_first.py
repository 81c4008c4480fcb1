"""A torch-free worker pair for the agent's settle: local rank 0 fails first with gloo's peer-lost error, as
a peer of a dying rank does, and local rank 1 is SIGKILLed (by itself) 0.3 s later: the echo exits before
the failure it echoes. A restarted round exits 0 at once."""

from __future__ import annotations

import os
import signal
import sys
import time

if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
    sys.exit(0)
time.sleep(0.5)
if os.environ["LOCAL_RANK"] == "0":
    raise RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:4242"
    )
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)
