"""``phalanx status [JOB]``: a job at a glance, from its master or from its ElasticJob.

``phalanx status --master URL`` reads the master's HTTP API (``/v1/job``, ``/v1/nodes``, ``/v1/events``):
the job (phase, round, world size, step), its nodes (state, step, step time, straggler score, last
heartbeat), its rounds, failures and checkpoints. ``phalanx status JOB [-n NS]`` reads the ElasticJob's
status and its Pods through the kube context instead (no connection to the master needed); add
``--master URL`` to read the master too. ``--watch`` redraws every ``--interval`` seconds; ``-o json``
prints the same view as JSON. Installed as ``kubectl-phalanx`` too, so ``kubectl phalanx status JOB``
works once the package's scripts are on the PATH.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from phalanx.api import elasticjob as ej
from phalanx.api import views
from phalanx.cli.masterclient import Kube, MasterAPI, add_kube_flags, add_master_flags, master_from_args

__all__ = ["from_kube", "from_master", "register", "render"]

FAILURE_KINDS = ("failure", "hang", "node_lost", "eviction_requested")
CHECKPOINT_KINDS = ("checkpoint_committed", "checkpoint_failed", "checkpoint_breakpoint")
MAX_LISTED = 10
"""Newest rounds, failures and checkpoints shown in the table (``-o json`` has them all)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="Show a job: phase, round, nodes, rounds, failures, checkpoints.",
        description=(
            "Shows a job from its master's HTTP API (--master URL with the job token) or, given JOB, from "
            "the ElasticJob and its Pods through the kube context. Also `kubectl phalanx status JOB`."
        ),
    )
    p.add_argument("job", nargs="?", default="", help="ElasticJob name (read through the kube context).")
    add_master_flags(p)
    add_kube_flags(p)
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="Output format.")
    p.add_argument("-w", "--watch", action="store_true", help="Redraw every --interval seconds until Ctrl-C.")
    p.add_argument("--interval", type=float, default=2.0, help="Seconds between redraws with --watch.")
    p.set_defaults(handler=_run)


# ----------------------------------------------------------------------------------------------------
# Gathering


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _clock(unix: float | None) -> str:
    if not unix:
        return "-"
    return datetime.fromtimestamp(unix, tz=UTC).strftime("%H:%M:%S")


def from_master(api: MasterAPI) -> dict[str, Any]:
    """The view of a job from its master's HTTP API."""
    job = views.JobView.model_validate(api.get("/v1/job"))
    nodes = views.NodesView.model_validate(api.get("/v1/nodes")).nodes
    events = views.EventsPage.model_validate(api.get("/v1/events", since=0, limit=10_000)).events
    rows = []
    for n in nodes:
        steps = [r.step for r in n.ranks if r.step >= 0]
        straggler = n.straggler
        rows.append(
            {
                "node": n.node_id,
                "status": n.status,
                "state": n.state,
                "member": n.member,
                "step": min(steps) if steps else None,
                "step_time_s": straggler.step_time_s if straggler else None,
                "straggler_score": straggler.relative if straggler else None,
                "straggler_verdict": straggler.verdict if straggler else None,
                "heartbeat_age_s": n.heartbeat_age_s,
                "ranks": len(n.ranks),
            }
        )
    rounds = [
        {"round": e.round, "unix": e.unix, "message": e.message} for e in events if e.kind == "round_complete"
    ]
    failures = [
        {"id": e.seq, "unix": e.unix, "kind": e.kind, "node": e.node, "rank": e.rank, "message": e.message}
        for e in events
        if e.kind in FAILURE_KINDS
    ]
    checkpoints = [
        {"unix": e.unix, "kind": e.kind, "node": e.node, "message": e.message}
        for e in events
        if e.kind in CHECKPOINT_KINDS
    ]
    return {
        "source": "master",
        "job": {
            "name": job.job_id,
            "phase": str(job.phase),
            "reason": job.reason,
            "round": job.round,
            "world_size": job.world_size,
            "step": job.max_step,
            "restarts": f"{job.restart_count}/{job.max_restarts}",
            "evictions": f"{job.eviction_count}/{job.max_evictions}",
            "committed_checkpoint_step": job.committed_checkpoint_step,
            "root_cause": job.root_cause.model_dump(mode="json") if job.root_cause else None,
        },
        "nodes": rows,
        "rounds": rounds,
        "failures": failures,
        "checkpoints": checkpoints,
    }


