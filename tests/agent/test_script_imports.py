"""Warm spares import what the previous incarnation of the script imported (phalanx.agent.script_imports).

The selection and the list's parsing are pure and tested on their own; the rest runs real bootstraps
(spare -> worker) with a library module written into a directory on the workers' PYTHONPATH. That module
appends its importer's pid to a marker file, so the test sees which process imported it, and when."""

from __future__ import annotations

import dataclasses
import os
import textwrap
import types
from pathlib import Path

import pytest

from phalanx.agent import config as agent_config
from phalanx.agent import script_imports, workers
from phalanx.agent.env import WorkerPaths
from phalanx.agent.pool import WorkerPool
from phalanx.api import beacon
from phalanx.api.round import RoundInfo
from tests.eventually import eventually

LIB_MODULE = "phalanx_test_lib_b31"
SECOND_MODULE = "phalanx_test_lib2_b31"


def _module(name: str, file: str | None = None, *, spec: bool = True) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = object() if spec else None  # type: ignore[assignment]
    if file is not None:
        m.__file__ = file
    return m


# ---------------------------------------------------------------------------------------------------------
# pure: what is recorded, what is replayed


def test_select_records_what_the_spare_lacked_in_import_order_without_the_scripts_own_code() -> None:
    modules = {
        "json": _module("json", "/usr/lib/python3/json/__init__.py"),  # the spare had it
        "lib": _module("lib", "/site/lib/__init__.py"),
        "lib.sub": _module("lib.sub", "/site/lib/sub.py"),  # imports lib: lib itself is not listed
        "other": _module("other", "/site/other.py"),
        "helper": _module("helper", "/job/scripts/helper.py"),  # next to the script
        "mine": _module("mine", "/job/scripts/mine/__init__.py"),  # a package next to the script
        "mine.model": _module("mine.model", "/job/scripts/mine/model.py"),
        "venvlib": _module("venvlib", "/job/scripts/.venv/lib/python3.11/site-packages/venvlib.py"),
        "alias": _module("lib.sub", "/site/lib/sub.py"),  # a module under another name
        "dynamic": _module("dynamic", spec=False),  # made at run time: nothing can import it again
        "not_a_module": object(),
        "__main__": _module("__main__", "/job/scripts/train.py"),
        "mypkg.train": _module("mypkg.train", "/site/mypkg/train.py"),
    }
    picked = script_imports.select(
        modules, baseline={"json"}, own_dirs=["/job/scripts"], own_names=["mypkg.train"]
    )
    assert picked == ["lib.sub", "other", "venvlib"]


def test_select_is_bounded() -> None:
    modules = {f"m{i}": _module(f"m{i}", f"/site/m{i}.py") for i in range(20)}
    assert script_imports.select(modules, baseline=set(), limit=5) == ["m0", "m1", "m2", "m3", "m4"]


def test_parse_keeps_dotted_names_only_once_each_and_bounded() -> None:
    text = "\n".join(
        [
            "torch.distributed.elastic",
            "__import__('os').system('touch /tmp/pwned')",  # code is no name
            "a b",
            "1abc",
            "x" * (script_imports.MAX_NAME_CHARS + 1),
            "téléphone",  # non-ASCII identifiers are left out too
            "torch.distributed.elastic",
            " lib.sub ",
            "lib..sub",
        ]
    )
    assert script_imports.parse(text) == ["torch.distributed.elastic", "lib.sub"]
    assert script_imports.parse("a\nb\nc\n", limit=2) == ["a", "b"]


# ---------------------------------------------------------------------------------------------------------
# real bootstraps


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    """A library directory on the workers' path whose modules say who imported them, and when."""
    d = tmp_path / "lib"
    d.mkdir()
    (d / f"{LIB_MODULE}.py").write_text(
        textwrap.dedent("""
            import os, time
            with open(os.environ["MARKER_FILE"], "a") as f:
                f.write(f"start {os.getpid()}\\n")
            time.sleep(float(os.environ.get("IMPORT_SECONDS", "0")))
            with open(os.environ["MARKER_FILE"], "a") as f:
                f.write(f"end {os.getpid()}\\n")
            """)
    )
    (d / f"{SECOND_MODULE}.py").write_text(
        textwrap.dedent("""
            import os
            with open(os.environ["MARKER_FILE"], "a") as f:
                f.write(f"second {os.getpid()}\\n")
            """)
    )
    return d


