"""The recorder's two write paths: ``phalanx._ringwrite`` (C, built at install by hatch_build.py) and
``_PyWriter`` (Python, where no C compiler was at hand). They must write the same ring, word for word, and the
public API (``enable``, ``collective``, ``begin``/``end``, ``report_step``) must behave the same on either."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phalanx
import phalanx.intervals as iv
from phalanx import _ringwrite
from phalanx.api import intervals as ring

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _words(path: Path) -> list[int]:
    data = path.read_bytes()
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _stampless(path: Path, capacity: int) -> list[int]:
    """The ring's words with the two time fields zeroed where set (the writers read the clock themselves)."""
    words = _words(path)
    reader = ring.RingReader(path)
    _, _, _, stamps, ends = reader.field_offsets
    reader.close()
    for base in (stamps, ends):
        for i in range(base, base + capacity):
            words[i] = int(words[i] != 0)
    return words


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 1 << 40)),
        st.tuples(st.just("begin"), st.sampled_from(["all_reduce", "all_gather", "send"])),
        st.tuples(st.just("end"), st.integers(0, 40)),
        st.tuples(st.just("write"), st.integers(-(1 << 62), 1 << 62), st.integers(1, 1 << 62)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, group=st.sampled_from(["dp:0,1", "tp:0-3", "pp:0,4/ch1", "ünïcode:0"]))
def test_both_writers_write_the_same_ring_word_for_word(
    tmp_path_factory: pytest.TempPathFactory, ops: list, group: str
) -> None:  # type: ignore[type-arg]
    """Any mix of step boundaries, collectives begun and ended (late ones after the ring lapped them) and raw
    writes, in a ring of 8 slots: the same words in both rings (times compared as set or not, where the
    writer read the clock; exactly where it was given)."""
    tmp = tmp_path_factory.mktemp("rings")
    paths = {native: tmp / ("c" if native else "py") for native in (True, False)}
    for native, path in paths.items():
        ring.create(path, capacity=8, texts=8)
        rec = iv.Recorder(path, native=native)
        assert rec.native is native
        tokens: list[int] = []
        for op in ops:
            if op[0] == "step":
                rec.writer.step(op[1])
            elif op[0] == "begin":
                tokens.append(rec.begin(op[1], group))
            elif op[0] == "end" and tokens:
                rec.end(tokens[op[1] % len(tokens)])
            elif op[0] == "write":
                tokens.append(rec.writer.write(op[1] & 0xFFFF_FFFF_FFFF, op[1], op[2]))
                rec.writer.end(tokens[-1], op[2] + 1)
        rec.close()
    assert _stampless(paths[True], 8) == _stampless(paths[False], 8)


def test_the_development_install_built_the_c_writer() -> None:
    """`make setup` compiles it (hatch_build.py); a machine of this project's kind has a C compiler. Were it
    not built, the recorder would work, at five times the cost, and nothing else would say so."""
    assert iv._ringwrite is _ringwrite
    assert iv.collective is _ringwrite.collective
    assert Path(_ringwrite.__file__).parent == Path(iv.__file__).parent