def _pod_row(pod: Any, *, now: float) -> dict[str, Any]:
    labels = pod.metadata.labels or {}
    statuses = (pod.status.container_statuses or []) if pod.status else []
    started = pod.status.start_time.timestamp() if pod.status and pod.status.start_time else None
    return {
        "pod": pod.metadata.name,
        "role": labels.get("phalanx.dev/role", ""),
        "node_id": labels.get("phalanx.dev/node-id", ""),
        "phase": (pod.status.phase if pod.status else "") or "",
        "k8s_node": (pod.spec.node_name if pod.spec else "") or "",
        "restarts": sum(int(s.restart_count or 0) for s in statuses),
        "age_s": now - started if started else None,
        "deleting": pod.metadata.deletion_timestamp is not None,
    }


def from_kube(kube: Kube, name: str) -> dict[str, Any]:
    """The view of an ElasticJob from its status and its Pods (what the operator and the master publish)."""
    obj = kube.elastic_job(name)
    st = obj.get("status") or {}
    master = st.get(ej.STATUS_MASTER) or {}
    now = time.time()
    conditions = [
        {
            "type": c.get("type"),
            "status": c.get("status"),
            "reason": c.get("reason", ""),
            "message": c.get("message", ""),
        }
        for c in st.get("conditions") or []
    ]
    return {
        "source": "kubernetes",
        "job": {
            "name": name,
            "namespace": kube.namespace,
            "phase": st.get("phase", "") or "Pending",
            "reason": master.get(ej.MASTER_REASON, ""),
            "round": st.get(ej.STATUS_ROUND, 0),
            "world_size": st.get(ej.STATUS_WORLD_SIZE, 0),
            "step": st.get(ej.STATUS_STEP, -1),
            "restarts": str(st.get(ej.STATUS_RESTART_COUNT, 0)),
            "evictions": str(len(st.get(ej.STATUS_EVICTIONS) or [])),
            "committed_checkpoint_step": st.get(ej.STATUS_COMMITTED_STEP, -1),
            "nodes_running": st.get("nodes", 0),
            "members": master.get(ej.MASTER_MEMBERS) or [],
            "master_phase": master.get(ej.MASTER_PHASE, ""),
            "master_endpoint": st.get("masterEndpoint", ""),
            "conditions": conditions,
        },
        "pods": sorted((_pod_row(p, now=now) for p in kube.pods(name)), key=lambda r: (r["role"], r["pod"])),
        "evictions": st.get(ej.STATUS_EVICTIONS) or [],
    }


