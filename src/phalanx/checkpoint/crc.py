"""zlib's CRC-32 of a large snapshot on several threads.

Loading verifies every byte, and ``zlib.crc32`` on one thread is far slower than a memory copy: hashing a
large snapshot that way took most of a load from memory (see docs/benchmarks.md). The bytes are cut into
pieces hashed on a thread pool (``zlib.crc32`` releases the GIL on large buffers), and the pieces' checksums
are joined with ``crc32_combine``, so the result is the same CRC-32 that the persister writes into manifests.
"""

from __future__ import annotations

import ctypes
import functools
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


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _zero_bytes_operator(count: int) -> tuple[int, ...]:
    """The linear map that appending ``count`` zero bytes applies to a CRC (zlib's method: square the map
    for one byte, compose the powers that ``count``'s bits select). Cached: a snapshot's pieces share one
    length, so the Python fallback pays the squarings once per length, not once per piece."""
    power = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # two, four, eight zero bits: one zero byte
        power = _gf2_square(power)
    result = [1 << n for n in range(32)]  # identity
    while count > 0:
        if count & 1:
            result = [_gf2_times(power, column) for column in result]
        count >>= 1
        if count:
            power = _gf2_square(power)
    return tuple(result)


def combine_python(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine``: the CRC-32 of A + B from crc(A), crc(B) and len(B); appending zero bytes is
    a linear map of a CRC."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zero_bytes_operator(len2), crc1) ^ crc2


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