def test_the_c_collective_through_the_public_api(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    ring.create(path)
    assert iv.recorder() is None
    with iv.collective("all_reduce", group="dp:0,1") as token:  # off: a no-op
        assert token is None
    rec = iv.enable(path, cuda=False)
    assert rec is not None
    assert rec.native
    try:
        assert phalanx._step_recorder is rec.writer  # report_step calls the C writer directly
        with iv.collective("all_reduce", group="dp:0,1") as first:
            assert isinstance(first, int)
            assert first > 0
        with pytest.raises(ValueError, match="inside"), iv.collective("all_reduce", group="dp:0,1"):
            raise ValueError("inside")  # the block's exception goes through, its interval still ends
        with iv.collective("broadcast", group="tp:0,1", label="tp"):
            pass
        token = iv.begin("all_gather", group="dp:0,1")  # async: the same group's counter
        iv.end(token)
        open_token = iv.begin("send", group="pp:0,1")  # never ended: the rank is in it
        assert open_token is not None
        with pytest.raises(TypeError, match="positional"):
            iv.collective("all_reduce", "dp:0,1")
        with pytest.raises(TypeError, match="unexpected keyword argument 'grp'"):
            iv.collective("all_reduce", grp="dp:0,1")
        with pytest.raises(TypeError, match="str"):
            iv.collective(7, group="dp:0,1")
        phalanx._step_recorder.step(5)
    finally:
        iv.disable()
    with iv.collective("all_reduce", group="dp:0,1") as token:  # off again
        assert token is None
    records = ring.RingReader(path).read().records
    assert [(r.kind, r.name, r.group, r.number) for r in records] == [
        (ring.BEGIN, "all_reduce", "dp:0,1", 1),
        (ring.END, "all_reduce", "dp:0,1", 1),
        (ring.BEGIN, "all_reduce", "dp:0,1", 2),
        (ring.END, "all_reduce", "dp:0,1", 2),
        (ring.BEGIN, "broadcast", "tp:0,1", 1),
        (ring.END, "broadcast", "tp:0,1", 1),
        (ring.BEGIN, "all_gather", "dp:0,1", 3),
        (ring.END, "all_gather", "dp:0,1", 3),
        (ring.BEGIN, "send", "pp:0,1", 1),
        (ring.MARK, "", "", 5),
    ]


def test_a_torch_process_group_is_named_by_its_ranks(tmp_path: Path) -> None:
    """``group=`` a torch process group (None: the default one): the C collective asks ``group_of`` for its
    string, as the Python one does. A real one-rank gloo group, in a process of its own."""
    path = tmp_path / "ring"
    ring.create(path)
    code = f"""
        import torch.distributed as dist
        import phalanx.intervals as iv
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        assert iv.enable({str(path)!r}, cuda=False).native
        with iv.collective("barrier"):
            dist.barrier()
        with iv.collective("all_reduce", group=dist.new_group([0]), label="dp"):
            pass
        iv.disable()
        dist.destroy_process_group()
        """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=60)
    records = ring.RingReader(path).read().records
    assert [(r.kind, r.name, r.group) for r in records if r.kind == ring.BEGIN] == [
        (ring.BEGIN, "barrier", "pg:0"),
        (ring.BEGIN, "all_reduce", "dp:0"),
    ]


def test_a_closed_recorder_lets_its_ring_go_and_late_writes_do_nothing(tmp_path: Path) -> None:
    """The C writer holds the ring's mapping; closing the recorder releases it (else the mapping could not
    close), and a block begun before it closed ends without writing (and without crashing)."""
    path = tmp_path / "ring"
    ring.create(path, capacity=8)
    rec = iv.enable(path, cuda=False)
    assert rec is not None
    span = iv.collective("all_reduce", group="dp:0,1")
    token = span.__enter__()
    writer = rec.writer
    iv.disable()  # closes the ring: no BufferError
    span.__exit__(None, None, None)
    writer.step(9)
    writer.end_now(token)
    assert writer.write(1, 2, 3) == 0
    assert writer.begin("broadcast", "never:0") == 0  # a channel it never encoded: nothing to encode with
    (begun,) = ring.RingReader(path).read().records
    assert (begun.kind, begun.name) == (ring.BEGIN, "all_reduce")


def test_a_closed_recorder_is_freed() -> None:
    """The C writer is not tracked by the garbage collector and its ``encode`` refers back to the recorder:
    closing lets go of it, else every recorder would live as long as the process."""
    unborn = _ringwrite.Writer.__new__(_ringwrite.Writer)  # never initialised: every call does nothing
    unborn.step(1)
    assert unborn.begin("all_reduce", "dp:0,1") == 0
    unborn.release()

    path = Path("/dev/shm") / f"phalanx-test-ring-freed-{os.getpid()}"
    ring.create(path, capacity=8)
    try:
        rec = iv.Recorder(path, native=True)
        rec.end(rec.begin("all_reduce", "dp:0,1"))
        alive = weakref.ref(rec)
        rec.close()
        del rec
        gc.collect()
        assert alive() is None
    finally:
        path.unlink(missing_ok=True)


