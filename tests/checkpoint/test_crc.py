"""The multi-threaded CRC-32 is zlib's CRC-32 of the concatenated bytes, however they are cut."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.checkpoint import crc


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.binary(max_size=300), max_size=6),
    threads=st.integers(min_value=1, max_value=4),
    piece=st.integers(min_value=1, max_value=64),
    start=st.integers(min_value=0, max_value=0xFFFFFFFF),
)
def test_equals_zlib_crc32_of_the_concatenation(
    parts: list[bytes], threads: int, piece: int, start: int
) -> None:
    old, crc.PIECE = crc.PIECE, piece  # small pieces: many cuts, inside parts and at their edges
    try:
        got = crc.crc32([memoryview(p) for p in parts], threads=threads, start=start)
    finally:
        crc.PIECE = old
    assert got == zlib.crc32(b"".join(parts), start)


@settings(max_examples=100, deadline=None)
@given(a=st.binary(max_size=200), b=st.binary(max_size=5000))
def test_the_python_combine_matches_zlib(a: bytes, b: bytes) -> None:
    expected = zlib.crc32(a + b)
    assert crc.combine_python(zlib.crc32(a), zlib.crc32(b), len(b)) == expected
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == expected


def test_large_buffers_on_several_threads() -> None:
    data = bytearray(range(256)) * (300_000)  # 76.8 MB: three 32 MiB pieces
    data[12_345_678] ^= 1
    assert crc.crc32([data[:1000], memoryview(data)[1000:]], threads=3) == zlib.crc32(data)


@pytest.mark.skipif(crc._COMBINE is None, reason="no libz.so.1 here: the Python combine is the one in use")
def test_the_libz_binding_takes_lengths_past_4_gib() -> None:
    """A snapshot piece is never that long, but a wrong argument type would truncate the length."""
    for length in (1, 1 << 31, 5 << 30, (1 << 40) + 7):
        assert crc.combine(0x1234_5678, 0x9ABC_DEF0, length) == crc.combine_python(
            0x1234_5678, 0x9ABC_DEF0, length
        )
