"""Recovery after a worker SIGKILL: torchrun vs phalanx-run, same script, same fault, same measurement.

Both launchers run ``examples/ddp_mlp.py`` (1 node x 2 processes, gloo, a small MLP, ``torch.save``
checkpoint every step) with ``--max-restarts 3 --standalone``. When rank 0 has logged step ``--kill-step``,
rank 1 is killed with SIGKILL. Recovery time is from the kill to the first step completed afterwards
(the script appends one JSON line per completed step with ``time.time()``); steps lost are the completed
steps that had to be redone; the script also logs when each incarnation began, so the kill -> script start
part of the restart path is reported on its own. Medians over ``--runs`` runs each, printed as JSON.

With ``--nodes N`` (N > 1) the job has N nodes of 2 processes on this machine: N torchrun agents meeting in a
c10d rendezvous (its timeouts tuned down as in benchmarks/regroup.py) against ``phalanx local`` (a master and
an agent per node); the kill is of node 0's second process, and every node restarts its processes (a plain
script cannot re-form its process group in place). On two cores, 6 training processes and the launchers
share the CPU, so what each launcher keeps running beside the script (spares, probe servers) counts.

With ``--state-mb N`` every rank carries N MiB more state: torchrun's script torch.saves it every step
(rank 0), and phalanx flash-checkpoints it every step and persists it every ``--persist-every`` steps, so
its restart also saves the last in-memory step at the breakpoint. A kill right after a step's log line then
lands in the save that follows it; ``--kill-delay`` moves it past the save, into the next step.

With ``--extra-imports a,b`` the script imports those libraries first: torchrun's restarted worker imports
them again, phalanx-run's warm spare imported them beforehand because the first incarnation recorded them
(``imports_recorded_before_kill``: how many names the killed rank had recorded when it was killed).

    .venv/bin/python benchmarks/recovery.py --runs 5
    .venv/bin/python benchmarks/recovery.py --runs 5 --optimizer adam \
        --out benchmarks/results/recovery-adam.json
    .venv/bin/python benchmarks/recovery.py --runs 5 --nodes 3 --optimizer adam \
        --out benchmarks/results/recovery-3nodes.json
    .venv/bin/python benchmarks/recovery.py --state-mb 512 --steps 40 --kill-step 20 --step-time 0.6 \
        --kill-delay 0.45 --timeout 300 --out benchmarks/results/recovery-512mb.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "ddp_mlp.py"
WRAPPER = """import importlib, runpy, sys
for name in {names!r}:
    importlib.import_module(name)
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""
"""With ``--extra-imports``: the script both launchers run; it imports those libraries, then runs the example
(whose start log then begins after them)."""


# torchrun's defaults wait 30 s for late nodes and 5 s x 3 keep-alives for a dead one; tuned down (as in
# benchmarks/regroup.py) so that the baseline is measured at its best, not at its defaults.
RDZV_CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"


