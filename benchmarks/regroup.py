"""Time from losing a node to the next completed training step: in-process regroup vs restarts.

Three "nodes" of one training process each train the example GPT data parallel (DP=3). At the same step
one node is SIGKILLed, and the time from the kill to the survivors' next completed step is measured for:

  (a) inprocess  phalanx.trainer regroups in the same processes (round file rewritten, as the agent does);
  (b) restart    the survivors' workers are restarted and load the newest checkpoint: the flash checkpoint
                 (phalanx.trainer.flash, saved every step; the node that held the saver reads its shared
                 memory, the other reads the persisted copy from storage under /dev/shm);
  (c) torchrun   three torchrun agents (c10d rendezvous, --nnodes 2:3, last_call_timeout 1 s); killing one
                 node's agent and worker makes the others restart their workers, which load a
                 torch.save checkpoint. Restarted workers sometimes deadlock while connecting their gloo
                 group; such attempts are reported as failed runs and the mode is retried.

``superseded``: after the kill the survivors get a round with a replacement that never comes, and one second
later a round without it; reported is the time from that last round to their next step (an abandoned
formation used to sit out the 30 s collective timeout).

``local`` runs the same kill through the real stack (``phalanx local``: master, agents in regroup mode,
2 s heartbeat timeout, no replacement) and reports the time from the kill to the first completed step
after recovery from its summary. ``local-default`` does the same with the default heartbeat settings (1 s
interval, 10 s timeout). The master learns of the kill from the closed connection of the agent's held
heartbeat and leaves the node out after one interval; the heartbeat timeout only decides its eviction.

``overhead`` runs the example on 2 processes without faults under ``torchrun --standalone`` and
``phalanx-run --standalone``, one launcher at a time, and reports steps/s of both in steady state (the last
60% of the steps) and over the whole run, and the CPU-seconds every process of the run spends per step
(steps/s moves by +-10% between runs on a shared host; CPU time counts work, not waiting).
``overhead-pinned`` runs both launchers at the same time with one process each, each pinned to its own
core (swapped every run), so the machine's noise hits both alike.

Without the master in the loop, (a) and (b) get the new membership the moment the node dies (the harness
in tests/trainer/_harness.py plays the agents); in a real job the master's heartbeat timeout comes on top,
and equally so for every mode. Medians over --runs as JSON on stdout (and --out)::

    .venv/bin/python benchmarks/regroup.py --runs 5 --out regroup.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.trainer._harness import Cluster  # noqa: E402
from tests.trainer._procs import free_port, worker_env  # noqa: E402

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "32", "--seq-len", "16", "--seed", "1"]
KILL_AT = 30
# torchrun's defaults wait 30 s for late nodes and 5 s x 3 keep-alives for a dead one; tuned down so the
# baseline is measured at its best, not at its defaults.
RDZV_CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"


SURVIVORS = 2  # the world size after one of the three nodes is killed


def _first_step_after(records: list[dict[str, object]], *, after: float) -> float:
    """The first step completed by the survivors' new world after ``after``. A step of the old world that
    was already past its collectives when the kill landed may still complete after it; it is not a
    recovery."""
    for r in records:
        if r["event"] == "step" and r["world"] == SURVIVORS and float(r["time"]) > after:  # type: ignore[arg-type]
            return float(r["time"])  # type: ignore[arg-type]
    raise RuntimeError("no step after the kill")


def _seconds_to_next_step(c: Cluster, *, after: float) -> float:
    """Waits for the survivors' first step in their new world after ``after``; returns how long after."""

    def recovered() -> bool:
        steps = (r for r in c.records("a") if r["event"] == "step")
        return any(r["world"] == SURVIVORS and float(r["time"]) > after for r in steps)  # type: ignore[arg-type]

    _wait(recovered, 120, "recovery")
    return _first_step_after(c.records("a"), after=after) - after


