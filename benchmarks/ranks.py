"""Spawned gloo ranks for the ``deepspeed`` and ``megatron`` workloads: launch, time, collect.

Each rank is a fresh ``spawn`` process (no threads or OpenMP pools copied from the benchmark
process) that runs ``target(rank, port, *args)`` and writes ``workdir/rank-N.json``; the
benchmark process waits for all of them (or the first that fails, or the timeout) and reads
the JSON back. :class:`Clock` times one operation on a rank: gc, barrier, wall and CPU time.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.connection
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import measure

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the ranks bind it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(target: Callable[..., None], args: tuple[Any, ...], workdir: Path, ranks: int,
           timeout_s: float, label: str) -> list[dict[str, Any]]:
    """Spawn ``ranks`` processes of ``target(rank, port, *args)``; their ``rank-N.json``, in order."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args), name=f"{label}-rank{rank}")
             for rank in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed: the others would wait in a collective until the timeout
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise RuntimeError(f"{label} ranks exited with codes {codes} (a negative code is the signal "
                           f"that stopped it; {timeout_s:.0f} s allowed); a failed rank's traceback "
                           "is above")
    return [json.loads((workdir / f"rank-{rank}.json").read_text()) for rank in range(ranks)]


class Clock:
    """One rank's timings: ``seconds[key]`` (wall) and ``cpu[key]`` (this process's CPU time)."""

    def __init__(self, barrier: Callable[[], None]) -> None:
        self.barrier = barrier
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, key: str, fn: Callable[[], T]) -> T:
        """``fn`` between a barrier (after a GC on every rank) and the clock stop."""
        measure.release_memory()
        self.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        result = fn()
        self.seconds[key] = time.perf_counter() - start
        self.cpu[key] = time.process_time() - cpu
        return result


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the collector's view (``gc.freeze``).

    Called once a rank has imported its framework and built its state: the GC before each
    timed operation then scans only what was made since (DeepSpeed's and Megatron's object
    graphs made each full collection ~0.4 s, 70% of a small run), for both kinds alike.
    """
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo :func:`freeze_heap` and collect: what was frozen (a finished engine's cycles) can go."""
    gc.unfreeze()
    gc.collect()


def slowest(ranks: list[dict[str, Any]], key: str, field: str = "seconds") -> float:
    """The slowest rank's figure for ``key`` (a collective operation ends with its last rank)."""
    return float(max(r[field][key] for r in ranks))
