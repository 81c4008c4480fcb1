"""Stack comparison for hang verdicts: which node's workers are stuck somewhere the others are not.

When a job hangs, most ranks usually wait in the same collective (all of them blocked in ``all_reduce``)
while the culprit is somewhere else (a data loader, a deadlock, a rank that crashed its CUDA context).
:func:`compare_stacks` reduces every rank's stack dump to a *signature* (the frames of its main thread,
without line numbers, so two ranks waiting in the same function match even across code versions),
finds the majority signature and names the nodes whose ranks differ from it.

Pure: text in, verdict out. The input is the text the agent sends in ``RankStacks.stacks`` -- Python
stacks of all threads, innermost frame last, in the format of :mod:`faulthandler` or
:func:`traceback.format_stack` (``File "path", line N, in func``). Unparseable dumps get an empty
signature, which never matches a real one.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["StackVerdict", "compare_stacks", "signature"]

# traceback: `File "/x/y.py", line 12, in forward`; faulthandler: `File "/x/y.py", line 12 in forward`
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+,? in (?P<func>\S+)')
_THREAD_HEADER = re.compile(r"^\s*(Thread|Current thread|Stack for thread|--- thread)", re.IGNORECASE)
_MAIN_HINT = re.compile(r"MainThread|Current thread", re.IGNORECASE)

Signature = tuple[str, ...]


@dataclass(frozen=True)
class StackVerdict:
    """Result of comparing the stacks of every rank of a round."""

    odd_nodes: list[str]
    """Nodes with at least one rank off the majority signature, or the hung node when there is no majority."""
    odd_ranks: dict[int, str] = field(default_factory=dict)
    """Global rank -> node of every rank off the majority."""
    majority: Signature = ()
    """The most common signature (innermost frame last)."""
    reason: str = ""
    """One sentence for events and logs."""


def _threads(text: str) -> list[list[str]]:
    """Splits a dump into threads, each a list of lines."""
    threads: list[list[str]] = [[]]
    for line in text.splitlines():
        if _THREAD_HEADER.match(line) and threads[-1]:
            threads.append([])
        threads[-1].append(line)
    return [t for t in threads if t]


_LAUNCHER = re.compile(r"(phalanx/agent/(bootstrap|zygote)\.py|/runpy\.py|<frozen runpy>)$")
"""The frames that start a worker before its script: the bootstrap's, or the agent's zygote's when the worker
was forked from it, and runpy's. Two ranks in the same place of the script match however they started."""


def signature(text: str) -> Signature:
    """The frames of the main thread as ``file-basename:function``, innermost last, from the script's first
    frame on (the launcher's are left out); line numbers dropped."""
    threads = _threads(text)
    if not threads:
        return ()
    main = next((t for t in threads if t and _MAIN_HINT.search(t[0])), threads[0])
    frames = [(m.group("file"), m.group("func")) for line in main if (m := _FRAME.search(line))]
    # faulthandler prints the innermost frame first ("most recent call first"); normalize to innermost last.
    if main and "most recent call first" in main[0]:
        frames.reverse()
    while frames and _LAUNCHER.search(frames[0][0]):
        frames.pop(0)
    return tuple(f"{path.rsplit('/', 1)[-1]}:{func}" for path, func in frames)


def compare_stacks(stacks: Mapping[str, Mapping[int, str]], *, hung_node: str = "") -> StackVerdict:
    """Compares the stacks of all ranks (``node -> rank -> dump``) and names the odd nodes.

    The majority signature is the one most ranks share (a plurality). A node is odd when one of its ranks
    does not share it. When two signatures tie for the most ranks (say two ranks, two stacks), the verdict
    falls back to ``hung_node`` -- the node that detected the hang -- if one is given.
    """
    sigs: dict[int, tuple[str, Signature]] = {}
    for node, ranks in stacks.items():
        for rank, text in ranks.items():
            sigs[rank] = (node, signature(text))
    if not sigs:
        fallback = [hung_node] if hung_node else []
        return StackVerdict(odd_nodes=fallback, reason="no stacks were received")
    counts = Counter(sig for _, sig in sigs.values())
    (majority, top), *rest = counts.most_common()
    if rest and rest[0][1] == top:
        fallback = [hung_node] if hung_node else []
        return StackVerdict(
            odd_nodes=fallback,
            reason=f"{len(counts)} stacks tie among {len(sigs)} ranks"
            + ("; blaming the hung node" if hung_node else ""),
        )
    odd_ranks = {rank: node for rank, (node, sig) in sorted(sigs.items()) if sig != majority}
    odd_nodes = sorted(set(odd_ranks.values()))
    where = majority[-1] if majority else "?"
    if not odd_nodes:
        return StackVerdict(
            odd_nodes=[hung_node] if hung_node else [],
            majority=majority,
            reason=f"all {len(sigs)} ranks share one stack (innermost frame {where})"
            + ("; blaming the hung node" if hung_node else ""),
        )
    return StackVerdict(
        odd_nodes=odd_nodes,
        odd_ranks=odd_ranks,
        majority=majority,
        reason=(
            f"ranks {sorted(odd_ranks)} on {', '.join(odd_nodes)} differ from the {top} of {len(sigs)} "
            f"ranks waiting in {where}"
        ),
    )
