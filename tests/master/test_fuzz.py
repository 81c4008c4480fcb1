"""Fuzzing a real ``phalanx master`` process over real sockets: its gRPC messages with hypothesis, its HTTP
API with schemathesis (requests generated from the master's own OpenAPI schema, sent with the job token).

What must hold, whatever comes in: no request makes the master fail internally (gRPC UNKNOWN or INTERNAL,
HTTP 5xx), nothing it logs is a traceback, and it keeps serving (a health call and a well-formed request
succeed afterwards). The gRPC messages are built from the proto descriptors, so every field of every
request is covered, new fields included: numbers at and beyond their range (negative, huge, nan, inf),
long and non-ASCII strings, unknown enum values, and ids that are either a registered node's (so requests
get past the id check into the job's logic) or unknown.

The gRPC tests run first: the values they leave in the job (a beacon age of 1e308, a probe's elapsed
time) are then what the HTTP API has to serve.

Case counts are bounded (``max_examples``, no deadline) to keep the module near 30 s; the number of cases
run is printed at the end (``pytest -s``) and asserted.
"""

from __future__ import annotations

import math
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import schemathesis
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from phalanx.api.v1 import master_pb2 as pb

from .procs import AUTH, TOKEN, Agent, Master

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GRPC_EXAMPLES = 150  # per RPC, 10 RPCs
HTTP_EXAMPLES = 150  # over all operations of the HTTP API; half as many again with invalid parameters
CASES: Counter[str] = Counter()
BEARER = {"Authorization": f"Bearer {TOKEN}"}

# A refusal is fine; these are the master's internal failures (an exception escaped a handler).
BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    tmp = tmp_path_factory.mktemp("fuzz")
    m = Master(
        tmp,
        "--nodes", "1:4",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2",
        "--last-call", "0.1", "--long-poll-max-s", "0.2",
        "--max-restarts", "1000", "--max-evictions", "1000",
        "--probes-enabled", "true",
    )  # fmt: skip
    try:
        a, b = Agent(m, "node-a"), Agent(m, "node-b")
        for agent, port in ((a, 5001), (b, 5002)):
            agent.register()
            agent.join(port)
        a.get(1, wait_s=5.0)
        b.get(1, wait_s=5.0)
        m.known = [(a.node_id, a.incarnation), (b.node_id, b.incarnation)]  # type: ignore[attr-defined]
        yield m
    finally:
        stderr = m.stderr_path.read_text(errors="replace")
        m.stop(signal.SIGKILL)
        print(f"\nfuzz cases run: {dict(CASES)}, {sum(CASES.values())} in all")
    assert "Traceback" not in stderr, stderr[-4000:]


# ------------------------------------------------------------------------------------------------------
# gRPC: messages generated from the descriptors

INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
STRINGS = st.one_of(
    TEXT,
    st.sampled_from(["", "node-a", "127.0.0.1", "ノード", "a" * 300, "x" * 70_000, "\x00\n\x1b[31m"]),
)


def ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, -1, 0, 1, 2, 65535, 65536, 2**31 - 1) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(-1000, 1000).filter(lambda v: low <= v <= high),
                     st.integers(low, high))  # fmt: skip


def wild(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Any value of the field's wire type, its extremes and the values that break naive code first."""
    if field.type in INT_RANGES:
        return ints(*INT_RANGES[field.type])
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), ints(*INT_RANGES[FieldDescriptor.TYPE_INT32]))
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(
            st.sampled_from([0.0, -0.0, -1.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf]),
            st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64),
        )
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return STRINGS
    raise AssertionError(f"no strategy for {field.full_name}")


def tame(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """A value an agent might send, so that a request with every field tame but one gets past validation
    and reaches the job's logic."""
    if field.type in INT_RANGES:
        return st.integers(1, 6)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values if v.number != 0])
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(0.0, 1.0)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        if field.name == "job_id":
            return st.just("test-job")
        if field.name.endswith("host"):
            return st.just("127.0.0.1")
        return st.sampled_from(["node-a", "node-b", "x", "RuntimeError: boom", "1.0"])
    raise AssertionError(f"no strategy for {field.full_name}")