def _env(tmp: Path, lib: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "MARKER_FILE": str(tmp / "marker"),
        **extra,
    }


def _paths(tmp: Path, name: str) -> WorkerPaths:
    d = tmp / name
    return WorkerPaths(
        beacon=d / "beacon", error_file=d / "error.json", stack_file=d / "stacks.txt",
        regroup_file=d / "regroup.pid", stdout_log=d / "stdout.log", stderr_log=d / "stderr.log",
    )  # fmt: skip


def _script(tmp: Path, name: str, body: str) -> str:
    path = tmp / "scripts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return str(path)


def _spare(script: str, env: dict[str, str], imports: Path, tmp: Path) -> workers.Worker:
    spec = workers.LaunchSpec(script=script, script_args=[], preimport="json")
    ready = tmp / "ready" / f"{len(list(tmp.glob('ready/*')))}.ready"
    return workers.spawn(
        spec, local_rank=0, env=env, cwd=str(tmp), max_line_bytes=500, ready_file=ready, imports_file=imports
    )


def _marks(tmp: Path) -> list[str]:
    marker = tmp / "marker"
    return marker.read_text().splitlines() if marker.exists() else []


def _listing(imports: Path, name: str) -> list[str]:
    """The recorded list once it names ``name``; empty before."""
    names = script_imports.read(imports) or []
    return names if name in names else []


def _idle_threads(pid: int) -> list[int]:
    """The process' threads under SCHED_IDLE (the policy is field 41 of /proc/<pid>/task/<tid>/stat)."""
    idle = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        if int(fields[41 - 3]) == os.SCHED_IDLE:
            idle.append(int(task.name))
    return idle


def _hand_over(w: workers.Worker, tmp: Path, name: str, **env: str) -> list[str]:
    lines: list[str] = []
    w.hand_over(env=env, paths=_paths(tmp, name), rank=0, sink=lambda r, lr, s, t: lines.append(t))
    return lines


@pytest.mark.integration
def test_the_next_spare_imports_what_the_first_incarnation_imported_before_its_worker_starts(
    tmp_path: Path, lib: Path
) -> None:
    imports = tmp_path / "run" / "imports" / "0.txt"
    env = _env(tmp_path, lib)
    # The agent's working directory is not on the script's path: a module of that name there is not the one.
    (tmp_path / f"{LIB_MODULE}.py").write_text(
        "raise ImportError('the working directory is not on the path')\n"
    )
    # Incarnation 1: a spare with no list yet (nothing to replay), then a script that imports the library
    # and a helper module of its own, and reports its first step.
    _script(tmp_path, "helper_b31.py", "HELPER = 1\n")
    first = _spare(
        _script(
            tmp_path,
            "train.py",
            f"""
            import time
            import helper_b31, {LIB_MODULE}
            from phalanx import report_step
            report_step(0)
            time.sleep(60)
            """,
        ),
        env,
        imports,
        tmp_path,
    )
    eventually(first.ready, timeout=20, what="the first spare ready")
    assert _marks(tmp_path) == []  # no previous incarnation: the spare imported nothing of the script's
    beacon_file = tmp_path / "shm" / "0.beacon"
    beacon.create(beacon_file)
    _hand_over(first, tmp_path, "first", **{beacon.ENV_VAR: str(beacon_file)})
    recorded = eventually(
        lambda: _listing(imports, LIB_MODULE),
        timeout=20,
        what="the first incarnation's imports recorded after its first step",
    )
    assert "helper_b31" not in recorded  # the script's own code is never imported ahead of its round
    assert "json" not in recorded  # the spare had it already
    workers.stop([first], grace_period_s=1.0)

    # Incarnation 2: its spare imports the library once ready, at idle priority, before any hand-over.
    second = _spare(
        _script(tmp_path, "check.py", f"import sys\nprint('preimported', {LIB_MODULE!r} in sys.modules)\n"),
        env,
        imports,
        tmp_path,
    )
    eventually(lambda: f"end {second.pid}" in _marks(tmp_path), timeout=20, what="the spare's replay")
    assert _idle_threads(second.pid), "the replay runs on a SCHED_IDLE thread"
    assert os.sched_getscheduler(second.pid) != os.SCHED_IDLE  # the spare's main thread keeps its priority
    lines = _hand_over(second, tmp_path, "second")
    assert second.proc.wait(20) == 0, second.tail
    second.close_logs()
    assert "preimported True" in lines
    assert _marks(tmp_path).count(f"start {second.pid}") == 1  # imported once, by the spare


