"""Stack comparison for hang verdicts."""

from __future__ import annotations

from phalanx.diagnostics.stacks import compare_stacks, signature

ALLREDUCE = """Thread 0x01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
Current thread 0x02 (most recent call first):
  File "/site/torch/distributed/c10d.py", line 2050 in all_reduce
  File "/job/train.py", line {line} in step
  File "/job/train.py", line 200 in main
"""

LOADER = """Current thread 0x02 (most recent call first):
  File "/site/loader.py", line 90 in next_batch
  File "/job/train.py", line 40 in step
  File "/job/train.py", line 200 in main
"""

TRACEBACK_STYLE = """  File "/job/train.py", line 200, in main
    step()
  File "/job/train.py", line 41, in step
    dist.all_reduce(t)
  File "/site/torch/distributed/c10d.py", line 2050, in all_reduce
"""


def test_signature_ignores_line_numbers_and_orders_innermost_last() -> None:
    a = signature(ALLREDUCE.format(line=41))
    assert a == signature(ALLREDUCE.format(line=99))
    assert a == ("train.py:main", "train.py:step", "c10d.py:all_reduce")
    assert signature(TRACEBACK_STYLE) == a


def test_odd_node_is_named() -> None:
    stacks = {
        "n0": {0: ALLREDUCE.format(line=1), 1: ALLREDUCE.format(line=2)},
        "n1": {2: ALLREDUCE.format(line=3), 3: LOADER},
        "n2": {4: ALLREDUCE.format(line=4), 5: ALLREDUCE.format(line=4)},
    }
    v = compare_stacks(stacks, hung_node="n0")
    assert v.odd_nodes == ["n1"]
    assert v.odd_ranks == {3: "n1"}
    assert v.majority[-1] == "c10d.py:all_reduce"
    assert "n1" in v.reason


def test_tie_or_uniform_or_empty_blames_hung_node() -> None:
    tie = {"n0": {0: ALLREDUCE.format(line=1)}, "n1": {1: LOADER}}
    assert compare_stacks(tie, hung_node="n1").odd_nodes == ["n1"]
    same = {"n0": {0: LOADER}, "n1": {1: LOADER}}
    assert compare_stacks(same, hung_node="n0").odd_nodes == ["n0"]
    assert compare_stacks({}, hung_node="n3").odd_nodes == ["n3"]
    assert compare_stacks({}).odd_nodes == []


def test_garbage_never_matches_real_stacks() -> None:
    stacks = {"n0": {0: ALLREDUCE.format(line=1), 1: ALLREDUCE.format(line=1)}, "n1": {2: "garbage \x00"}}
    assert compare_stacks(stacks).odd_nodes == ["n1"]


def test_ranks_started_cold_or_forked_from_the_zygote_match_where_their_script_waits() -> None:
    """A worker forked from the agent's zygote has the zygote's frames below its script, one started cold
    the bootstrap's: the launcher's frames are not part of where a rank waits."""
    script = ALLREDUCE.format(line=41).splitlines()
    cold = "\n".join([*script, '  File "<frozen runpy>", line 291 in run_path',
                       '  File "/venv/phalanx/agent/bootstrap.py", line 130 in run_spare',
                       '  File "/venv/phalanx/agent/bootstrap.py", line 84 in main',
                       '  File "/venv/phalanx/agent/bootstrap.py", line 171 in <module>',
                       '  File "<frozen runpy>", line 88 in _run_code'])  # fmt: skip
    forked = "\n".join([*script, '  File "/usr/lib/python3.11/runpy.py", line 291 in run_path',
                         '  File "/venv/phalanx/agent/bootstrap.py", line 130 in run_spare',
                         '  File "/venv/phalanx/agent/zygote.py", line 360 in main',
                         '  File "/venv/phalanx/agent/zygote.py", line 365 in <module>'])  # fmt: skip
    assert signature(cold) == signature(forked) == signature(ALLREDUCE.format(line=41))
    assert compare_stacks({"n0": {0: cold, 1: forked}, "n1": {2: cold, 3: LOADER}}).odd_ranks == {3: "n1"}
