"""zlib's CRC-32 of a large snapshot on several threads.

Loading verifies every byte, and one thread of ``zlib.crc32`` runs at ~1.5-3.5 GB/s: 4 GiB of snapshot took
most of a 1.45 s load from memory on an H200's host, ten times the copy. The bytes are cut into pieces
hashed on a thread pool (``zlib.crc32`` releases the GIL on large buffers), and the pieces' checksums are
joined with ``crc32_combine``, so the result is the same CRC-32 that the persister writes into manifests.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

PIECE = 32 << 20  # big enough that a piece's thread hand-off costs nothing, small enough to spread 1 GiB

_POLY = 0xEDB88320  # CRC-32, reflected


Bytes = bytes | bytearray | memoryview


def _libz_combine() -> Callable[[int, int, int], int] | None:
    try:
        libz = ctypes.CDLL("libz.so.1")
    except OSError:
        return None
    fn = libz.crc32_combine
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_longlong]
    return lambda crc1, crc2, len2: int(fn(crc1, crc2, len2))


_COMBINE = _libz_combine()


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def combine_python(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine``: the CRC-32 of A + B from crc(A), crc(B) and len(B) (zlib's algorithm: apply
    len2 zero bytes to crc1 by repeated squaring of the one-zero-bit operator)."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc(A), crc(B) and len(B): zlib's C function when the system has libz (a
    few microseconds), else the same algorithm in Python (a few milliseconds)."""
    if _COMBINE is not None:
        return _COMBINE(crc1, crc2, len2)
    return combine_python(crc1, crc2, len2)


def crc32(parts: Sequence[Bytes], *, threads: int, start: int = 0) -> int:
    """``zlib.crc32`` of the concatenated ``parts``, continuing from ``start``, on up to ``threads``
    threads."""
    pieces = [
        view[offset : offset + PIECE]
        for view in (memoryview(part).cast("B") for part in parts)
        for offset in range(0, len(view), PIECE)
    ]
    if threads <= 1 or len(pieces) <= 1:
        crc = start
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        return crc
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="phalanx-crc") as pool:
        crcs = list(pool.map(zlib.crc32, pieces))
    crc = start
    for piece, piece_crc in zip(pieces, crcs, strict=True):
        crc = combine(crc, piece_crc, len(piece))
    return crc
