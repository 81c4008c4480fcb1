"""Goodput under a failure every minute: one DDP script under phalanx local, torchrun and dlrover-run in the
same run, with one seeded schedule of worker kills, node kills and hangs; effective training time =
productive steps x clean step time / wall time, and per fault detect / re-form / restore / recompute.

One DDP script (``examples/ddp_mlp.py``: gloo, a small MLP, ``--step-time`` of simulated compute per step)
runs for ``--minutes`` of wall time under each launcher in turn, 2 nodes x 1 process on this machine. The
first interval is fault-free: it gives the launcher's clean step time. Then a fault hits every
``--interval`` seconds, from one seeded schedule shared by all launchers, a mix of

- ``worker-kill``: SIGKILL one training process;
- ``node-kill``: SIGKILL a whole node: the process tree of the node's launcher (agent) and its workers;
- ``hang``: SIGSTOP one training process, never SIGCONT.

The benchmark injects the faults itself, the same way for every launcher (the workers write their pid with
``--pid-dir``), and plays the part of each launcher's users:

- ``phalanx``: ``phalanx local --nodes 1:2`` with its flash checkpoint (``--flash``, saved every step in
  shared memory, persisted every 10 steps); phalanx local replaces evicted nodes as the operator does.
- ``torchrun``: two ``torchrun --nnodes 2 --rdzv-backend c10d --max-restarts N`` processes, ``torch.save``
  every step; a node process that exits (killed, or out of restarts) is started again, as a Job would.
- ``dlrover``: two ``dlrover-run --nnodes 2`` processes with dlrover's local master (``python -m
  dlrover.python.master.main --platform local``), installed by this benchmark into a venv of its own under
  ``~/.cache/phalanx/bench-envs/`` that reuses the project's torch; ``torch.save`` every step; node
  processes started again as for torchrun. If it cannot be installed or run, the JSON says why.

All launchers run the same copy of the script in which the one line ``dist.init_process_group("gloo")``
carries ``timeout=`` ``--collective-timeout`` (default 600 s: Megatron-LM's default
``--distributed-timeout-minutes 10`` and torch's NCCL default): a hang under torchrun is noticed only by that
timeout, as its users' jobs notice it.

Per launcher: effective training time = productive steps x clean step time / wall time, where productive
steps are the distinct steps completed in the window (a step redone after a restart counts once), each
weighted by the world size that completed it over the full world (a step at world 1 trained half the
samples); and per fault: detect, re-form, restore, recompute (seconds) and what happened.

    .venv/bin/python -m benchmarks.goodput --minutes 2               # a quick look
    .venv/bin/python -m benchmarks.goodput --out benchmarks/results/goodput.json   # 10 minutes each
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from phalanx.api.ports import free_port
from phalanx.local.procs import descendants, kill_tree

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "ddp_mlp.py"
KINDS = ("worker-kill", "node-kill", "hang")
LAUNCHERS = ("phalanx", "torchrun", "dlrover")
DLROVER_VERSION = "0.6.1"
ENVS = Path.home() / ".cache" / "phalanx" / "bench-envs"
CLEAN_SKIP_S = 5.0
"""The first seconds of the fault-free interval are left out of the clean step time (first steps, warm-up)."""

# What a launcher's output says when it noticed a fault, and when the job's groups formed again.
_PEER_DETECT = (
    r"(?i)ProcessFailure|connection (reset|closed|refused)|read error|fails with|failed|timed out|timeout"
    r"|signal \d+|exitcode|started again"
)
DETECT = {
    "phalanx": re.compile(r"event (failure|node_disconnected|node_lost|hang|eviction_requested)\b"),
    "torchrun": re.compile(_PEER_DETECT),
    "dlrover": re.compile(_PEER_DETECT),
}
NOISE = re.compile(r"NVML|get_gpu_stats|failure_errors|pynvml|FutureWarning")
"""Lines that match DETECT but say nothing about a fault (dlrover's periodic GPU probe, its startup dump)."""
REFORM = {
    "phalanx": re.compile(r"event round_complete\s+world size (\d+)"),
    "torchrun": re.compile(r"world size (\d+), starting at step"),
    "dlrover": re.compile(r"world size (\d+), starting at step"),
}


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the window started (the first completed step)."""
    kind: str
    rank: int
    """The global rank it targets (for a node kill: the node that hosts this rank)."""


def schedule(*, seed: int, count: int, interval_s: float, world: int) -> list[Fault]:
    """A fixed mix: the kinds in turn, shuffled by ``seed``, each at a seeded rank; one every interval."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(count)]
    rng.shuffle(kinds)
    return [Fault((i + 1) * interval_s, k, rng.randrange(world)) for i, k in enumerate(kinds)]


# ------------------------------------------------------------------------------------------------------
# the analysis: pure functions of what was recorded


@dataclass
class Step:
    t: float
    step: int
    world: int


def clean_step_time(steps: list[Step], *, start: float, end: float) -> float | None:
    """Mean seconds per step over the fault-free stretch [start, end): completed steps / time."""
    inside = [s for s in steps if start <= s.t < end]
    if len(inside) < 2:
        return None
    return (inside[-1].t - inside[0].t) / (len(inside) - 1)


def productive(steps: list[Step], *, start: float, end: float, full_world: int) -> tuple[int, float]:
    """Distinct steps completed in [start, end], and the same weighted by world size / full world (the share
    of the samples a full-world step trains). A step completed again after a restart counts once."""
    done: dict[int, int] = {}
    for s in steps:
        if start <= s.t <= end:
            done[s.step] = s.world  # the last completion is the one the job kept
    return len(done), sum(min(w, full_world) / full_world for w in done.values())


def analyse_fault(
    *,
    at: float,
    until: float,
    steps: list[Step],
    lines: list[tuple[float, str]],
    detect: re.Pattern[str],
    reform: re.Pattern[str],
    clean_s: float,
) -> dict[str, Any]:
    """Splits the time one fault cost, from the step log and the launcher's timestamped output.

    detect: fault -> the launcher's first line about it; re-form: -> the job's groups formed again (phalanx:
    the master's round_complete; torchrun/dlrover: the restarted script's first line, printed after
    init_process_group and its checkpoint load, so it includes process start and restore); restore: -> the
    first step completed after that (a step's work included); recompute: -> the job passed the step it had
    reached before the fault (steps done again). ``lost_s`` is the fault -> that step, less one clean step.
    """
    window = [ln for ln in lines if at <= ln[0] < until]
    detected = next((t for t, text in window if detect.search(text) and not NOISE.search(text)), None)
    mark = detected if detected is not None else at
    before = max((s.step for s in steps if s.t < mark), default=-1)
    reformed, world = None, None
    for t, text in window:
        m = reform.search(text)
        if m and t >= mark:
            reformed, world = t, int(m.group(1))
            break
    after = [s for s in steps if s.t > (reformed if reformed is not None else mark) and s.t < until]
    resumed = after[0] if after else None
    caught = next((s for s in after if s.step > before), None)
    out: dict[str, Any] = {
        "step_before": before,
        "detect_s": _r(detected - at if detected is not None else None),
        "reform_s": _r(reformed - mark if reformed is not None else None),
        "world_after": world,
        "restore_s": _r(resumed.t - (reformed if reformed is not None else mark) if resumed else None),
        "recompute_steps": max(0, before + 1 - resumed.step) if resumed else None,
        "recompute_s": _r(caught.t - resumed.t if caught and resumed else None),
        "lost_s": _r(max(0.0, caught.t - at - clean_s) if caught else until - at),
        "recovered": caught is not None,
    }
    # After recovery: further stalls before the next fault (a replacement folded in by another restart) and
    # the time trained at a smaller world (each such step trains fewer samples).
    rest = [s for s in after if caught is not None and s.t >= caught.t]
    gaps = [b.t - a.t for a, b in itertools.pairwise(rest) if b.t - a.t > 3 * clean_s]
    out["later_stalls_s"] = _r(sum(gaps) - len(gaps) * clean_s) if gaps else 0.0
    out["later_stall_count"] = len(gaps)
    full = max((s.world for s in steps), default=0)
    out["reduced_world_s"] = _r(sum(clean_s for s in rest if s.world < full))
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# ------------------------------------------------------------------------------------------------------
# processes


class Output:
    """Reads a launcher's combined output, stamping each line with time.time() and keeping a copy on disk."""

    def __init__(self, path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.file = path.open("a")
        self.lock = threading.Lock()

    def follow(self, stream: IO[bytes], tag: str) -> None:
        def pump() -> None:
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace").rstrip()
                now = time.time()
                with self.lock:
                    self.lines.append((now, f"{tag} {text}"))
                    self.file.write(f"{now:.3f} {tag} {text}\n")
                    self.file.flush()

        threading.Thread(target=pump, daemon=True).start()

    def note(self, text: str) -> None:
        with self.lock:
            now = time.time()
            self.lines.append((now, f"BENCH {text}"))
            self.file.write(f"{now:.3f} BENCH {text}\n")
            self.file.flush()


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def worker_pids(pid_dir: Path, script_name: str) -> dict[int, int]:
    """rank -> pid of the live, running (not stopped, not zombie) training processes."""
    out = {}
    for f in pid_dir.glob("rank*.pid"):
        try:
            pid = int(f.read_text())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if script_name.encode() in cmd and _state(pid) not in ("T", "t", "Z", "X", ""):
            out[int(f.stem[4:])] = pid
    return out


class Job:
    """One launcher's job: its node processes (and master), restarted as its users' Job would."""

    def __init__(self, name: str, d: Path, *, script: Path, script_args: list[str], opts: argparse.Namespace):
        self.name, self.d, self.script, self.opts = name, d, script, opts
        self.script_args = script_args
        self.out = Output(d / "output.log")
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.root: subprocess.Popen[bytes] | None = None  # phalanx local / dlrover master
        self.node_restarts = 0
        self.port = free_port()
        self.stopping = False

    def _spawn(self, argv: list[str], tag: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            cwd=self.d,
        )
        assert proc.stdout is not None
        self.out.follow(proc.stdout, tag)
        return proc

    def start(self) -> None:
        o = self.opts
        if self.name == "phalanx":
            argv = [
                sys.executable, "-m", "phalanx.cli.main", "local", "--nodes", "1:2", "--nproc-per-node", "1",
                "--max-replacements", "100", "--max-restarts", str(o.max_restarts),
                f"--master-arg=--max-evictions={o.max_restarts}", "--workdir", str(self.d / "local"),
                "--timeout", f"{o.minutes * 60 + 600:g}s",
                f"--agent-arg=--checkpoint-dir={self.d / 'ckpt'}",
                *([f"--agent-arg=--hang-idle-floor={o.hang_idle_floor}"] if o.hang_idle_floor else []),
                "--", str(self.script), *self.script_args, "--flash",
            ]  # fmt: skip
            self.root = self._spawn(argv, "local")
            return
        if self.name == "dlrover":
            argv = [
                str(o.dlrover_python), "-u", "-m", "dlrover.python.master.main", "--port", str(self.port),
                "--node_num", "2", "--job_name", f"goodput{self.port}", "--platform", "local",
            ]  # fmt: skip
            self.root = self._spawn(argv, "master")
            time.sleep(3.0)
        for n in range(2):
            self.start_node(n)

    def start_node(self, n: int) -> None:
        o = self.opts
        args = [str(self.script), *self.script_args, "--ckpt", str(self.d / "ckpt.pt")]
        if self.name == "torchrun":
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "goodput",
                "--max-restarts", str(o.max_restarts), *args,
            ]  # fmt: skip
            env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        else:
            argv = [
                str(o.dlrover_bin), "--nnodes", "2", "--nproc_per_node", "1",
                "--max_restarts", str(o.max_restarts), *args,
            ]  # fmt: skip
            env = {
                "DLROVER_MASTER_ADDR": f"127.0.0.1:{self.port}",
                "NODE_RANK": str(n),
                "NODE_ID": str(n),
                "JOB_NAME": f"goodput{self.port}",
            }
        self.nodes[n] = self._spawn(argv, f"node{n}", env)

    def node_roots(self) -> list[int]:
        """The pids that are a node: torchrun/dlrover-run processes, or phalanx local's agents."""
        if self.name == "phalanx":
            assert self.root is not None
            tree = descendants(self.root.pid)
            return [p for p in tree if _ppid(p) == self.root.pid and b"phalanx.cli.run" in _cmdline(p)]
        return [p.pid for p in self.nodes.values() if p.poll() is None]

    def supervise(self) -> None:
        """A Job's restartPolicy: a node process that exited starts again (phalanx local replaces its own)."""
        if self.name == "phalanx" or self.stopping:
            return
        for n, proc in list(self.nodes.items()):
            if proc.poll() is not None:
                self.out.note(f"node {n} exited ({proc.returncode}): started again")
                kill_tree(proc.pid)
                self.node_restarts += 1
                self.start_node(n)

    def stop(self) -> None:
        self.stopping = True
        procs = [p for p in [self.root, *self.nodes.values()] if p is not None]
        # Every process of the job now: a launcher killed by the signal leaves its children to init.
        tree = {q for p in procs for q in descendants(p.pid)}
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20.0
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for p in procs:
            kill_tree(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Stopped (hung) workers of earlier incarnations may have outlived their parents.
        for pid in _stale_workers(self.d):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stale_workers(d: Path) -> list[int]:
    """Training processes of this run still alive (this run's directory is on their command line)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and str(d).encode() in _cmdline(int(entry.name)):
            out.append(int(entry.name))
    return out


def read_steps(path: Path) -> list[Step]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError):
            d = json.loads(line)
            out.append(Step(float(d["time"]), int(d["step"]), int(d["world_size"])))
    return out


def inject(job: Job, fault: Fault, pid_dir: Path) -> dict[str, Any]:
    """Carries out one fault; returns what was done and the surviving workers' pids (to tell later whether
    they kept their processes)."""
    pids = worker_pids(pid_dir, job.script.name)
    rec: dict[str, Any] = {"kind": fault.kind, "rank": fault.rank, "workers_before": pids}
    if not pids:
        if fault.kind == "node-kill" and job.node_roots():
            root = job.node_roots()[0]
            kill_tree(root)
            rec.update(done=f"SIGKILL node process tree {root} (no live worker)", victims=[])
            return rec
        rec["done"] = "nothing: no live worker at that moment (the job was down)"
        return rec
    rank = fault.rank if fault.rank in pids else sorted(pids)[0]
    pid = pids[rank]
    rec["rank"] = rank
    if fault.kind == "worker-kill":
        os.kill(pid, signal.SIGKILL)
        rec.update(done=f"SIGKILL rank {rank} pid {pid}", victims=[pid])
    elif fault.kind == "hang":
        os.kill(pid, signal.SIGSTOP)
        rec.update(done=f"SIGSTOP rank {rank} pid {pid}", victims=[pid])
    else:
        roots = set(job.node_roots())
        node, p = None, pid
        while p > 1:
            if p in roots:
                node = p
                break
            p = _ppid(p)
        if node is None:
            rec.update(done=f"nothing: no node process above rank {rank} pid {pid}", victims=[])
            return rec
        victims = [node, *descendants(node)]
        kill_tree(node)
        rec.update(
            done=f"SIGKILL node tree of rank {rank} (pid {node}, {len(victims)} processes)", victims=victims
        )
    return rec


def what_happened(
    job_name: str,
    rec: dict[str, Any],
    lines: list[tuple[float, str]],
    *,
    at: float,
    until: float,
    recovered: bool,
) -> str:
    """Names the recovery from what the launcher did: the workers the fault spared kept their processes
    (in-process regroup) or not (worker restart), a node was replaced (phalanx local) or its process started
    again (the benchmark, as a Job would), and every node process started again (job restart)."""
    if not recovered:
        return "not recovered before the next fault"
    window = [text for t, text in lines if at <= t < until]
    parts = []
    if any("to replace" in text for text in window):
        parts.append("node replaced")
    restarted_nodes = sum("started again" in text for text in window)
    if restarted_nodes:
        parts.append("node process started again" if restarted_nodes == 1 else "job restart (every node)")
    kept = rec.get("survivors_kept")
    if kept:
        parts.append("in-process regroup (every spared worker kept its process)")
    else:
        parts.append("worker restart" if kept is not None else "workers restarted (none was spared)")
    return "; ".join(parts)


def run_launcher(name: str, opts: argparse.Namespace, faults: list[Fault], base: Path) -> dict[str, Any]:
    d = base / name
    d.mkdir(parents=True)
    pid_dir = d / "pids"
    pid_dir.mkdir()
    step_log = d / "steps.jsonl"
    script_args = [
        "--steps", "100000000", "--step-time", str(opts.step_time), "--step-log", str(step_log),
        "--pid-dir", str(pid_dir),
    ]  # fmt: skip
    job = Job(name, d, script=opts.script, script_args=script_args, opts=opts)
    wall = opts.minutes * 60.0
    started = time.time()
    job.start()
    records: list[dict[str, Any]] = []
    start: float | None = None
    try:
        while time.time() - started < opts.start_timeout:
            steps = read_steps(step_log)
            if steps:
                start = steps[0].t
                break
            job.supervise()
            time.sleep(0.1)
        if start is None:
            return {"error": f"no step completed within {opts.start_timeout:g}s", "output_tail": _tail(job)}
        pending = list(faults)
        while time.time() < start + wall:
            now = time.time()
            if pending and now >= start + pending[0].at_s:
                f = pending.pop(0)
                done = inject(job, f, pid_dir)
                done["at"] = now
                job.out.note(f"INJECT {f.kind}: {done['done']}")
                records.append(done)
            job.supervise()
            # Once the job is past the step it had reached: do the workers the fault spared still run?
            last = records[-1] if records else None
            if last is not None and "survivors_kept" not in last and time.time() - last["at"] > 0.5:
                steps = read_steps(step_log)
                before = max((s.step for s in steps if s.t < last["at"]), default=-1)
                if steps and steps[-1].step > before + 1:
                    spared = [p for p in last["workers_before"].values() if p not in last.get("victims", [])]
                    last["survivors_kept"] = (
                        all(_state(p) not in ("", "Z", "X") for p in spared) if spared else None
                    )
            time.sleep(0.05)
    finally:
        job.stop()
    steps = read_steps(step_log)
    end = start + wall
    clean = clean_step_time(
        steps, start=start + CLEAN_SKIP_S, end=start + (faults[0].at_s if faults else wall)
    )
    n_steps, weighted = productive(steps, start=start, end=end, full_world=2)
    result: dict[str, Any] = {
        "launcher": name,
        "wall_s": wall,
        "clean_step_s": _r(clean),
        "steps_completed": n_steps,
        "steps_completed_weighted": round(weighted, 1),
        "node_process_restarts_by_benchmark": job.node_restarts,
    }
    if clean:
        result["effective_training_time"] = round(weighted * clean / wall, 4)
        result["effective_training_time_unweighted"] = round(n_steps * clean / wall, 4)
    per_fault = []
    for i, rec in enumerate(records):
        until = records[i + 1]["at"] if i + 1 < len(records) else end
        item = {"kind": rec["kind"], "at_s": round(rec["at"] - start, 1), "injected": rec["done"]}
        item.update(
            analyse_fault(
                at=rec["at"], until=until, steps=steps, lines=job.out.lines, detect=DETECT[name],
                reform=REFORM[name], clean_s=clean or 0.0,
            )
        )  # fmt: skip
        item["what_happened"] = what_happened(
            name, rec, job.out.lines, at=rec["at"], until=until, recovered=item["recovered"]
        )
        per_fault.append(item)
    result["failures"] = per_fault
    lost = [f["lost_s"] for f in per_fault if f["lost_s"] is not None]
    result["lost_s_total"] = round(sum(lost), 1)
    result["lost_s_median"] = round(statistics.median(lost), 2) if lost else None
    for kind in KINDS:
        ks = [f["lost_s"] for f in per_fault if f["kind"] == kind and f["lost_s"] is not None]
        if ks:
            result[f"lost_s_median_{kind}"] = round(statistics.median(ks), 2)
    # Where the time went, over every fault: each phase summed (an unrecovered fault counts whole).
    phases = ("detect_s", "reform_s", "restore_s", "recompute_s", "later_stalls_s", "reduced_world_s")
    result["time_by_phase_s"] = {
        key: round(sum(f[key] or 0.0 for f in per_fault if f["recovered"]), 1) for key in phases
    }
    result["time_by_phase_s"]["unrecovered_s"] = round(
        sum(f["lost_s"] for f in per_fault if not f["recovered"]), 1
    )
    print(f"{name}: logs in {d}", file=sys.stderr, flush=True)
    return result


def _tail(job: Job, n: int = 30) -> list[str]:
    return [text for _, text in job.out.lines[-n:]]


# ------------------------------------------------------------------------------------------------------
# dlrover's environment


def dlrover_env() -> tuple[Path | None, str]:
    """A venv with dlrover-run that reuses the project's torch (a .pth file adds this interpreter's
    site-packages after its own); returns (its python, "") or (None, why not)."""
    env = ENVS / f"dlrover-{DLROVER_VERSION}"
    py = env / "bin" / "python"
    try:
        fresh = not (env / "bin" / "dlrover-run").exists()
        if fresh:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(env)], check=True, capture_output=True
            )
        import torch

        # Written on every run, not only when the venv is made: the venv outlives the checkout whose
        # torch it borrowed (CI's clones are deleted), and a stale path would leave it without torch.
        site = Path(torch.__file__).resolve().parent.parent
        pth = next((env / "lib").glob("python3*/site-packages")) / "zz_project_torch.pth"
        pth.write_text(f"{site}\n")
        if fresh:
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", f"dlrover=={DLROVER_VERSION}"],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
        check = subprocess.run(
            [str(py), "-c", "import dlrover, torch; print(torch.__version__)"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        del check
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, StopIteration) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return None, f"{exc}: {str(detail)[-2000:]}"
    return py, ""


def standalone_error(py: Path) -> str:
    """What ``dlrover-run --standalone`` does with this torch (it starts its own master through torch's
    SubprocessHandler, whose signature changed); the benchmark starts the local master itself instead."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [str(py.parent / "dlrover-run"), "--standalone", "--nproc_per_node", "1", "-m", "this"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp,
            check=False,
        )
    errs = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln]
    return errs[-1] if proc.returncode != 0 and errs else ""


