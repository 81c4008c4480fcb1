"""Health-probe programs; run as ``python -m phalanx.diagnostics.probe``, never imported by the agent.

This is the only diagnostics module that imports torch; :mod:`phalanx.diagnostics.probe_runner` starts it
in a subprocess and reads the one JSON line it prints on stdout::

    {"probe": "matmul" | "allgather", "measurements": [{"peer_node_id", "ok", "elapsed_s", "rate", "error"}]}

``matmul --seconds S [--size N] [--device cpu|cuda]`` multiplies random matrices on every local device
(fp32 on CPU, bf16 on each GPU, timed with CUDA events) and reports TFLOP/s per device. The product of
the last iteration is checked against a float64 checksum (algorithm-based fault tolerance: the column
sums of ``A @ B`` must equal ``colsum(A) @ B``), so a device that computes fast but wrong -- silent data
corruption -- gets ``ok=false``. ``--inject-error`` is a test-only switch that flips the top exponent bit
of one element of the product to exercise that path for real.

``allgather --rank R --world-size W --store HOST:PORT --node-ids a,b,... --bytes B --seconds S
[--backend gloo|nccl] [--pairs] [--timeout-s T]`` meets the other nodes through a TCPStore that rank 0
serves, and measures all-gather bus bandwidth in GB/s (nccl-tests convention: ``B * (n - 1) / t`` for
``B`` bytes per rank and ``n`` ranks). Rank 0 first waits up to ``T`` for everyone and publishes who is
missing, so every rank skips the same dead peers. Without ``--pairs`` the whole group is measured once
(one measurement, empty peer). With ``--pairs`` each ring pair ``(i, i+1 mod W)`` gets its own two-rank
gloo/NCCL group, so a dead or slow node spoils only its own two pairs and the master can tell which node
is at fault; node-disjoint pairs run at the same time (two phases, three for odd ``W``). Every
collective has the timeout ``T``, and a watchdog prints what is known and exits when the whole probe
overruns, so a hung peer yields ``ok=false`` instead of a hang.

Exit code 0 means the result line was printed (it may hold failures); 2 means bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from phalanx.api import auth
from phalanx.diagnostics.probe_runner import Measurement

_SDC_TOLERANCE = 32.0  # multiple of the expected checksum rounding noise; calibration noise is far below it
_MAX_ITERS = 100_000
_print_lock = threading.Lock()
_printed = False


def _emit(kind: str, measurements: Sequence[Measurement]) -> None:
    """Prints the result line once, whichever thread (main or watchdog) gets there first."""
    global _printed
    with _print_lock:
        if _printed:
            return
        _printed = True
        line = json.dumps({"probe": kind, "measurements": [m.as_dict() for m in measurements]})
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:900]


# ------------------------------------------------------------------------------------------------------
# matmul


def checksum_error(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> str:
    """Empty when ``c`` is ``a @ b`` up to rounding, else a sentence saying how it is wrong."""
    if not bool(torch.isfinite(c).all()):
        return "the product holds inf or NaN values"
    n = a.shape[0]
    reference = a.double().sum(dim=0) @ b.double()
    diff = (c.double().sum(dim=0) - reference).abs()
    # Expected noise of a column sum: n output roundings of random sign (sqrt(n) * u_out * |c|) plus
    # fp32 accumulation error that grows with sqrt(n) again. The median of |c| on a sample is the scale
    # because one corrupted element must not inflate its own tolerance.
    u_out = 2.0**-8 if c.dtype == torch.bfloat16 else 2.0**-24
    sample = c.flatten()[:: max(1, c.numel() // 65536)].float().abs()
    scale = float(sample.median()) or 1.0
    tolerance = _SDC_TOLERANCE * math.sqrt(n) * scale * (u_out + math.sqrt(n) * 2.0**-24)
    worst = float(diff.max())
    if worst > tolerance:
        column = int(diff.argmax())
        return (
            f"wrong matmul result: column {column}'s checksum is off by {worst:.3g} "
            f"(tolerance {tolerance:.3g}); the device computes incorrectly (silent data corruption)"
        )
    return ""


def _flip_exponent_bit(c: torch.Tensor) -> None:
    """Test-only fault: flips the top exponent bit of the smallest-magnitude element of row 0."""
    j = int(c[0].abs().argmin())
    if c.dtype == torch.bfloat16:
        bits = c.view(torch.int16)
        bits[0, j] = bits[0, j] ^ (1 << 14)
    else:
        bits = c.view(torch.int32)
        bits[0, j] = bits[0, j] ^ (1 << 30)


def _tflops(size: int, iters: int, seconds: float) -> float:
    return 2.0 * size**3 * iters / max(seconds, 1e-9) / 1e12


def _matmul_cpu(*, size: int, seconds: float, inject: bool) -> list[Measurement]:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    c = torch.empty(size, size)
    torch.matmul(a, b, out=c)  # warm-up: thread pool and kernel selection
    iters, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b, out=c)
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds or iters >= _MAX_ITERS:
            break
    if inject:
        _flip_exponent_bit(c)
    error = checksum_error(a, b, c)
    return [Measurement(ok=not error, elapsed_s=elapsed, rate=_tflops(size, iters, elapsed), error=error)]


def _matmul_cuda(*, size: int, seconds: float, inject: bool) -> list[Measurement]:
    if not torch.cuda.is_available():
        return [Measurement(ok=False, error="CUDA is not available on this node")]
    count = torch.cuda.device_count()
    state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
    results: dict[int, Measurement] = {}
    for d in range(count):
        try:
            with torch.cuda.device(d):
                gen = torch.Generator(device=f"cuda:{d}").manual_seed(d)
                a = torch.randn(size, size, device=f"cuda:{d}", generator=gen).bfloat16()
                b = torch.randn(size, size, device=f"cuda:{d}", generator=gen).bfloat16()
                c = torch.empty_like(a)
                torch.matmul(a, b, out=c)  # warm-up: cuBLAS handle and kernel choice
                torch.cuda.synchronize(d)
                t0 = time.perf_counter()
                torch.matmul(a, b, out=c)
                torch.cuda.synchronize(d)
                one = time.perf_counter() - t0
                iters = max(1, min(_MAX_ITERS, int(seconds / max(one, 1e-6))))
                state[d] = (a, b, c, iters)
        except RuntimeError as exc:
            results[d] = Measurement(ok=False, error=f"cuda:{d}: {_describe(exc)}")
    # Launches are asynchronous, so enqueueing device after device runs them all at once.
    events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    for d, (a, b, c, iters) in state.items():
        try:
            with torch.cuda.device(d):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for _ in range(iters):
                    torch.matmul(a, b, out=c)
                end.record()
                events[d] = (start, end)
        except RuntimeError as exc:
            results[d] = Measurement(ok=False, error=f"cuda:{d}: {_describe(exc)}")
    for d, (start, end) in events.items():
        a, b, c, iters = state[d]
        try:
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1000.0
            if inject:
                _flip_exponent_bit(c)
            error = checksum_error(a, b, c)
            error = f"cuda:{d}: {error}" if error else ""
            rate = _tflops(size, iters, elapsed)
            results[d] = Measurement(ok=not error, elapsed_s=elapsed, rate=rate, error=error)
        except RuntimeError as exc:
            results[d] = Measurement(ok=False, error=f"cuda:{d}: {_describe(exc)}")
    return [results[d] for d in sorted(results)]


def run_matmul(args: argparse.Namespace) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or (8192 if device == "cuda" else 1024)
    try:
        if device == "cuda":
            measurements = _matmul_cuda(size=size, seconds=args.seconds, inject=args.inject_error)
        else:
            measurements = _matmul_cpu(size=size, seconds=args.seconds, inject=args.inject_error)
    except (RuntimeError, MemoryError) as exc:
        measurements = [Measurement(ok=False, error=f"matmul probe failed: {_describe(exc)}")]
    _emit("matmul", measurements)


# ------------------------------------------------------------------------------------------------------
# all-gather


def ring_pairs(world_size: int) -> list[tuple[int, int, int, int]]:
    """``(phase, index, a, b)`` for the ring pairs ``(i, i+1 mod W)``; pairs of one phase share no node."""
    if world_size < 2:
        return []
    if world_size == 2:
        return [(0, 0, 0, 1)]
    pairs = []
    for k in range(world_size):
        phase = 2 if world_size % 2 and k == world_size - 1 else k % 2
        pairs.append((phase, k, k, (k + 1) % world_size))
    return sorted(pairs)


class _Group:
    """A process group of ``size`` ranks built straight on a store, outside torch's default group."""

    def __init__(self, *, store: Any, rank: int, size: int, backend: str, timeout: timedelta) -> None:
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.size = size

    def allgather(self, tensor: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        self.pg.allgather([outputs], [tensor]).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())


