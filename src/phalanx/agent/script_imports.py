"""What a worker's script imported, recorded so that the next incarnation's warm spares import it beforehand.

A warm spare imports :data:`phalanx.agent.workers.WARM_IMPORTS` (torch, torch._dynamo) before its round; a
script that imports more (a tokenizer, a model zoo, a logging library) would pay for that on every restart's
path. So the worker, from its own process, records the modules it has that its spare did not have (the
spare's own set), once its script reported its first step and twice more later, into a file of the agent's
run dir: one dotted module name a line and nothing else (no code, no pickle; names are validated on both
sides and bounded in count and length). A spare started after that, once it is ready, imports those names
on a thread of its own at idle priority (``SCHED_IDLE``), each import guarded: a failure is logged once and
never ends the spare. A spare handed a worker mid-import stops after the module in flight, which finishes
on the worker's path as the script would have imported it anyway.

The script's own modules (those under its directory, or the ``--module`` target) are never recorded: code
written next to the script may read the round's environment (RANK, MASTER_ADDR) at import, which a spare
does not have yet. Installed libraries are imported by a spare with the node's static environment, as
``WARM_IMPORTS`` already are.

The pure parts (:func:`select`, :func:`parse`) decide what is recorded and what is replayed; the threads
(:class:`Recorder` in the worker, :class:`Replayer` in the spare) do the I/O and the imports.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import threading
import time
import types
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

# At the top, so that every spare has it: the recorder never imports on a thread beside the script.
from phalanx.api.beacon import BeaconReader

ENV_VAR = "PHALANX_BOOTSTRAP_IMPORTS_FILE"
"""The list's path, given to every spare by the agent; the bootstrap takes it out of the script's sight."""

MAX_NAMES = 512
MAX_NAME_CHARS = 200
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_NOT_RECORDED = frozenset({"__main__", "__mp_main__"})

FIRST_RECORD_LIMIT_S = 30.0
"""A script that never reports a step (phalanx.report_step) is recorded this long after it started."""
LATER_RECORDS_S = (60.0, 600.0)
"""After the first record, again after these pauses: imports made at the first persist or evaluation."""
BEACON_POLL_S = 0.5
REPLAY_POLL_S = 2.0
"""How often a waiting spare looks for a list that is new or grew."""
HANDOVER_WAIT_S = 30.0
"""How long a spare handed its round waits for the import in flight before it runs the script anyway."""


def valid(name: str) -> bool:
    """A dotted name of ASCII identifiers, bounded in length: what ``import`` accepts, and nothing else."""
    return len(name) <= MAX_NAME_CHARS and _NAME.fullmatch(name) is not None


def _found_in(origin: str, directory: str, name: str) -> bool:
    """Whether module ``name`` was found through ``directory`` as a path entry: its top-level package or
    module file sits right in it. A virtual environment or a ``src/`` below the script's directory is
    another path entry, and its libraries are not the script's own."""
    rel = os.path.relpath(os.path.abspath(origin), directory)
    if rel == os.curdir or rel.startswith(os.pardir):
        return False
    return rel.split(os.sep, 1)[0].split(".", 1)[0] == name.split(".", 1)[0]


def select(
    modules: Mapping[str, object],
    *,
    baseline: Collection[str],
    own_dirs: Sequence[str] = (),
    own_names: Collection[str] = (),
    limit: int = MAX_NAMES,
) -> list[str]:
    """The names worth a spare's import, in the order they were first imported (``sys.modules`` keeps it).

    Left out: what the spare already had (``baseline``), invalid names, entries that are no module or a
    module under another name (an alias), modules made at run time (no spec: no finder can import them
    again), the script's own code (found through a directory of ``own_dirs``, or a name in ``own_names`` or
    below it), and
    a package when one of its submodules is listed (importing ``a.b`` imports ``a``). At most ``limit``."""
    picked: list[str] = []
    for name, module in list(modules.items()):
        if name in baseline or name in _NOT_RECORDED or not valid(name):
            continue
        if not isinstance(module, types.ModuleType):
            continue
        attrs = vars(module)  # never getattr: a module's __getattr__ (PEP 562) may run code
        if attrs.get("__name__") != name or attrs.get("__spec__") is None:
            continue
        if any(name == own or name.startswith(own + ".") for own in own_names):
            continue
        origin = attrs.get("__file__")
        if isinstance(origin, str) and any(_found_in(origin, d, name) for d in own_dirs if d):
            continue
        picked.append(name)
    parents = {ancestor for name in picked for ancestor in _ancestors(name)}
    return [name for name in picked if name not in parents][:limit]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def parse(text: str, *, limit: int = MAX_NAMES) -> list[str]:
    """The valid names of a list, once each, in order, at most ``limit``; anything else is dropped."""
    names: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        name = line.strip()
        if name not in seen and valid(name):
            seen.add(name)
            names.append(name)
            if len(names) >= limit:
                break
    return names


