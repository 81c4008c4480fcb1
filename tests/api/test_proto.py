"""The wire contract: every message round-trips, and the proto follows the house rules."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError, Message

from phalanx.api.v1 import master_pb2, master_pb2_grpc

FILE = master_pb2.DESCRIPTOR
MESSAGES = sorted(FILE.message_types_by_name)
FD = _descriptor.FieldDescriptor


def _value(field: Any, depth: int) -> Any:
    """A non-default value for a scalar field, derived from the field number so each field differs."""
    n = field.number
    if field.type == FD.TYPE_STRING:
        return f"{field.name}-{n}-é"
    if field.type == FD.TYPE_BOOL:
        return True
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return n + 0.5
    if field.type == FD.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return -(2**40) - n
    return -n - depth  # int32 and friends


def populate(message: Message, depth: int = 0) -> Message:
    """Sets every field of `message` (recursing into messages) to a non-default value."""
    for field in message.DESCRIPTOR.fields:
        repeated = field.is_repeated
        entry = field.message_type if field.type == FD.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:  # a map: two entries
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for i in range(2):
                k = _value(key, depth)
                k = f"{k}{i}" if isinstance(k, str) else k - i
                getattr(message, field.name)[k] = _value(value, depth + i)
        elif field.type == FD.TYPE_MESSAGE:
            if repeated:
                for _ in range(2):
                    populate(getattr(message, field.name).add(), depth + 1)
            else:
                populate(getattr(message, field.name), depth + 1)
        elif repeated:
            getattr(message, field.name).extend([_value(field, depth), _value(field, depth + 1)])
        else:
            setattr(message, field.name, _value(field, depth))
    return message


@pytest.mark.parametrize("name", MESSAGES)
def test_every_message_round_trips(name: str) -> None:
    cls = getattr(master_pb2, name)
    original = populate(cls())
    decoded = cls.FromString(original.SerializeToString())
    assert decoded == original
    for field in cls.DESCRIPTOR.fields:  # every field survived, not just the ones equality looked at
        if field.is_repeated:
            assert len(getattr(decoded, field.name)) == 2, field.name
        elif field.type == FD.TYPE_MESSAGE:
            assert decoded.HasField(field.name), field.name
        else:
            assert getattr(decoded, field.name) == getattr(original, field.name), field.name


def test_enums_start_at_unspecified_zero() -> None:
    assert FILE.enum_types_by_name
    for enum in FILE.enum_types_by_name.values():
        first = enum.values[0]
        assert first.number == 0
        assert first.name.endswith("_UNSPECIFIED"), enum.name
        prefix = first.name.removesuffix("UNSPECIFIED")
        assert all(v.name.startswith(prefix) for v in enum.values), enum.name


def test_one_request_response_pair_per_rpc() -> None:
    service = FILE.services_by_name["Master"]
    seen_inputs: set[str] = set()
    for method in service.methods:
        if method.client_streaming:  # a stream carries the messages of the call it streams
            assert method.server_streaming
            assert method.name.endswith("Stream")
            assert method.input_type.name == f"{method.name.removesuffix('Stream')}Request"
            assert method.output_type.name == f"{method.name.removesuffix('Stream')}Response"
            continue
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"
        assert method.input_type.name not in seen_inputs
        seen_inputs.add(method.input_type.name)
    expected = {
        "RegisterNode", "Heartbeat", "HeartbeatStream", "JoinRendezvous", "GetRendezvous", "ReportFailure",
        "ReportCompletion", "ReportLogs", "ReportProbe", "ReportCheckpoint", "ReportStacks",
    }  # fmt: skip
    assert {m.name for m in service.methods} == expected
    assert hasattr(master_pb2_grpc, "MasterStub")
    assert hasattr(master_pb2_grpc, "add_MasterServicer_to_server")


def test_garbage_bytes_are_rejected_not_misread() -> None:
    with pytest.raises(DecodeError):
        master_pb2.HeartbeatRequest.FromString(b"\xff\xff\xff\xff")


def test_unknown_fields_from_a_newer_peer_are_kept() -> None:
    newer = master_pb2.HeartbeatRequest(node_id="n0").SerializeToString() + b"\xa0\x06\x01"  # field 100 = 1
    message = master_pb2.HeartbeatRequest.FromString(newer)
    assert message.node_id == "n0"
    assert message.SerializeToString() == newer