def _wait(pred, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(0.01)


def run_phalanx(folder: Path, *, restart: bool) -> float:
    ckpt = Path(tempfile.mkdtemp(prefix="phalanx-bench-", dir="/dev/shm"))
    args = [*MODEL, "--steps", "100000", "--global-batch", "12", "--ckpt-dir", str(ckpt), "--ckpt-every", "1"]
    if not restart:
        args = [*MODEL, "--steps", "100000", "--global-batch", "12"]
    c = Cluster(folder, args=args)
    try:
        for n in "abc":
            c.add(n)
        c.write_round(["a", "b", "c"])
        for n in "abc":
            c.start(n)
        _wait(lambda: min(c.last_step(n) for n in "abc") >= KILL_AT, 120, "steps before the kill")
        killed = c.kill("c")
        if restart:
            for n in "ab":  # the agents stop their workers and start them again
                for p in c.nodes[n].procs:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
        c.write_round(["a", "b"])
        if restart:
            for n in "ab":
                c.start(n)
        return _seconds_to_next_step(c, after=killed)
    finally:
        c.close()  # also stops the nodes' checkpoint hosts, so nothing writes under ckpt any more
        shutil.rmtree(ckpt)


def run_superseded(folder: Path) -> float:
    """After the kill the survivors get a round with a replacement that never comes (it died while starting,
    or went on to another round), and one second later a round without it: seconds from that last round to
    the survivors' next step. Until they give up on the first round the survivors cannot take it."""
    c = Cluster(folder, args=[*MODEL, "--steps", "100000", "--global-batch", "12"])
    try:
        for n in ("a", "b", "c", "ghost"):
            c.add(n)
        c.write_round(["a", "b", "c"])
        for n in "abc":
            c.start(n)
        _wait(lambda: min(c.last_step(n) for n in "abc") >= KILL_AT, 120, "steps before the kill")
        c.kill("c")
        c.write_round(["a", "b", "ghost"])
        time.sleep(1.0)
        c.write_round(["a", "b"])
        written = time.time()
        return _seconds_to_next_step(c, after=written)
    finally:
        c.close()


def run_local(folder: Path, *, heartbeat_timeout: str = "2s") -> float:
    """Kill-to-next-step of a node loss under ``phalanx local`` (master and agents in the loop)."""
    folder.mkdir(parents=True)
    summary = folder / "summary.json"
    cmd = [
        sys.executable, "-m", "phalanx.cli.main", "local", "--nodes", "2:3", "--nproc-per-node", "1",
        "--heartbeat-timeout", heartbeat_timeout, "--max-replacements", "0",
        "--inject", f"kill-node@step={KILL_AT},node=2",
        "--summary-json", str(summary), "--workdir", str(folder / "work"), "--timeout", "170s",
        "--", str(ROOT / "examples" / "gpt" / "train.py"), *MODEL, "--steps", str(KILL_AT + 200),
        "--global-batch", "12",
    ]  # fmt: skip
    with (folder / "out.txt").open("wb") as out:
        subprocess.run(cmd, env=worker_env(), stdout=out, stderr=out, check=True, timeout=180)
    [failure] = json.loads(summary.read_text())["failures"]
    if failure["steps_lost"] != 0:
        raise RuntimeError(f"{failure['steps_lost']} steps lost")
    return float(failure["recovered_at"]) - float(failure["injected_at"])


def torchrun_worker(log_dir: Path, ckpt: Path) -> int:
    """One torchrun worker: plain data parallel on the same model, torch.save checkpoint every step."""
    import torch
    import torch.distributed as dist
    from examples.gpt.train import make_batches

    from phalanx.trainer.engine import Engine, OptimConfig
    from phalanx.trainer.mesh import Mesh, ParallelConfig
    from phalanx.trainer.model import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = Engine(
        model=GPTConfig(layers=2, hidden=64, heads=4, vocab=32, seq_len=16),
        mesh=Mesh(ParallelConfig(), rank=rank, world_size=world),
        seed=1,
        optim=OptimConfig(),
    )
    step = 0
    if ckpt.exists():
        saved = torch.load(
            ckpt, weights_only=True
        )  # the baseline's format; weights_only keeps it pickle-safe
        step = int(saved["step"])
        with torch.no_grad():
            for name, t in engine.state_tensors():
                t.copy_(saved[name])
    batches = make_batches(seed=1, batch=12, seq_len=16, vocab=32)
    log = (log_dir / f"{os.getpid()}.jsonl").open("a", buffering=1)
    while True:
        loss = engine.train_step(batches(step))
        step += 1
        log.write(
            json.dumps({"event": "step", "step": step, "loss": loss, "world": world, "time": time.time()})
            + "\n"
        )
        if rank == 0:
            state = {name: t.clone() for name, t in engine.state_tensors()}
            state["step"] = torch.tensor(step)
            torch.save(state, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)


def _descendants(pid: int) -> list[int]:
    """Child processes (recursively), from /proc: torchrun starts its workers in their own sessions."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_torchrun(folder: Path) -> float:
    log_dir = folder / "logs"
    log_dir.mkdir(parents=True)
    ckpt = Path(tempfile.mkdtemp(prefix="torchrun-bench-", dir="/dev/shm")) / "ckpt.pt"
    port = free_port()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = []
    for node in range(3):
        cmd = [
            torchrun, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--max-restarts", "3",
            "--rdzv-conf", RDZV_CONF,
            "--monitor-interval", "0.1",
            __file__, "--torchrun-worker", str(log_dir), str(ckpt),
        ]  # fmt: skip
        err = (folder / f"agent-{node}.txt").open("wb")
        agents.append(subprocess.Popen(cmd, env=worker_env(), stdout=err, stderr=err))
        time.sleep(0.5 if node == 0 else 0)  # the first agent hosts the rendezvous store

    def records() -> list[dict[str, object]]:
        out = []
        for f in log_dir.glob("*.jsonl"):
            for line in f.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line being written
                    out.append(json.loads(line))
        return sorted(out, key=lambda r: float(r["time"]))  # type: ignore[arg-type]

    try:
        _wait(lambda: sum(1 for r in records() if int(r["step"]) >= KILL_AT) >= 3, 180, "torchrun steps")  # type: ignore[call-overload]
        killed = time.time()
        _kill_tree(agents[2].pid)
        _wait(
            lambda: any(r["time"] > killed and r["world"] == SURVIVORS for r in records()),  # type: ignore[operator]
            TORCHRUN_RECOVERY_BOUND_S,
            "torchrun recovery",
        )
        return _first_step_after(records(), after=killed) - killed
    finally:
        for a in agents:
            _kill_tree(a.pid)
            a.wait()
        for f in ckpt.parent.glob("*"):
            f.unlink()
        ckpt.parent.rmdir()


# torchrun's restarted workers sometimes deadlock in gloo's connectFullMesh (both ranks listen, neither
# connects; gloo's default timeout is 30 min). Such a run is counted as hung, not waited out: the mode is
# retried until it has --runs recoveries, at most MAX_ATTEMPTS_FACTOR x --runs attempts.
TORCHRUN_RECOVERY_BOUND_S = 60.0
MAX_ATTEMPTS_FACTOR = 3

LAUNCHERS = ("torchrun", "phalanx-run")
STEADY_FROM = 0.4  # steady state: the last 60% of the steps, after the launchers' start-up work


def _start_example(
    folder: Path, *, launcher: str, steps: int, nproc: int, cpus: str = ""
) -> subprocess.Popen[bytes]:
    """The example GPT without faults under ``launcher --standalone``, optionally pinned to ``cpus``."""
    folder.mkdir(parents=True)
    exe = Path(sys.executable).with_name(launcher)
    example = str(ROOT / "examples" / "gpt" / "train.py")
    cmd = [str(exe), "--standalone", "--nproc-per-node", str(nproc), example,
           *MODEL, "--steps", str(steps), "--log-json", str(folder / "steps.jsonl")]  # fmt: skip
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]  # the launcher, its workers, spares and master all share them
    with (folder / "out.txt").open("wb") as out:
        return subprocess.Popen(cmd, env=worker_env(), stdout=out, stderr=out)


def _rates(folder: Path, *, steps: int) -> tuple[float, float]:
    """Rank 0's steps/s in steady state and over the whole run (first to last step). The difference is
    start-up work: phalanx-run's warm spares import torch (a few CPU seconds) once the workers run."""
    times = {
        int(r["step"]): float(r["time"])
        for r in map(json.loads, (folder / "steps.jsonl").read_text().splitlines())
        if r["event"] == "step" and r["rank"] == 0
    }

    def rate(first: int) -> float:
        return (steps - first) / (times[steps] - times[first])

    return rate(int(steps * STEADY_FROM)), rate(1)


def _finish(proc: subprocess.Popen[bytes]) -> None:
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")  # type: ignore[arg-type]


def _summary(
    steady: dict[str, list[float]], whole: dict[str, list[float]], **extra: object
) -> dict[str, object]:
    plain, ours = statistics.median(steady["torchrun"]), statistics.median(steady["phalanx-run"])
    ratios = [o / p for p, o in zip(steady["torchrun"], steady["phalanx-run"], strict=True)]
    plain_whole, ours_whole = statistics.median(whole["torchrun"]), statistics.median(whole["phalanx-run"])
    return {
        **extra,
        "torchrun_steps_per_s": plain,
        "phalanx_run_steps_per_s": ours,
        "overhead": 1 - ours / plain,
        "overhead_median_of_pairs": 1 - statistics.median(ratios),
        "samples": steady,
        "whole_run": {
            "torchrun_steps_per_s": plain_whole,
            "phalanx_run_steps_per_s": ours_whole,
            "overhead": 1 - ours_whole / plain_whole,
            "samples": whole,
        },
    }


def _cpu_ticks(pids: list[int]) -> dict[int, int]:
    """User + system CPU ticks of each process still alive."""
    ticks = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks


def _launcher_processes(launcher_pid: int) -> list[int]:
    """The launcher's process tree plus the detached checkpoint host of a phalanx-run job."""
    hosts = [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and b"phalanx.checkpoint.host" in _cmdline(e)
    ]
    return [launcher_pid, *_descendants(launcher_pid), *hosts]


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def _cpu_accounting(proc: subprocess.Popen[bytes], folder: Path, *, steps: int) -> tuple[float, float]:
    """CPU time of every process of the run over the steady state (40%..95% of the steps): the share spent
    outside the training workers (launcher, master, spares, checkpoint host) and the CPU-seconds the whole
    run spends per training step. Unlike steps/s, which the host's noise moves by +-10% between runs here,
    both count work done, not time waited (a neighbour's steal time is no process's CPU time)."""

    def at_step(target: int) -> tuple[dict[int, int], set[int], int]:
        while proc.poll() is None:
            text = (folder / "steps.jsonl").read_text() if (folder / "steps.jsonl").exists() else ""
            records = [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]
            steps_ = [r for r in records if r["event"] == "step"]
            if steps_ and max(int(r["step"]) for r in steps_) >= target:
                reached = max(int(r["step"]) for r in steps_ if r["rank"] == 0)
                return _cpu_ticks(_launcher_processes(proc.pid)), {int(r["pid"]) for r in steps_}, reached
            time.sleep(0.2)
        raise RuntimeError(f"{folder.name}: the run ended before step {target}")

    before, _, first = at_step(int(steps * STEADY_FROM))
    after, workers, last = at_step(int(steps * 0.95))
    spent = {pid: after[pid] - before.get(pid, 0) for pid in after}
    total = sum(spent.values())
    share = sum(t for pid, t in spent.items() if pid not in workers) / total if total else 0.0
    return share, total / os.sysconf("SC_CLK_TCK") / max(1, last - first)


def measure_overhead(folder: Path, *, runs: int, steps: int) -> dict[str, object]:
    """2 processes per launcher, one launcher at a time, interleaved (drifting load hits both)."""
    steady: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    whole: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    shares: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    cpu_per_step: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for i in range(runs):
        for launcher in LAUNCHERS:
            run = folder / f"overhead-{launcher}-{i}"
            proc = _start_example(run, launcher=launcher, steps=steps, nproc=2)
            share, cpu_s = _cpu_accounting(proc, run, steps=steps)
            shares[launcher].append(share)
            cpu_per_step[launcher].append(cpu_s)
            _finish(proc)
            rate, overall = _rates(run, steps=steps)
            steady[launcher].append(rate)
            whole[launcher].append(overall)
            print(
                f"{launcher} run {i}: {rate:.1f} steps/s steady, {overall:.1f} overall, "
                f"launcher CPU share {100 * share:.2f}%, {1000 * cpu_s:.2f} CPU-ms per step",
                file=sys.stderr,
            )
    cpu_share = {f"{name}_median": statistics.median(got) for name, got in shares.items()}
    plain, ours = (statistics.median(cpu_per_step[name]) for name in LAUNCHERS)
    cpu = {
        "torchrun_median_s": plain,
        "phalanx-run_median_s": ours,
        "overhead": ours / plain - 1,
        "samples": cpu_per_step,
    }
    return _summary(
        steady,
        whole,
        steps=steps,
        processes=2,
        launcher_cpu_share={**cpu_share, "samples": shares},
        cpu_s_per_step=cpu,
    )


def measure_overhead_pinned(folder: Path, *, runs: int, steps: int) -> dict[str, object]:
    """Both launchers at once, one process each, each pinned to its own core (swapped every run): the
    host's noise, which moves rates by +-10% between runs here, then hits both sides of every pair."""
    steady: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    whole: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for i in range(runs):
        procs = {
            launcher: _start_example(
                folder / f"pinned-{launcher}-{i}",
                launcher=launcher,
                steps=steps,
                nproc=1,
                cpus=str((j + i) % 2),
            )
            for j, launcher in enumerate(LAUNCHERS)
        }
        for proc in procs.values():
            _finish(proc)
        for launcher in LAUNCHERS:
            rate, overall = _rates(folder / f"pinned-{launcher}-{i}", steps=steps)
            steady[launcher].append(rate)
            whole[launcher].append(overall)
        print(
            f"pinned run {i}: steps/s steady: torchrun {steady['torchrun'][-1]:.1f}, "
            f"phalanx-run {steady['phalanx-run'][-1]:.1f}",
            file=sys.stderr,
        )
    return _summary(steady, whole, steps=steps, processes=1, pinned=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--torchrun-worker":
        return torchrun_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--modes",
        default="inprocess,superseded,restart,torchrun,local,local-default,overhead,overhead-pinned",
    )
    p.add_argument("--overhead-steps", type=int, default=4000)
    p.add_argument("--out", default="")
    p.add_argument("--keep", default="", help="keep the logs of every run under this folder")
    args = p.parse_args()
    results: dict[str, dict[str, object]] = {}
    overhead: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        for mode in args.modes.split(","):
            if mode == "overhead":
                overhead[mode] = measure_overhead(Path(tmp), runs=args.runs, steps=args.overhead_steps)
                continue
            if mode == "overhead-pinned":
                overhead[mode] = measure_overhead_pinned(Path(tmp), runs=args.runs, steps=args.overhead_steps)
                continue
            samples: list[float] = []
            failures: list[str] = []
            attempts = 0
            while len(samples) < args.runs and attempts < MAX_ATTEMPTS_FACTOR * args.runs:
                i, attempts = attempts, attempts + 1
                folder = Path(tmp) / f"{mode}-{i}"
                try:
                    if mode == "torchrun":
                        samples.append(run_torchrun(folder))
                    elif mode == "local":
                        samples.append(run_local(folder))
                    elif mode == "superseded":
                        samples.append(run_superseded(folder))
                    elif mode == "local-default":
                        samples.append(run_local(folder, heartbeat_timeout="10s"))
                    else:
                        samples.append(run_phalanx(folder, restart=mode == "restart"))
                except (RuntimeError, subprocess.SubprocessError) as exc:  # reported, not hidden
                    failures.append(f"run {i}: {exc}")
                    print(f"{mode} run {i} failed: {exc}", file=sys.stderr)
                    continue
                print(f"{mode} run {i}: {samples[-1]:.3f} s", file=sys.stderr)
            results[mode] = {
                "median_s": statistics.median(samples) if samples else None,
                "samples_s": samples,
                "attempts": attempts,
                "failed_runs": failures,
            }
    if results.get("inprocess", {}).get("median_s") and results.get("torchrun", {}).get("median_s"):
        results["ratio_inprocess_to_torchrun"] = {
            "value": results["inprocess"]["median_s"] / results["torchrun"]["median_s"]  # type: ignore[operator]
        }
    report = {"name": "regroup", "kill_to_next_step": results, **overhead, "runs": args.runs,
              "cpu_count": os.cpu_count()}  # fmt: skip
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
