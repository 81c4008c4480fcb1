"""``phalanx timeline`` and ``phalanx status`` against a real master process: intervals arrive in real
heartbeats through the agent's gRPC client, a failure through ReportFailure, and the commands run as the
real CLI (and through the real ``kubectl`` binary as a plugin, when the tests built one)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from phalanx.agent.client import MasterClient
from phalanx.api import views
from phalanx.api.v1 import master_pb2 as pb
from phalanx.cli.timeline import png_size
from tests.cli.trace_format import check_trace
from tests.master.procs import TOKEN, Agent, Master

pytestmark = pytest.mark.integration

NS = 1_000_000_000
STEPS = 5


def _interval(name: str, start: float, end: float, *, seq: int, group: str = "") -> pb.Interval:
    return pb.Interval(
        name=name,
        group=group,
        seq=seq,
        start_unix_ns=int(start * NS),
        end_unix_ns=int(end * NS) if end else 0,
    )


def _rank_intervals(rank: int, base: float) -> list[pb.Interval]:
    """Five 0.8 s steps a second apart, each with an all_reduce from 0.5 s to 0.75 s into it; rank 3 hangs
    in the last all_reduce (it and its step stay open)."""
    out = []
    for k in range(STEPS):
        hung = rank == 3 and k == STEPS - 1
        t = base + k
        out.append(_interval("step", t, 0 if hung else t + 0.8, seq=k))
        out.append(_interval("all_reduce", t + 0.5, 0 if hung else t + 0.75, seq=k + 1, group="dp:0,1,2,3"))
    return out


def _cli(*args: str, env: dict[str, str] | None = None, exe: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [exe] if exe else [sys.executable, "-m", "phalanx.cli.main"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=60, env=env or _env(), check=False
    )


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process (no second interpreter start and matplotlib import per call)."""
    from phalanx.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_TOKEN_FILE"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _kubectl() -> Path | None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
    try:
        from k8s_harness.controlplane import find_binaries
    finally:
        sys.path.pop(0)
    bin_dir = find_binaries()
    return bin_dir / "kubectl" if bin_dir else None


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A master with two nodes of two ranks in round 1, the ranks' intervals, and one failure."""
    tmp = tmp_path_factory.mktemp("timeline")
    master = Master(
        tmp, "--nodes", "2:2", "--heartbeat-interval", "2", "--heartbeat-timeout", "30", "--last-call", "0.2"
    )
    try:
        agents = [Agent(master, f"node-{i}", nproc=2) for i in range(2)]
        for a in agents:
            a.register()
        rounds = [a.join(29500 + i) for i, a in enumerate(agents)]
        for a, r in zip(agents, rounds, strict=True):
            assert a.get(r).status == pb.RENDEZVOUS_STATUS_COMPLETE
        base = time.time() - STEPS - 1
        client = MasterClient(address=master.grpc, token=TOKEN)
        try:
            for i, a in enumerate(agents):
                ranks = [
                    pb.RankProgress(
                        rank=2 * i + lr,
                        local_rank=lr,
                        step=STEPS - 1,
                        step_unix_ns=int((base + STEPS - 0.2) * NS),
                        pid=1000 + 2 * i + lr,
                        # As a recorder's rank sends them: with its activity.
                        activity=pb.RankActivity(last_record_unix_ns=int((base + STEPS - 0.2) * NS)),
                        intervals=_rank_intervals(2 * i + lr, base),
                    )
                    for lr in range(2)
                ]
                client.heartbeat(
                    pb.HeartbeatRequest(
                        node_id=a.node_id,
                        incarnation=a.incarnation,
                        state=pb.NODE_STATE_RUNNING,
                        round=a.round,
                        ranks=ranks,
                    ),
                    timeout=10,
                )
        finally:
            client.close()
        agents[1].fail(rank=3, message="rank 3 stuck in all_reduce 5")
        failure = next(e for e in master.events() if e["kind"] == "failure")
        yield {"master": master, "tmp": tmp, "base": base, "failure": failure, "url": f"http://{master.http}"}
    finally:
        master.stop()


