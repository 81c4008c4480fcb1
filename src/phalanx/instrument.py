"""Instrumentation by default: what a script run by ``phalanx-run`` reports without importing phalanx.

The worker bootstrap calls :func:`install` before the script runs; ``phalanx-run --no-instrument`` (or
``PHALANX_HANG_INSTRUMENT=0``) turns it off. (The bootstrap tells the agent the worker's pid either way,
through :func:`phalanx.announce`.) It uses torch's own hooks only: nothing of torch is patched, and the one
DDP comm hook a script may register stays the script's.

- **Steps** come from the optimizer: torch's global optimizer-step post hook publishes a step each time the
  first optimizer that stepped steps again (two optimizers of one training step count once), from its
  second step on (the first step is the one after which a script that reports its own steps says so). The
  number is the optimizer's own ``step`` state where it keeps one on the CPU (Adam and its kin: a resumed
  script carries on from its step), else a count from 0. A script that calls :func:`phalanx.report_step`
  itself keeps its own numbering: the automatic steps stop at its first call.
- **Collectives** come from torch's own records. On the CPU, where torch keeps a flight recorder (phalanx-run
  sets its size), the recorder's watcher thread reads it when the rank is late and writes the collective the
  rank waits in (:mod:`phalanx.flight`), and c10d's collective hooks (``ProcessGroup.register_pre_hook`` and
  ``register_post_hook``, torch 2.14 and later) are on for one step each :data:`SAMPLE_GAP_S`, for the time
  spent in collectives; on a GPU, or without a flight recorder, the hooks are on for every step. A
  collective starts when it is issued and ends when its Work completes, as the recorder's watcher thread
  sees it within milliseconds (on a GPU, when it is issued: the device side is the CUDA step markers' and the
  flight recorder's); it is numbered by c10d's own sequence in its group, so every rank numbers it alike.
  The hooks are put on at step boundaries, in the training thread between collectives as c10d asks. Older
  torch in the supported range gets the steps only, and says so on stderr.
- **The interval recorder** (:mod:`phalanx.intervals`) is turned on, its lookout started and the c10d hooks
  put on, from the second step, when the script has set up its devices and, if it reports its own steps,
  has said so (the instrumentation then stands aside entirely), so step boundaries and collectives reach the
  agent's hang detection (a rank that waits in a recorded collective is judged by the 10 s floor, not the
  60 s idle floor) and, on a GPU, the CUDA device markers catch a stuck kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import phalanx
from phalanx import intervals
from phalanx.api import beacon
from phalanx.api import intervals as ring

HOOK_ID = 0x50484C58
"""The id this module's c10d hooks are registered under (a script's own hooks use other ids)."""
OP_NAMES = {
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce_coalesced",
    "ALLGATHER": "all_gather",
    "ALLGATHER_BASE": "all_gather_into_tensor",
    "ALLGATHER_COALESCED": "all_gather_coalesced",
    "ALLGATHER_INTO_TENSOR_COALESCED": "all_gather_into_tensor_coalesced",
    "REDUCE_SCATTER": "reduce_scatter",
    "REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter_tensor_coalesced",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all_single",
}
"""c10d's hook op names as torch.distributed's functions are called (the rest: lower case)."""
SAMPLE_GAP_S = 0.5
"""With the flight-recorder lookout on (:mod:`phalanx.flight`: on the CPU, torch keeping a flight recorder),
c10d's hooks are on for one step once this long has passed since the last such step: what the straggler
scores need of the time spent in collectives, at a cost that does not grow with the steps a second."""


def install(env: Mapping[str, str] = os.environ) -> bool:
    """Instruments this process (see the module docstring); False when it is off or not under phalanx-run."""
    if env.get(ring.INSTRUMENT_ENV_VAR, "1") == "0" or not env.get(beacon.ENV_VAR):
        return False
    if "torch" in sys.modules:
        _hook_torch()
    else:  # workers started cold (no warm spare imported torch): hook torch when the script imports it
        sys.meta_path.insert(0, _AfterImport("torch", _hook_torch))
    return True


def _hook_torch() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_steps.on_step)
    if not collective_hooks():
        import torch

        print(
            f"phalanx: torch {torch.__version__} has no c10d collective hooks (2.14 and later have them): "
            "this script's steps are recorded, its collectives are not, and a rank stuck in one is caught "
            "at the hang idle floor (60 s by default), not at max(10 s, 3 x p99 step)",
            file=sys.stderr,
            flush=True,
        )


def collective_hooks() -> bool:
    """Whether this torch has c10d's collective hooks (``ProcessGroup.register_pre_hook``, torch 2.14 on):
    older ones in the train extra's range get the steps of a script that reports nothing, not its
    collectives."""
    try:
        from torch._C._distributed_c10d import ProcessGroup
    except ImportError:  # a torch built without distributed
        return False
    return hasattr(ProcessGroup, "register_pre_hook")


class _Steps:
    """The optimizer-step post hook and what it keeps between steps."""

    def __init__(self) -> None:
        self.pacer: weakref.ref[Any] | None = None
        """The optimizer whose steps are the training steps: the first that stepped (while it lives)."""
        self.count = -1
        self.seen_steps = 0
        self.groups = _Groups()
        self.recording = False
        """The recorder is on, and the lookout asked for (from the second step)."""

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del args, kwargs
        if phalanx._reports_itself:  # an instrumented script: it records what it wants itself
            return
        pacer = self.pacer() if self.pacer is not None else None
        if pacer is None:
            self.pacer, pacer = weakref.ref(optimizer), optimizer
        if optimizer is not pacer:
            return
        self.seen_steps += 1
        step = optimizer_step(optimizer)
        self.count = step if step is not None else self.count + 1
        # From the second step on: a script that reports its own steps has said so by then (it calls
        # report_step after its first optimizer step), and its own numbering and recorder choices stand.
        # Its first optimizer step is not published either: after a restart that number (0 for SGD) would
        # stand beside the step the script resumed at until its own report, and whoever read the beacon
        # then (the master, a fold-in or recovery count) would take the job to have started over.
        if self.seen_steps >= 2:
            phalanx.auto_step(self.count)
            if not self.recording:
                self._start_recording()
            self.groups.at_step()

    def _start_recording(self) -> None:
        self.recording = True
        rec = intervals.enable()
        if rec is not None and rec.look_out(self.progress):
            self.groups.every_step = False

    def progress(self) -> int:
        """Changes at each optimizer step (the flight recorder's lookout reads it from its thread)."""
        return self.seen_steps


def optimizer_step(optimizer: Any) -> int | None:
    """The step the optimizer just completed, 0-based, from its own ``step`` state when it keeps one on the
    CPU (reading one on a GPU would wait for the device); None otherwise (SGD keeps none)."""
    for state in optimizer.state.values():
        value = state.get("step") if isinstance(state, dict) else None
        if value is None:
            return None
        device = getattr(value, "device", None)
        if device is not None and device.type != "cpu":
            return None
        return int(value) - 1
    return None


class _Groups:
    """c10d's collective hooks on every process group, put on and taken off at step boundaries: for every
    step where nothing else would see a collective the rank waits in (a GPU, or no flight recorder), else for
    one step each :data:`SAMPLE_GAP_S`."""

    def __init__(self) -> None:
        self.hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self.every_step = True
        """Hooks on every step; False once the recorder's flight-recorder lookout is on."""
        self.sampling = False
        """The hooks are on for the step now running (``every_step`` False)."""
        self.next_sample = 0.0
        self.seen = 0
        """How many groups c10d had at the last look: a step with no new group costs one len()."""
        atexit.register(self.unhook_all)

    def at_step(self) -> None:
        """At a step boundary, in the training thread between collectives (as c10d asks of its hooks)."""
        if self.every_step:
            self.hook_new()
        elif self.sampling:
            self.unhook_all()
            self.sampling = False
            self.next_sample = time.monotonic() + SAMPLE_GAP_S
        elif time.monotonic() >= self.next_sample:
            self.sampling = True
            self.seen = 0
            self.hook_new()

    def unhook_all(self) -> None:
        """Takes the hooks off every group still alive, while Python is: a group that outlives the
        interpreter (a script that never destroys it, as the Trainer's) would otherwise free the Python
        callbacks after Python itself is gone, and the process ends with SIGSEGV."""
        for pg in list(self.hooked):
            with contextlib.suppress(RuntimeError):
                pg.unregister_pre_hook(HOOK_ID)
                pg.unregister_post_hook(HOOK_ID)
        self.hooked = weakref.WeakSet()
        self.seen = 0

    def hook_new(self) -> None:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None or not c10d.is_initialized():
            return
        groups = c10d._world.pg_map  # c10d's own table of live groups (no public way to list them)
        if len(groups) == self.seen:
            return
        self.seen = len(groups)
        for pg in list(groups):
            if pg not in self.hooked and hasattr(pg, "register_pre_hook"):
                self._hook(pg)
                self.hooked.add(pg)

    @staticmethod
    def _hook(pg: Any) -> None:
        rec = intervals.recorder()
        if rec is None:
            return
        group = intervals.group_of(pg)
        open_ops: dict[int, intervals.Token] = {}
        names = _op_names()
        metas: dict[Any, int] = {}
        begin_at, now = rec.begin_at, time.time_ns
        # Numbered by c10d's sequence in the group, as the flight recorder numbers it: the same on every
        # member, whichever steps each has sampled. A backend that keeps none: by the hook's own count (op_id,
        # the hooked collectives so far), which agrees across ranks hooked at the same step.
        seq_of: Any = getattr(pg, "_get_sequence_number_for_group", None)
        try:
            seq_of()
        except (RuntimeError, TypeError):
            seq_of = None

        def pre(args: Any) -> None:
            meta = metas.get(args.name)
            if meta is None:
                meta = metas[args.name] = rec.meta(names[args.name], group)
            seq = seq_of() if seq_of is not None else args.op_id
            open_ops[args.op_id] = begin_at(meta, seq + 1, now())

        def post(args: Any) -> None:
            token = open_ops.pop(args.op_id, None)
            if token is None:
                return
            work = args.work
            if work is None or rec.cuda:
                rec.writer.end_now(token)
            else:
                rec.end_when_done(token, work)

        pg.register_pre_hook(HOOK_ID, pre)
        pg.register_post_hook(HOOK_ID, post)


def op_name(hook_name: str) -> str:
    """A c10d hook op name (``ALLREDUCE``) as torch.distributed calls it (``all_reduce``)."""
    return OP_NAMES.get(hook_name, hook_name.lower())


def _op_names() -> dict[Any, str]:
    """c10d's hook op enum -> :func:`op_name`: one dict lookup a collective, not an enum's name and a
    string's lower()."""
    from torch._C._distributed_c10d import HookOpName

    return {member: op_name(name) for name, member in HookOpName.__members__.items()}


class _AfterImport(MetaPathFinder, Loader):
    """Runs ``then`` once module ``name`` has been imported, then steps out of the import system."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then
        self._spec: ModuleSpec | None = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name or self._spec is not None:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this one only wraps what they found
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self._spec = spec
        inner: Any = spec.loader
        spec.loader = self
        self._inner = inner
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._inner  # type: ignore[union-attr]
        self._inner.exec_module(module)
        self.then()


_steps = _Steps()
