"""What fuzzing the master (tests/master/test_fuzz.py) found, each as its smallest reproducer against a real
master process: before the fixes, each made the master fail internally (gRPC UNKNOWN, HTTP 500), let a
number that is none through, or broke the API's documented contract."""

from __future__ import annotations

import itertools
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from phalanx.api.v1 import master_pb2 as pb

from .procs import AUTH, Agent, Master

pytestmark = pytest.mark.integration

NUMBERS = itertools.count()


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    m = Master(tmp_path_factory.mktemp("findings"), "--nodes", "1:2")
    yield m
    m.stop(signal.SIGKILL)


@pytest.fixture
def agent(master: Master) -> Agent:
    a = Agent(master, f"node-{next(NUMBERS)}")
    a.register()
    return a


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def test_a_probe_report_of_an_unknown_probe_kind_is_refused(master: Master, agent: Agent) -> None:
    # Was UNKNOWN: ProbeKind.Name raised ValueError in the handler.
    req = pb.ReportProbeRequest(node_id=agent.node_id, incarnation=agent.incarnation, probe=-2147483648)  # type: ignore[arg-type]
    assert code_of(lambda: master.stub.ReportProbe(req, metadata=AUTH, timeout=10)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_node_state_of_a_newer_agent_is_shown_as_unknown(master: Master, agent: Agent) -> None:
    # Was HTTP 500 on /v1/nodes: NodeState.Name raised ValueError for the stored state.
    req = pb.HeartbeatRequest(node_id=agent.node_id, incarnation=agent.incarnation, state=2147483647)  # type: ignore[arg-type]
    master.stub.Heartbeat(req, metadata=AUTH, timeout=10)
    nodes = master.client.get("/v1/nodes")
    assert nodes.status_code == 200
    assert {n["node_id"]: n["state"] for n in nodes.json()["nodes"]}[agent.node_id] == "unknown"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_in_any_request_are_refused(master: Master, agent: Agent, value: float) -> None:
    # Was accepted and kept: /v1/nodes then served null where it documents a number (JSON has no nan), and
    # every later comparison with the value was false.
    ids = {"node_id": agent.node_id, "incarnation": agent.incarnation}
    calls = [
        lambda: master.stub.Heartbeat(
            pb.HeartbeatRequest(**ids, ranks=[pb.RankProgress(beacon_age_s=value)]), metadata=AUTH, timeout=10
        ),
        lambda: master.stub.ReportProbe(
            pb.ReportProbeRequest(
                **ids, probe=pb.PROBE_KIND_MATMUL, measurements=[pb.ProbeMeasurement(elapsed_s=value)]
            ),
            metadata=AUTH,
            timeout=10,
        ),
        lambda: master.stub.ReportCheckpoint(
            pb.ReportCheckpointRequest(**ids, state=pb.CHECKPOINT_STATE_FAILED, duration_s=value),
            metadata=AUTH,
            timeout=10,
        ),
        lambda: master.stub.ReportStacks(
            pb.ReportStacksRequest(**ids, ranks=[pb.RankStacks(beacon_age_s=value)]),
            metadata=AUTH,
            timeout=10,
        ),
    ]
    assert [code_of(call) for call in calls] == [grpc.StatusCode.INVALID_ARGUMENT] * len(calls)
    assert master.client.get("/v1/nodes").status_code == 200
    assert master.client.get("/v1/job").status_code == 200


def test_the_schema_documents_the_json_refusal_of_a_missing_token(master: Master, tmp_path: Path) -> None:
    # Schemathesis: /metrics documented its 401 as text/plain, the master answers JSON.
    schema = master.client.get("/openapi.json").json()
    assert "application/json" in schema["paths"]["/metrics"]["get"]["responses"]["401"]["content"]
    assert master.client.get("/openapi.json", headers={"Authorization": ""}).status_code == 401
