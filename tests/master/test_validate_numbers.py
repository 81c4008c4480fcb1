"""Every float field of every request the master takes, nested ones included, must be finite."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.errors import RequestError
from phalanx.master.serve.validate import validate

FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def float_paths(desc: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()) -> Iterator[tuple[Any, ...]]:
    for field in desc.fields:
        if field.type in FLOATS:
            yield (*prefix, field)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            yield from float_paths(field.message_type, (*prefix, field))


def with_value(desc: Descriptor, path: tuple[FieldDescriptor, ...], value: float) -> Any:
    request = getattr(pb, desc.name)(node_id="n0", incarnation="i")
    target = request
    for field in path[:-1]:
        target = getattr(target, field.name).add() if field.is_repeated else getattr(target, field.name)
    last = path[-1]
    if last.is_repeated:
        getattr(target, last.name).append(value)
    else:
        setattr(target, last.name, value)
    return request


REQUESTS = [m.input_type for m in pb.DESCRIPTOR.services_by_name["Master"].methods]
CASES = [(desc, path) for desc in REQUESTS for path in float_paths(desc)]


def test_the_requests_hold_float_fields_to_check() -> None:
    assert len(CASES) >= 7


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_anywhere_in_a_request_is_refused_naming_the_field(value: float) -> None:
    for desc, path in CASES:
        with pytest.raises(RequestError, match=rf"{path[-1].name} must be a finite number"):
            validate(with_value(desc, path, value))