# ----------------------------------------------------------------------------------------------------
# Drawing


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def _num(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render(view: dict[str, Any]) -> str:
    """The view as a person reads it in a terminal."""
    job = view["job"]
    step = job["step"] if job["step"] is not None and job["step"] >= 0 else "-"
    committed = job["committed_checkpoint_step"]
    lines = [
        f"job {job['name']}: {job['phase']}  round {job['round']}  world {job['world_size']}  step {step}  "
        f"restarts {job['restarts']}  evictions {job['evictions']}  "
        f"checkpoint {committed if committed is not None and committed >= 0 else '-'}",
    ]
    if job.get("reason"):
        lines.append(f"  {job['reason']}")
    root = job.get("root_cause")
    if isinstance(root, dict) and root.get("node_id"):
        lines.append(
            f"  root cause of round {root.get('round')}: rank {root.get('rank')} on {root['node_id']}: "
            f"{str(root.get('message', ''))[:160]}"
        )
    if view["source"] == "master":
        lines.append("")
        lines += _table(
            ["NODE", "STATUS", "STATE", "MEMBER", "STEP", "STEP TIME", "STRAGGLER", "HEARTBEAT"],
            [
                [
                    n["node"],
                    n["status"],
                    n["state"],
                    "yes" if n["member"] else "no",
                    _num(n["step"], "d"),
                    _num(n["step_time_s"], ".3f", "s"),
                    "-"
                    if n["straggler_score"] is None
                    else f"{n['straggler_score']:.2f} {n['straggler_verdict'] or ''}".rstrip(),
                    _age(n["heartbeat_age_s"]) + (" ago" if n["heartbeat_age_s"] is not None else ""),
                ]
                for n in view["nodes"]
            ],
        )
        sections: tuple[tuple[str, list[dict[str, Any]], Callable[[dict[str, Any]], str]], ...] = (
            (
                "ROUNDS",
                view["rounds"],
                lambda r: f"round {r['round']:<4} {_clock(r['unix'])}  {r['message']}",
            ),
            (
                "FAILURES",
                view["failures"],
                lambda f: (
                    f"#{f['id']:<5} {_clock(f['unix'])}  {f['kind']:<18} {f['node'] or '-':<10} "
                    f"{f['message']}"
                ),
            ),
            (
                "CHECKPOINTS",
                view["checkpoints"],
                lambda c: f"{_clock(c['unix'])}  {c['kind']:<21} {c['message']}",
            ),
        )
        for title, items, line in sections:
            lines.append("")
            shown = items[-MAX_LISTED:]
            more = f" (newest {len(shown)} of {len(items)})" if len(items) > len(shown) else ""
            lines.append(f"{title}{more}" if items else f"{title}: none")
            lines += [f"  {line(i)}"[:200] for i in shown]
    else:
        lines.append(
            f"  master {job['master_phase'] or '-'} at {job['master_endpoint'] or '-'}; "
            f"members {' '.join(job['members']) or '-'}"
        )
        for c in job["conditions"]:
            if c["status"] == "True":
                lines.append(f"  condition {c['type']}: {c['reason']}")
            elif c["type"] == "PodsReady" and c["reason"] != "Starting":  # a Pod that cannot start, and why
                lines.append(f"  Pods not ready: {c['reason']}: {c.get('message', '')}"[:400])
        lines.append("")
        lines += _table(
            ["POD", "ROLE", "NODE ID", "PHASE", "K8S NODE", "RESTARTS", "AGE"],
            [
                [
                    p["pod"],
                    p["role"],
                    p["node_id"] or "-",
                    p["phase"] + (" (deleting)" if p["deleting"] else ""),
                    p["k8s_node"] or "-",
                    str(p["restarts"]),
                    _age(p["age_s"]),
                ]
                for p in view["pods"]
            ],
        )
        if view["evictions"]:
            lines.append("")
            lines.append("EVICTIONS")
            lines += [f"  {e.get('nodeId', '')}: {e.get('reason', '')}"[:200] for e in view["evictions"]]
    return "\n".join(lines)


def _view(args: argparse.Namespace) -> dict[str, Any]:
    if args.job and not args.master:
        kube = Kube(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
        return from_kube(kube, args.job)
    return from_master(master_from_args(args, job=args.job))


def _show(view: dict[str, Any], output: str) -> str:
    return json.dumps(view, indent=2, default=str) if output == "json" else render(view)


def _run(args: argparse.Namespace) -> int:
    if not args.watch:
        print(_show(_view(args), args.output))
        return 0
    interval = max(0.2, args.interval)
    try:
        while True:
            text = _show(_view(args), args.output)
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: a redraw, not a scroll
            stamp = datetime.now(tz=UTC).strftime("%H:%M:%S")
            sys.stdout.write(f"{text}\n-- {stamp} UTC, every {interval:g}s, Ctrl-C to stop\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