def launchers(name: str, *, nodes: int, checkpoint_dir: Path | None, log_dir: Path) -> list[list[str]]:
    """The commands that start the job: one per node for torchrun (its agents meet in a c10d rendezvous,
    the first one hosting the store), one for phalanx (``phalanx-run --standalone`` on one node, ``phalanx
    local`` with its master and one agent per node on several)."""
    common = ["--max-restarts", "3", "--nproc-per-node", "2"]
    if name == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", *common]
        if nodes == 1:
            return [[*torchrun, "--standalone"]]
        port = _free_port()
        rdzv = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        rdzv += ["--rdzv-id", "bench", "--rdzv-conf", RDZV_CONF]
        return [[*torchrun, *rdzv] for _ in range(nodes)]
    if nodes > 1:
        local = [sys.executable, "-m", "phalanx.cli.main", "local", "--nodes", str(nodes), *common]
        local += ["--workdir", str(log_dir)]
        if checkpoint_dir is not None:
            local.append(f"--agent-arg=--checkpoint-dir={checkpoint_dir}")
        return [[*local, "--"]]
    if checkpoint_dir is not None:
        common += ["--checkpoint-dir", str(checkpoint_dir)]
    return [[sys.executable, "-m", "phalanx.cli.run", *common, "--standalone", "--log-dir", str(log_dir)]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recorded_imports(log_dir: Path, local_rank: int) -> int | None:
    """How many module names the killed rank's first incarnation recorded for its next spare to import
    (phalanx.agent.script_imports); None when it recorded nothing (or the launcher is not phalanx-run)."""
    try:
        return len((log_dir / "imports" / f"{local_rank}.txt").read_text().split())
    except OSError:
        return None


def read_steps(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def one_run(
    name: str,
    *,
    nodes: int,
    steps: int,
    kill_step: int,
    kill_delay: float,
    step_time: float,
    timeout: float,
    state_mb: int,
    persist_every: int,
    optimizer: str,
    extra_imports: list[str],
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        d = Path(tmp)
        log, pids = d / "steps.jsonl", d / "pids"
        pids.mkdir()
        args = ["--steps", str(steps), "--ckpt", str(d / "ckpt.pt"), "--step-log", str(log)]
        args += ["--step-time", str(step_time), "--pid-dir", str(pids), "--state-mb", str(state_mb)]
        args += ["--optimizer", optimizer, "--start-log", str(d / "starts.jsonl")]
        # With a big state phalanx saves it the way it is meant to: flash checkpoint, persisted now and then.
        flash = name == "phalanx" and state_mb > 0
        if flash:
            args += ["--flash", "--persist-every", str(persist_every)]
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        script = SCRIPT
        if extra_imports:
            script = d / "train.py"
            script.write_text(WRAPPER.format(names=extra_imports, script=str(SCRIPT)))
        out = (d / "launcher.log").open("w")
        commands = launchers(
            name, nodes=nodes, checkpoint_dir=d / "flash" if flash else None, log_dir=d / "logs"
        )
        procs = []
        for i, command in enumerate(commands):
            procs.append(
                subprocess.Popen(
                    [*command, str(script), *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
            if i == 0 and len(commands) > 1:
                time.sleep(0.5)  # the first torchrun agent hosts the rendezvous store
        t_kill = None
        deadline = time.monotonic() + timeout
        result: dict[str, Any] = {"launcher": name, "ok": False}
        try:
            while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
                lines = read_steps(log)
                if t_kill is None and lines and lines[-1]["step"] >= kill_step:
                    time.sleep(kill_delay)
                    killed_after = read_steps(log)[-1]["step"]
                    victim = int((pids / "rank1.pid").read_text())
                    t_kill = time.time()
                    os.kill(victim, signal.SIGKILL)
                    result["killed_after_step"] = killed_after
                    result["imports_recorded_before_kill"] = recorded_imports(d / "logs", local_rank=1)
                time.sleep(0.005)
            codes = [proc.wait(max(1.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            codes = [proc.wait() for proc in procs]
        code = max(codes, key=abs)
        lines = read_steps(log)
        after = [entry for entry in lines if t_kill is not None and entry["time"] > t_kill]
        result["exit_code"] = code
        if t_kill is not None and after:
            first = after[0]
            result["recovery_s"] = first["time"] - t_kill
            result["resumed_at_step"] = first["step"]
            result["steps_lost"] = max(0, result["killed_after_step"] - first["step"] + 1)
            # The path of the restart: kill -> the new script begins -> it is ready to train (its process
            # group formed, its checkpoint loaded) -> its first step.
            starts = [s for s in read_steps(d / "starts.jsonl") if s["started"] > t_kill]
            if starts:
                result["kill_to_script_start_s"] = starts[0]["started"] - t_kill
                result["kill_to_ready_s"] = starts[0]["ready"] - t_kill
        result["final_step"] = lines[-1]["step"] if lines else -1
        result["ok"] = code == 0 and "recovery_s" in result and result["final_step"] == steps - 1
        if not result["ok"]:
            result["log_tail"] = (d / "launcher.log").read_text()[-2000:]
        return result


def _median(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["ok"]]
    return {
        "attempted": len(runs),
        "succeeded": len(ok),
        "median_recovery_s": statistics.median(r["recovery_s"] for r in ok) if ok else None,
        "median_steps_lost": statistics.median(r["steps_lost"] for r in ok) if ok else None,
        "recovery_s": [round(r["recovery_s"], 3) for r in ok],
        "steps_lost": [r["steps_lost"] for r in ok],
        "median_kill_to_script_start_s": _median(r.get("kill_to_script_start_s") for r in ok),
        "median_kill_to_ready_s": _median(r.get("kill_to_ready_s") for r in ok),
        "imports_recorded_before_kill": [r.get("imports_recorded_before_kill") for r in ok],
        "failed_runs": [r for r in runs if not r["ok"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of 2 processes each; more than 1: torchrun's agents in a c10d rendezvous against "
        "phalanx local (its master and an agent per node), the kill on node 0",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-step", type=int, default=120, help="kill after rank 0 logged this step")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument(
        "--kill-delay",
        type=float,
        default=0.0,
        help="kill this long after the step's log line (with a big state, past the save that follows it)",
    )
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--launchers", default="torchrun,phalanx")
    p.add_argument(
        "--state-mb",
        type=int,
        default=0,
        help="MiB of extra state per rank; then torchrun's script torch.saves it every step (rank 0) and "
        "phalanx's flash-checkpoints it every step and persists it every --persist-every steps",
    )
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="the script's optimizer")
    p.add_argument(
        "--extra-imports",
        type=lambda text: [n for n in text.split(",") if n],
        default=[],
        help="libraries the script imports before it runs the example (comma-separated), e.g. "
        "matplotlib.pyplot: what a restart imports again under torchrun, and a warm spare beforehand",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report: dict[str, Any] = {
        "setup": {
            "nodes": args.nodes,
            "nproc_per_node": 2,
            "backend": "gloo",
            "steps": args.steps,
            "kill_step": args.kill_step,
            "kill_delay_s": args.kill_delay,
            "step_time_s": args.step_time,
            "runs": args.runs,
            "state_mb": args.state_mb,
            "persist_every": args.persist_every if args.state_mb else None,
            "optimizer": args.optimizer,
            "extra_imports": args.extra_imports,
            "cpus": os.cpu_count(),
            "load_average_before": round(os.getloadavg()[0], 2),
        }
    }
    names = args.launchers.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(args.runs):
        for name in names:  # interleaved, so drifting machine load hits both alike
            r = one_run(
                name,
                nodes=args.nodes,
                steps=args.steps,
                kill_step=args.kill_step,
                kill_delay=args.kill_delay,
                step_time=args.step_time,
                timeout=args.timeout,
                state_mb=args.state_mb,
                persist_every=args.persist_every,
                optimizer=args.optimizer,
                extra_imports=args.extra_imports,
            )
            runs[name].append(r)
            print(
                f"run {i} {name}: recovery {r.get('recovery_s', float('nan')):.3f}s "
                f"lost {r.get('steps_lost')} "
                f"script start {r.get('kill_to_script_start_s', float('nan')):.3f}s "
                f"ok {r['ok']}",
                file=sys.stderr,
                flush=True,
            )
    for name in names:
        report[name] = summarise(runs[name])
    t, ph = report.get("torchrun", {}), report.get("phalanx", {})
    if t.get("median_recovery_s") and ph.get("median_recovery_s"):
        report["ratio_phalanx_to_torchrun"] = round(ph["median_recovery_s"] / t["median_recovery_s"], 3)
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