def test_a_recorder_attaching_to_a_written_ring_goes_on_after_its_newest_record(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    ring.create(path, capacity=8)
    for native in (True, False, True):
        rec = iv.Recorder(path, native=native)
        rec.writer.step(1)
        rec.close()
    # No gap: the seq a hand-over claims is the C writer's first record's.
    assert [r.index for r in ring.RingReader(path).read().records] == [0, 1, 2]


_SCRIPT = """
    import sys
    if sys.argv[1] == "python":
        sys.modules["phalanx._ringwrite"] = None  # as if built without a C compiler
    import phalanx, phalanx.intervals as iv
    rec = iv.enable()
    assert rec.native is (sys.argv[1] == "c"), rec.native
    assert (iv.collective is iv._Collective) is (sys.argv[1] == "python")
    for step in range(1, 4):
        with iv.collective("all_reduce", group="dp:0,1"):
            pass
        iv.end(iv.begin("all_gather", group="tp:0-3"))
        phalanx.report_step(step)
    iv.begin("send", group="pp:0,1")
    """


def test_without_the_c_writer_the_public_api_writes_the_same_records(tmp_path: Path) -> None:
    from phalanx.api import beacon

    got = {}
    for path_kind in ("c", "python"):
        path, beacon_file = tmp_path / f"ring-{path_kind}", tmp_path / f"beacon-{path_kind}"
        ring.create(path)
        beacon.create(beacon_file)
        env = {**os.environ, ring.ENV_VAR: str(path), beacon.ENV_VAR: str(beacon_file)}
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_SCRIPT), path_kind], env=env, check=True, timeout=60
        )
        got[path_kind] = [
            (r.index, r.kind, r.name, r.group, r.number) for r in ring.RingReader(path).read().records
        ]
        assert beacon.BeaconReader(beacon_file).read().step == 3
    assert got["c"] == got["python"]
    assert len(got["c"]) == 3 * 5 + 1


@pytest.mark.slow
def test_the_wheel_carries_the_c_writer_and_is_pure_python_without_a_compiler(tmp_path: Path) -> None:
    """hatch_build.py, through a real build of the wheel (uv build, hatchling in an isolated environment):
    with a compiler the wheel is tagged for this Python and holds the extension; with none (CC=false) the
    build still succeeds, says why on stderr, and the wheel is pure Python."""
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "hatch_build.py"):
        shutil.copy(ROOT / name, src / name) if src.exists() else (
            src.mkdir(),
            shutil.copy(ROOT / name, src / name),
        )
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    uv = Path(sys.executable).with_name("uv")
    wheels = {}
    for cc in ("", "false"):
        out = tmp_path / f"dist-{cc or 'cc'}"
        env = {**os.environ, "CC": cc} if cc else {k: v for k, v in os.environ.items() if k != "CC"}
        proc = subprocess.run(
            [str(uv), "build", "--wheel", "-p", sys.executable, "--out-dir", str(out), str(src)],
            env=env, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        (wheel,) = out.glob("phalanx-*.whl")
        wheels[cc] = (wheel.name, zipfile.ZipFile(wheel).namelist(), proc.stderr)
    name, files, _ = wheels[""]
    assert "-cp311-cp311-linux_" in name
    assert any(f.startswith("phalanx/_ringwrite.") and f.endswith(".so") for f in files)
    assert "phalanx/_ringwrite.c" not in files
    assert "phalanx/_ringwrite.pyi" in files
    name, files, stderr = wheels["false"]
    assert name.endswith("-py3-none-any.whl")
    assert not any(f.endswith(".so") for f in files)
    assert "not building the C interval writer" in stderr