def _measure(group: _Group, *, nbytes: int, seconds: float) -> tuple[float, float]:
    """``(elapsed_s, bus GB/s)`` of all-gathers of ``nbytes`` per rank for about ``seconds``."""
    numel = max(1, nbytes // 4)
    tensor = torch.ones(numel, dtype=torch.float32, device=group.device)
    # Zeroed, not empty: the pages are touched here, so the first timed all-gather does not pay their faults.
    outputs = [torch.zeros_like(tensor) for _ in range(group.size)]
    # Warm-up: waits for the peers to arrive and opens the connections. It sends one element, not the
    # whole tensor: on a slow link a full-size warm-up would double the probe's time for nothing (a pair
    # of 16 MiB at 100 Mbit/s takes seconds), and on a fast one the timed loop runs many iterations anyway.
    tiny = tensor[:1]
    group.allgather(tiny, [out[:1] for out in outputs])
    # Every rank must run the same number of collectives, so after each chunk they agree (MIN) on the
    # next chunk, 0 meaning stop; a chunk grows to what fits in the remaining time, so the agreement
    # costs little and the loop ends close to ``seconds``.
    iters, chunk, start = 0, 1, time.perf_counter()
    while chunk:
        for _ in range(chunk):
            group.allgather(tensor, outputs)
        iters += chunk
        elapsed = time.perf_counter() - start
        fits = int((seconds - elapsed) / (elapsed / iters))
        chunk = group.min(max(0, min(chunk * 2, fits, _MAX_ITERS - iters)))
    elapsed = time.perf_counter() - start
    busbw = numel * 4 * (group.size - 1) * iters / max(elapsed, 1e-9) / 1e9
    return elapsed, busbw


def _wait_for_missing(store: Any, *, rank: int, world: int, timeout_s: float) -> list[int]:
    """Ranks that did not show up within ``timeout_s``, as decided by rank 0 for everybody."""
    store.set(f"alive/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"alive/{r}"])]
            if missing:
                time.sleep(0.05)
        store.set("missing", json.dumps(missing))
        return missing
    store.wait(["missing"], timedelta(seconds=2 * timeout_s))
    decided = json.loads(store.get("missing"))
    return [int(r) for r in decided]


def run_allgather(args: argparse.Namespace) -> None:
    node_ids = args.node_ids.split(",")
    world, rank, timeout_s = args.world_size, args.rank, args.timeout_s
    host, _, port = args.store.rpartition(":")
    timeout = timedelta(seconds=timeout_s)
    pairs = [p for p in ring_pairs(world) if rank in p[2:]] if args.pairs else []
    peers = [node_ids[b if a == rank else a] for _, _, a, b in pairs] if args.pairs else [""]
    done: list[Measurement] = []

    def overrun() -> None:
        finished = {m.peer_node_id for m in done}
        late = [
            Measurement(ok=False, error=f"all-gather probe did not finish within {budget:g}s")
            if not peer
            else Measurement(peer_node_id=peer, ok=False, error=f"pair with {peer} did not finish in time")
            for peer in peers
            if peer not in finished
        ]
        try:
            _emit("allgather", [*done, *late])
        finally:
            # The main thread is stuck in a collective or store call; nothing to clean up. Exits even when
            # the result cannot be written (the agent is gone and its pipe with it).
            os._exit(0)

    # Presence wait, every pair's setup and the final hand-over may each take up to the timeout.
    budget = args.seconds + timeout_s * (3 + len(pairs))
    watchdog = threading.Timer(budget, overrun)
    watchdog.daemon = True
    watchdog.start()
    if world < 2:
        _emit("allgather", [Measurement(ok=False, error="an all-gather probe needs at least 2 nodes")])
        return
    try:
        served = TCPStore(
            host, int(port), world, rank == 0, timeout, wait_for_workers=False, multi_tenant=False
        )
        # Every key under the round's secret prefix: a stranger who reaches the port cannot name them.
        key = os.environ.get(auth.STORE_KEY_ENV, "")
        store = PrefixStore(f"{key}/", served) if key else served
    except (RuntimeError, ValueError) as exc:
        fail = f"could not reach the probe store at {args.store}: {_describe(exc)}"
        _emit("allgather", [Measurement(peer_node_id=p, ok=False, error=fail) for p in peers])
        return
    try:
        missing = set(_wait_for_missing(store, rank=rank, world=world, timeout_s=timeout_s))
    except RuntimeError as exc:
        fail = f"the probe group did not form: {_describe(exc)}"
        _emit("allgather", [Measurement(peer_node_id=p, ok=False, error=fail) for p in peers])
        return
    if rank in missing:
        fail = f"{node_ids[rank]} joined the probe group after it closed ({timeout_s:g}s)"
        _emit("allgather", [Measurement(peer_node_id=p, ok=False, error=fail) for p in peers])
        return
    if not args.pairs:
        if missing:
            names = ", ".join(node_ids[r] for r in sorted(missing))
            fail = f"peers did not join the probe group within {timeout_s:g}s: {names}"
            done.append(Measurement(ok=False, error=fail))
        else:
            done.append(_probe_group(store, rank=rank, size=world, args=args, seconds=args.seconds))
    else:
        phases = len({p[0] for p in ring_pairs(world)})
        for _, index, a, b in pairs:
            peer_rank = b if a == rank else a
            peer = node_ids[peer_rank]
            if peer_rank in missing:
                fail = f"{peer} did not join the probe group within {timeout_s:g}s"
                done.append(Measurement(peer_node_id=peer, ok=False, error=fail))
                continue
            sub = PrefixStore(f"pair/{index}/", store)
            result = _probe_group(
                sub, rank=0 if rank == a else 1, size=2, args=args, seconds=args.seconds / phases
            )
            done.append(Measurement(**{**result.as_dict(), "peer_node_id": peer}))
    _finish(store, rank=rank, present=world - len(missing), timeout_s=timeout_s)
    _emit("allgather", done)


def _probe_group(
    store: Any, *, rank: int, size: int, args: argparse.Namespace, seconds: float
) -> Measurement:
    try:
        group = _Group(
            store=store, rank=rank, size=size, backend=args.backend, timeout=timedelta(seconds=args.timeout_s)
        )
        elapsed, busbw = _measure(group, nbytes=args.bytes, seconds=seconds)
    except (RuntimeError, ValueError) as exc:  # gloo reports a dead or late peer as RuntimeError
        return Measurement(ok=False, error=f"all-gather failed: {_describe(exc)}")
    return Measurement(ok=True, elapsed_s=elapsed, rate=busbw)


def _finish(store: Any, *, rank: int, present: int, timeout_s: float) -> None:
    """Keeps rank 0, which serves the store, alive until the others are done with it."""
    try:
        if rank != 0:
            store.add("done", 1)
            return
        deadline = time.monotonic() + timeout_s
        while store.add("done", 0) < present - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:
        pass  # a peer that vanished now has already been measured; the result stands


# ------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m phalanx.diagnostics.probe", description=__doc__)
    sub = parser.add_subparsers(dest="probe", required=True)
    mm = sub.add_parser("matmul", help="matrix multiplication throughput and correctness per device")
    mm.add_argument("--seconds", type=float, default=2.0, help="measuring time per device (s)")
    mm.add_argument("--size", type=int, default=0, help="matrix side; 0: 1024 on CPU, 8192 on GPU")
    mm.add_argument("--device", choices=["cpu", "cuda"], default="", help="default: cuda when available")
    mm.add_argument("--inject-error", action="store_true", help="TEST ONLY: corrupt the product")
    ag = sub.add_parser("allgather", help="all-gather bandwidth within a probe group")
    ag.add_argument("--rank", type=int, required=True)
    ag.add_argument("--world-size", type=int, required=True)
    ag.add_argument("--store", required=True, help="HOST:PORT of the TCPStore rank 0 serves")
    ag.add_argument("--node-ids", required=True, help="comma-separated node ids in rank order")
    ag.add_argument("--bytes", type=int, default=16 << 20, help="bytes each rank contributes")
    ag.add_argument("--seconds", type=float, default=2.0, help="measuring time in all (s)")
    ag.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ag.add_argument("--pairs", action="store_true", help="measure each ring pair (i, i+1) separately")
    ag.add_argument("--timeout-s", type=float, default=30.0, help="timeout of each wait and collective (s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with code 2 on bad arguments, like every argparse program
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if args.probe == "matmul":
        if args.size < 0:
            parser.error("--size cannot be negative")
        run_matmul(args)
        return 0
    names = args.node_ids.split(",")
    if len(names) != args.world_size or not all(names) or not 0 <= args.rank < args.world_size:
        parser.error(f"--node-ids needs {args.world_size} non-empty names and --rank must be in [0, W)")
    if args.timeout_s <= 0 or args.bytes < 4 or ":" not in args.store:
        parser.error("--timeout-s must be positive, --bytes at least 4 and --store HOST:PORT")
    run_allgather(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