def test_timeline_writes_a_valid_trace_and_a_png_around_the_failure(
    job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PHALANX_TOKEN_FILE", raising=False)
    tmp, base, failure = job["tmp"], job["base"], job["failure"]
    out = tmp / "around"
    code, stdout, stderr = _main(
        capsys,
        "timeline", "--master", job["url"], "--token-file", str(tmp / "token"), "--around", "latest",
        "--window", "30", "-o", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    trace = json.loads(out.with_suffix(".json").read_text())
    assert check_trace(trace) == []
    events = trace["traceEvents"]
    start = trace["otherData"]["start_unix"]
    assert start == pytest.approx(failure["unix"] - 30, abs=1e-3)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(processes[e["pid"]], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {("node-0", 0), ("node-0", 1), ("node-1", 2), ("node-1", 3)}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 4 * STEPS * 2
    # Units: microseconds from the window's start, as sent.
    rank0_steps = sorted(
        (e for e in slices if processes[e["pid"]] == "node-0" and e["tid"] == 0 and e["cat"] == "step"),
        key=lambda e: e["ts"],
    )
    # Within a microsecond: the trace and this test round differently computed floats of the same instant.
    expected = [(base + k - start) * 1e6 for k in range(STEPS)]
    assert [e["ts"] for e in rank0_steps] == pytest.approx(expected, abs=1)
    assert {round(e["dur"]) for e in rank0_steps} == {800_000}
    # The hung rank's last all_reduce and step are open, drawn up to when the master answered.
    hung = [e for e in slices if e["tid"] == 3 and e["args"].get("open")]
    assert sorted(e["name"] for e in hung) == ["all_reduce (open)", "step (open)"]
    now_us = (trace["otherData"]["now_unix"] - start) * 1e6
    assert all(e["ts"] + e["dur"] == pytest.approx(now_us, abs=1) for e in hung)
    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant["name"] == f"failure #{failure['seq']}"
    assert instant["ts"] == pytest.approx((failure["unix"] - start) * 1e6, abs=1)
    assert processes[instant["pid"]] == "node-1"
    # The picture: a PNG of the size for 4 ranks, with the failure's red line in it.
    png = out.with_suffix(".png")
    assert _png_size(png) == png_size(4)
    from matplotlib import image

    pixels = image.imread(png)
    red = (pixels[..., 0] > 0.75) & (pixels[..., 1] < 0.1) & (pixels[..., 2] < 0.1)
    assert red.any(axis=0).sum() >= 1, "no failure line drawn"
    assert f"{png} ({png_size(4)[0]}x{png_size(4)[1]})" in stdout


def test_the_timeline_endpoint_checks_its_token_and_its_arguments(job: dict[str, Any]) -> None:
    master: Master = job["master"]
    assert master.client.get("/v1/timeline", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert master.client.get("/v1/timeline", params={"around": "999999"}).status_code == 404
    assert master.client.get("/v1/timeline", params={"around": "1e9"}).status_code == 422
    assert master.client.get("/v1/timeline", params={"window_s": "0"}).status_code == 422
    recent = master.client.get("/v1/timeline", params={"node": "node-1", "window_s": 60}).json()
    assert [r["rank"] for r in recent["ranks"]] == [2, 3]
    assert recent["kept"] == 4 * STEPS * 2
    assert recent["refused"] == 0
    # A wrong token file: refused, said so, and no token printed.
    bad = job["tmp"] / "bad-token"
    bad.write_text("not-the-job-token-at-all\n")
    result = _cli("timeline", "--master", job["url"], "--token-file", str(bad), "-o", str(job["tmp"] / "x"))
    assert result.returncode == 1
    assert "refused the job token" in result.stderr
    assert "not-the-job-token" not in result.stderr + result.stdout


def _undeclared(value: Any, path: str = "") -> list[str]:
    """The fields of an answer its view does not declare, at any depth."""
    if isinstance(value, BaseModel):
        found = [f"{path}.{name}" for name in value.model_extra or {}]
        for name in type(value).model_fields:
            found += _undeclared(getattr(value, name), f"{path}.{name}")
        return found
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _undeclared(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for k, item in value.items() for p in _undeclared(item, f"{path}[{k}]")]
    return []


def test_every_answer_is_its_declared_view_and_the_schema_says_so(job: dict[str, Any]) -> None:
    """The master's answers parse as the views of phalanx.api.views with no field left undeclared (the
    timeline's too, which is encoded off the event loop without FastAPI's check), and its OpenAPI schema
    names each view: the schema is the contract the readers and the fuzz tests go by."""
    master: Master = job["master"]
    answers = {
        "/v1/job": views.JobView,
        "/v1/nodes": views.NodesView,
        "/v1/events": views.EventsPage,
        "/v1/logs": views.LogsPage,
        "/v1/timeline?around=latest&window_s=60": views.TimelineView,
        "/healthz": views.Health,
    }
    for path, view in answers.items():
        answer = view.model_validate(master.client.get(path).raise_for_status().json())
        assert _undeclared(answer) == [], path
    nodes = views.NodesView.model_validate(master.client.get("/v1/nodes").json()).nodes
    assert [n.node_id for n in nodes] == ["node-0", "node-1"]
    assert [r.rank for r in nodes[1].ranks] == [2, 3]
    timeline = views.TimelineView.model_validate(master.client.get("/v1/timeline?around=latest").json())
    assert timeline.around_failure is not None
    assert timeline.around_failure.id == job["failure"]["seq"]
    paths = master.client.get("/openapi.json").json()["paths"]
    for path, view in answers.items():
        content = paths[path.split("?")[0]]["get"]["responses"]["200"]["content"]["application/json"]
        assert content["schema"]["$ref"].endswith(f"/{view.__name__}"), (path, content)


def test_status_shows_the_job_its_nodes_and_the_failure(
    job: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    token = str(job["tmp"] / "token")
    code, stdout, stderr = _main(
        capsys, "status", "--master", job["url"], "--token-file", token, "-o", "json"
    )
    assert code == 0, stderr
    view = json.loads(stdout)
    assert view["job"]["name"] == "test-job"
    assert view["job"]["step"] == STEPS - 1
    assert [(n["node"], n["step"], n["status"]) for n in view["nodes"]] == [
        ("node-0", STEPS - 1, "alive"),
        ("node-1", STEPS - 1, "alive"),
    ]
    assert [f["id"] for f in view["failures"] if f["kind"] == "failure"] == [job["failure"]["seq"]]
    assert view["rounds"][0]["round"] == 1
    # As a kubectl plugin: the real kubectl finds kubectl-phalanx on the PATH (else the script itself).
    kubectl = _kubectl()
    table = _cli(
        *(["phalanx"] if kubectl else []), "status", "--master", job["url"], "--token-file", token,
        exe=str(kubectl or Path(sys.executable).parent / "kubectl-phalanx"),
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("job test-job: ")
    assert any(line.split()[:3] == ["node-1", "alive", "running"] for line in lines)
    assert any(f"#{job['failure']['seq']}" in line and "rank 3" in line for line in lines)
    assert "STRAGGLER" in table.stdout


def test_status_watch_redraws_until_interrupted(job: dict[str, Any]) -> None:
    # Ctrl-C as in a terminal, even when this suite runs as a background job: a shell starts those with SIGINT
    # ignored, a child inherits that, and Python then never raises KeyboardInterrupt. A handled signal is
    # reset to its default in the child.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli.main", "status", "--master", job["url"], "--token-file",
             str(job["tmp"] / "token"), "--watch", "--interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        # Interrupted once it has redrawn twice (not after a fixed time: a loaded machine starts it slowly).
        assert proc.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while sum("Ctrl-C to stop" in line for line in seen) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes: an open one would be reported by a later test
    out = "".join(seen) + out
    assert proc.returncode == 0, err
    assert out.count("job test-job: ") >= 2
    assert out.count("Ctrl-C to stop") >= 2
