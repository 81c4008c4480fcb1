"""The failure classifier: exit code + log tail -> FailureClass."""

from __future__ import annotations

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.classify import FailureClass, classify

TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "ValueError: bad batch",
]


@pytest.mark.parametrize(
    ("code", "tail", "message", "expected"),
    [
        (1, TRACEBACK, "", FailureClass.USER),
        (1, [], "ValueError: bad batch", FailureClass.USER),
        (-9, [], "", FailureClass.KILLED),
        (137, ["step 3"], "", FailureClass.KILLED),
        (-15, [], "", FailureClass.KILLED),
        (1, ["MemoryError"], "", FailureClass.OOM),
        (-9, ["torch.OutOfMemoryError: CUDA out of memory"], "", FailureClass.OOM),
        (
            1,
            [*TRACEBACK[:2], "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"],
            "",
            FailureClass.COMM,
        ),
        (1, ["torch.distributed.DistBackendError: NCCL error in: ..."], "", FailureClass.COMM),
        (1, ["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"], "", FailureClass.HARDWARE),
        (
            1,
            [*TRACEBACK[:2], "RuntimeError: CUDA error: uncorrectable ECC error encountered"],
            "",
            FailureClass.HARDWARE,
        ),
        (2, ["usage: train.py [-h]"], "", FailureClass.UNKNOWN),
        (0, TRACEBACK, "", FailureClass.UNSPECIFIED),
    ],
)
def test_classify(code: int, tail: list[str], message: str, expected: FailureClass) -> None:
    assert classify(exit_code=code, log_tail=tail, error_message=message) is expected


def test_values_match_the_wire_enum() -> None:
    for member in FailureClass:
        assert pb.FailureClass.Name(int(member)) == f"FAILURE_CLASS_{member.name}"