def write(path: Path, names: Sequence[str]) -> None:
    """Replaces the list at once (a spare never reads half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{n}\n" for n in names))
    os.replace(tmp, path)


def read(path: Path) -> list[str] | None:
    """The list, or None when there is none (no previous incarnation recorded one)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_NAMES * (MAX_NAME_CHARS + 1))
    except OSError:
        return None
    return parse(raw.decode("ascii", errors="replace"))


def lower_this_thread() -> None:
    """Idle priority for the calling thread alone (Linux schedules threads, so the spare's main thread, which
    receives the round, keeps its priority): ``SCHED_IDLE``, else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _raise_thread(tid: int) -> None:
    """Back to normal priority, where the kernel allows it (it takes CAP_SYS_NICE, so mostly as root)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 0)


class Replayer:
    """The spare's side: a thread at idle priority that imports the recorded names, then watches the list
    for names recorded later, until the spare gets its round."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.imported: list[str] = []
        self.failed: dict[str, str] = {}
        self._stop = threading.Event()
        self._tid = 0
        self._thread = threading.Thread(target=self._run, name="phalanx-replay-imports", daemon=True)

    def start(self) -> Replayer:
        self._thread.start()
        return self

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        lower_this_thread()
        seen_mtime = -1
        done: set[str] = set()
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                mtime = self.path.stat().st_mtime_ns
                if mtime != seen_mtime:
                    seen_mtime = mtime
                    self._import([n for n in read(self.path) or [] if n not in done], done)
            self._stop.wait(REPLAY_POLL_S)

    def _import(self, names: list[str], done: set[str]) -> None:
        failed: dict[str, str] = {}
        for name in names:
            if self._stop.is_set():
                return  # the round came: the script imports the rest itself
            done.add(name)
            try:
                importlib.import_module(name)
            except (Exception, SystemExit) as exc:  # a recorded name must never end the spare
                failed[name] = type(exc).__name__
            else:
                self.imported.append(name)
        if failed:
            self.failed.update(failed)
            shown = ", ".join(f"{n} ({e})" for n, e in list(failed.items())[:3])
            more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
            print(
                f"phalanx warm spare: could not import {len(failed)} module(s) its previous incarnation "
                f"had: {shown}{more}",
                file=sys.stderr,
                flush=True,
            )

    def stop(self, wait_s: float = HANDOVER_WAIT_S) -> None:
        """Called with the round: no further import starts; the one in flight finishes (at normal priority
        where the kernel lets this process raise it), so the script never imports beside it."""
        self._stop.set()
        if self._tid:
            _raise_thread(self._tid)
        self._thread.join(wait_s)


class Recorder:
    """The worker's side: a thread that sleeps until the script reported its first step (or
    :data:`FIRST_RECORD_LIMIT_S` passed), records, and records again after :data:`LATER_RECORDS_S`. Each
    record takes a millisecond or so of one thread; a list that did not change is not written again."""

    def __init__(
        self,
        path: Path,
        *,
        baseline: Collection[str],
        own_dirs: Sequence[str],
        own_names: Collection[str] = (),
        beacon_path: str = "",
    ) -> None:
        self.path = path
        self._baseline = baseline
        self._own_dirs = own_dirs
        self._own_names = own_names
        self._beacon_path = beacon_path
        self._last: list[str] | None = None
        self._thread = threading.Thread(target=self._run, name="phalanx-record-imports", daemon=True)

    def start(self) -> Recorder:
        self._thread.start()
        return self

    def record(self) -> None:
        names = select(
            sys.modules, baseline=self._baseline, own_dirs=self._own_dirs, own_names=self._own_names
        )
        if names != self._last:
            with contextlib.suppress(OSError):
                write(self.path, names)
                self._last = names

    def _run(self) -> None:
        self._wait_for_first_step()
        self.record()
        for pause in LATER_RECORDS_S:
            time.sleep(pause)
            self.record()

    def _wait_for_first_step(self) -> None:
        deadline = time.monotonic() + FIRST_RECORD_LIMIT_S
        reader = None
        if self._beacon_path:
            with contextlib.suppress(OSError, ValueError):
                reader = BeaconReader(Path(self._beacon_path))
        while time.monotonic() < deadline:
            if reader is not None:
                with contextlib.suppress(RuntimeError):
                    if reader.read().step >= 0:
                        break
            time.sleep(BEACON_POLL_S)
        if reader is not None:
            with contextlib.suppress(BufferError, OSError):
                reader.close()