@pytest.mark.integration
def test_a_bogus_name_in_the_list_is_skipped_and_logged_once_without_ending_the_spare(
    tmp_path: Path, lib: Path
) -> None:
    imports = tmp_path / "imports" / "0.txt"
    imports.parent.mkdir()
    pwned = tmp_path / "pwned"
    imports.write_text(
        f"no_such_module_b31\n__import__('os').system('touch {pwned}')\nos;import sys\n{LIB_MODULE}\n"
    )
    spare = _spare(_script(tmp_path, "ok.py", "print('trained')\n"), _env(tmp_path, lib), imports, tmp_path)
    eventually(lambda: f"end {spare.pid}" in _marks(tmp_path), timeout=20, what="the valid name imported")
    assert spare.proc.poll() is None
    lines = _hand_over(spare, tmp_path, "w")
    assert spare.proc.wait(20) == 0, spare.tail
    spare.close_logs()
    assert "trained" in lines
    complaints = [t for t in lines if "could not import" in t]
    assert len(complaints) == 1, lines
    assert "no_such_module_b31 (ModuleNotFoundError)" in complaints[0]
    assert not pwned.exists()


@pytest.mark.integration
def test_a_spare_handed_its_round_mid_import_runs_the_script_once_the_import_finished(
    tmp_path: Path, lib: Path
) -> None:
    imports = tmp_path / "imports" / "0.txt"
    imports.parent.mkdir()
    imports.write_text(f"{LIB_MODULE}\n{SECOND_MODULE}\n")
    spare = _spare(
        _script(
            tmp_path,
            "use.py",
            f"import {LIB_MODULE}, sys\nprint('imported', {LIB_MODULE!r} in sys.modules)\n",
        ),
        _env(tmp_path, lib, IMPORT_SECONDS="1.5"),
        imports,
        tmp_path,
    )
    eventually(lambda: f"start {spare.pid}" in _marks(tmp_path), timeout=20, what="the replay under way")
    lines = _hand_over(spare, tmp_path, "w")
    assert f"end {spare.pid}" not in _marks(tmp_path)  # handed over mid-import
    assert spare.proc.wait(20) == 0, spare.tail
    spare.close_logs()
    assert "imported True" in lines
    # The import in flight finished once, and was not redone; the next on the list never started (the
    # script did not need it).
    assert _marks(tmp_path) == [f"start {spare.pid}", f"end {spare.pid}"]


@pytest.mark.integration
def test_the_pool_hands_each_local_rank_its_list_and_a_new_run_starts_without_one(
    tmp_path: Path, lib: Path
) -> None:
    script = _script(
        tmp_path,
        "train.py",
        f"import time, {LIB_MODULE}\nfrom phalanx import report_step\nreport_step(0)\ntime.sleep(60)\n",
    )
    cfg = agent_config.parse(
        ["--standalone", "--nproc-per-node", "1", "--rdzv-id", f"b31-{os.getpid()}", script], {}
    )
    run = tmp_path / "run"

    def new_pool() -> WorkerPool:
        pool = WorkerPool(cfg, base_env=_env(tmp_path, lib), log_dir=run, sink=lambda *a: None, say=print)
        # The wiring is what is tested here; importing torch in every spare would cost seconds.
        pool.spec = dataclasses.replace(pool.spec, preimport="json")
        return pool

    pool = new_pool()
    try:
        pool.fill_spares()
        pool.start(
            RoundInfo(round=1, group_rank=0, rank_offset=0, world_size=1, local_world_size=1,
                      store_host="127.0.0.1", store_port=1)
        )  # fmt: skip
        eventually(lambda: _listing(run / "imports" / "0.txt", LIB_MODULE), timeout=20, what="the list")
        pool.fill_spares()  # the next incarnation's spare
        spare = pool.spares[0]
        eventually(lambda: f"end {spare.pid}" in _marks(tmp_path), timeout=20, what="the new spare's replay")
    finally:
        pool.stop()
        spares = list(pool.spares.values())
        pool.discard_spares()
        for s in spares:
            s.proc.wait(5)
        pool.close_rings()
        for path in pool.shm_files():
            path.unlink(missing_ok=True)
    new_pool()
    assert not (run / "imports" / "0.txt").exists()  # another run of the agent: another script, maybe