def timed_script(base: Path, timeout_s: float) -> Path:
    """The script with the collective timeout its users set (one line differs from examples/ddp_mlp.py)."""
    text = SCRIPT.read_text()
    old = 'dist.init_process_group("gloo")'
    assert old in text, "examples/ddp_mlp.py changed: update the timeout edit"
    new = f'dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds={timeout_s:g}))'
    path = base / "ddp_mlp.py"
    path.write_text(text.replace(old, new))
    return path


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _interrupt(signum: int, frame: object) -> None:
    del signum, frame
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: the launchers' processes are ended too


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="wall time per launcher")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between faults (the first is clean)")
    p.add_argument("--seed", type=int, default=25)
    p.add_argument("--step-time", type=float, default=0.1, help="simulated compute per step (s)")
    p.add_argument("--collective-timeout", type=float, default=600.0)
    p.add_argument(
        "--hang-idle-floor",
        default="10s",
        help="phalanx-run's --hang-idle-floor ('' for its default, 60 s): the script has no interval "
        "recorder, so its hangs are judged by the step beacon against this floor",
    )
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--out", type=Path, default=None)
    opts = p.parse_args()
    count = max(0, int(opts.minutes * 60 / opts.interval) - 1)
    faults = schedule(seed=opts.seed, count=count, interval_s=opts.interval, world=2)
    base = Path(tempfile.mkdtemp(prefix="goodput-"))
    opts.script = timed_script(base, opts.collective_timeout)
    import torch

    report: dict[str, Any] = {
        "benchmark": "goodput",
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "torch": torch.__version__,
        "config": {
            "minutes_per_launcher": opts.minutes,
            "fault_interval_s": opts.interval,
            "seed": opts.seed,
            "step_time_s": opts.step_time,
            "collective_timeout_s": opts.collective_timeout,
            "phalanx_hang_idle_floor": opts.hang_idle_floor or "default (60s)",
            "max_restarts": opts.max_restarts,
            "nodes": "2 x 1 process (phalanx: --nodes 1:2)",
            "checkpoint": "phalanx: flash every step, persisted every 10; the peers: torch.save every step",
        },
        "schedule": [asdict(f) for f in faults],
        "load_average_before": load_average(),
        "launchers": {},
    }
    for name in opts.launchers.split(","):
        if name == "dlrover":
            py, why = dlrover_env()
            if py is None:
                report["launchers"][name] = {
                    "error": f"dlrover {DLROVER_VERSION} could not be installed: {why}"
                }
                continue
            opts.dlrover_python, opts.dlrover_bin = py, py.parent / "dlrover-run"
            report["dlrover"] = {"version": DLROVER_VERSION, "env": str(py.parent.parent)}
            with contextlib.suppress(subprocess.TimeoutExpired):
                report["dlrover"]["standalone_error"] = standalone_error(py)
        print(f"== {name}", file=sys.stderr, flush=True)
        load_before = load_average()
        try:
            result = run_launcher(name, opts, faults, base)
        except Exception as exc:  # one launcher's failure must not lose the others' figures
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["load_average_before"] = load_before
        result["load_average_after"] = load_average()
        report["launchers"][name] = result
        print(
            json.dumps({name: {k: v for k, v in result.items() if k != "failures"}}),
            file=sys.stderr,
            flush=True,
        )
    eff = {n: r.get("effective_training_time") for n, r in report["launchers"].items()}
    ph = eff.get("phalanx")
    peers = [v for n, v in eff.items() if n != "phalanx"]
    report["goal"] = {
        "phalanx_at_least_95pct": ph is not None and ph >= 0.95,
        "phalanx_ahead_of_peers": ph is not None and all(v is None or ph > v for v in peers),
    }
    report["load_average_after"] = load_average()
    if opts.out is not None:
        opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