def message(desc: Descriptor, known: list[tuple[str, str]], depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``desc``: all fields tame, all wild, or all tame but one wild (picked at random), nested
    messages alike. Requests that carry a node's ids mostly carry a registered node's."""
    cls = getattr(pb, desc.name)
    names = [f.name for f in desc.fields]

    def field_strategy(field: FieldDescriptor, is_wild: bool) -> st.SearchStrategy[Any]:
        entry = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            pick = wild if is_wild else tame
            return st.dictionaries(pick(key), pick(value), max_size=3)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            one = message(field.message_type, known, depth + 1)
        else:
            one = wild(field) if is_wild else tame(field)
        return st.lists(one, max_size=3) if field.is_repeated else one

    tame_fields = {f.name: field_strategy(f, False) for f in desc.fields}
    wild_fields = {f.name: field_strategy(f, True) for f in desc.fields}
    ids = st.one_of(st.sampled_from(known), st.sampled_from(known), st.tuples(STRINGS, STRINGS))

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        mode = draw(st.sampled_from(["tame", "one wild", "all wild"]))
        odd = draw(st.sampled_from(names)) if mode == "one wild" else None
        values = {}
        for name in names:
            is_wild = mode == "all wild" or name == odd
            values[name] = draw(wild_fields[name] if is_wild else tame_fields[name])
        if depth == 0 and "node_id" in values and "incarnation" in values:
            if mode == "all wild" or odd in ("node_id", "incarnation"):
                values["node_id"], values["incarnation"] = draw(ids)
            else:
                values["node_id"], values["incarnation"] = draw(st.sampled_from(known))
        return cls(**values)

    return build()


def fuzz_settings(examples: int) -> Any:
    """Bounded, without deadline; the same cases every run (a fuzz finding is a failing test, never a flaky
    one) unless PHALANX_FUZZ_RANDOM=1 asks for new ones."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=os.environ.get("PHALANX_FUZZ_RANDOM") != "1",
        suppress_health_check=list(HealthCheck),
    )


RPCS = [method.name for method in pb.DESCRIPTOR.services_by_name["Master"].methods]


@pytest.mark.parametrize("rpc", RPCS)
def test_grpc_messages_never_break_the_master(master: Master, rpc: str) -> None:
    method = pb.DESCRIPTOR.services_by_name["Master"].methods_by_name[rpc]
    call = getattr(master.stub, rpc)
    known = master.known  # type: ignore[attr-defined]
    codes: Counter[str] = Counter()

    @fuzz_settings(GRPC_EXAMPLES)
    @given(request=message(method.input_type, known))
    def fuzz(request: Any) -> None:
        CASES[f"grpc.{rpc}"] += 1
        try:
            call(request, metadata=AUTH, timeout=10)
            codes["OK"] += 1
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            codes[code.name] += 1
            if code in BROKEN:
                pytest.fail(f"{rpc} answered {code.name}: {exc.details()} for {request}")  # type: ignore[attr-defined]

    fuzz()
    print(f"{rpc}: {dict(codes)}")
    assert sum(codes.values()) == GRPC_EXAMPLES
    assert master.client.get("/healthz").status_code == 200


# ------------------------------------------------------------------------------------------------------
# HTTP: schemathesis from the master's OpenAPI schema


@pytest.fixture(scope="module")
def http_schema(master: Master) -> Any:
    # Unknown query parameters are ignored, as HTTP APIs do; schemathesis would count that as accepting
    # invalid data.
    config = schemathesis.Config.from_dict({"generation": {"allow-extra-parameters": False}})
    return schemathesis.openapi.from_url(
        f"http://{master.http}/openapi.json", headers=BEARER, timeout=10, config=config
    )


# Not schemathesis.pytest.from_fixture: its lazy schema renames pytest's nodes through a private attribute
# that pytest 9 no longer has. The schema's strategies under plain hypothesis do the same.
@pytest.mark.parametrize(
    ("mode", "examples"),
    [(GenerationMode.POSITIVE, HTTP_EXAMPLES), (GenerationMode.NEGATIVE, HTTP_EXAMPLES // 2)],
)
def test_http_api_answers_every_request_without_a_server_error(
    master: Master, http_schema: Any, mode: GenerationMode, examples: int
) -> None:
    statuses: Counter[int] = Counter()

    @fuzz_settings(examples)
    @given(case=http_schema.as_strategy(mode, headers=BEARER))  # the token is never what is fuzzed here
    def fuzz(case: Any) -> None:
        CASES[f"http.{mode.value}"] += 1
        response = case.call_and_validate(base_url=f"http://{master.http}", timeout=10)
        statuses[response.status_code] += 1

    fuzz()
    assert all(status < 500 for status in statuses), statuses


def test_the_master_still_serves_after_the_fuzzing(master: Master, tmp_path: Path) -> None:
    assert master.client.get("/healthz").json()["status"] == "ok"
    fresh = Agent(master, "node-after")
    assert fresh.register().heartbeat_interval_s == pytest.approx(0.2)
    assert master.proc.poll() is None
    assert sum(CASES.values()) >= len(RPCS) * GRPC_EXAMPLES
