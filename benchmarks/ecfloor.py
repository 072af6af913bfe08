"""The floor of an erasure-coded first commit: encode its bytes on all cores and write 1.5x.

What an ``ec:K+M`` commit cannot avoid, whatever its pipeline: erasure-coding every
pack byte and writing the (K+M)/K times as many shard bytes durably, one shard per
location. :func:`ec_floor` does only that, as fast as this machine allows: the bytes
are cut into packs of the store's pack size and staged as files (page cache, not
timed); one worker process per core reads a pack, encodes it (``ErasureCode.encode``:
the same pyeclib code, without casckpt's shard headers and checksums) and writes its
K+M fragments to the K+M location directories, then takes the next pack, while this
process fsyncs the fragments written (one thread per fragment: fsync releases the
GIL). So encoding on every core overlaps with the disk's writes, and the clock runs
from the first pack handed over to the last fsync; the workers start, import pyeclib
and encode one pack of zeros before it, so their heaps are warm (a store's encoding
worker is, from its second pack on; its first pack faults in ~4 pack sizes of memory,
docs/perf/erasure2.md).

Workers are ``spawn``ed (no fork of a process holding torch's threads) with the
allocator settings casckpt's encoding workers use (``MALLOC_ENV``), so both pay the
same for their buffers.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casckpt.storage.ecworker import MALLOC_ENV
from casckpt.storage.erasure import ErasureCode


@dataclass(frozen=True)
class Floor:
    """The floor of an ``ec:K+M`` commit of ``pack_bytes`` (see the module docstring)."""

    k: int
    m: int
    workers: int  # processes encoding side by side (the CPUs)
    packs: int
    pack_bytes: int  # bytes encoded
    shard_bytes: int  # bytes written (fragments), ~ (K+M)/K x pack_bytes
    seconds: float


_started: list[Any] = []  # in a worker: the barrier every worker meets before the clock starts


def _join(barrier: Any) -> None:
    _started.append(barrier)


def _ready(k: int, m: int, pack_size: int) -> int:
    """Import pyeclib and encode one pack of zeros (the heap then holds what an encode needs:
    no page faults in the clock), then wait for every other worker: each runs one of these
    at once, so the pool has started all of them before the clock starts."""
    ErasureCode(k, m).encode(bytes(pack_size))
    _started[0].wait(120)
    return os.getpid()


def _encode_and_write(pack: str, k: int, m: int, roots: Sequence[str]) -> list[str]:
    """Encode one staged pack and write fragment ``i`` to ``roots[i]`` (not fsync'd); the
    fragment files."""
    data = Path(pack).read_bytes()
    fragments, _, _ = ErasureCode(k, m).encode(data)
    del data
    name = Path(pack).name
    paths = [os.path.join(roots[i], f"{name}.s{i}") for i in range(len(fragments))]
    for path, fragment in zip(paths, fragments, strict=True):
        with open(path, "wb") as f:
            f.write(fragment)
    return paths


def _fsync(path: str) -> int:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_size


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ec_floor(data: Sequence[memoryview | bytes], pack_size: int, k: int, m: int, workdir: Path,
             workers: int | None = None) -> Floor:
    """Measure the floor of an ``ec:k+m`` commit of the bytes of ``data`` (concatenated, cut
    into packs of ``pack_size``) under ``workdir`` (made, and left with the shard files)."""
    staging = workdir / "staging"
    roots = [workdir / f"loc{i}" for i in range(k + m)]
    for d in (staging, *roots):
        d.mkdir(parents=True, exist_ok=True)
    packs = _stage(data, pack_size, staging)
    total = sum(p.stat().st_size for p in packs)
    count = workers or os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")
    with _environment(MALLOC_ENV), ProcessPoolExecutor(
            count, mp_context=context, initializer=_join, initargs=(context.Barrier(count),)) as pool:
        pids = {f.result() for f in [pool.submit(_ready, k, m, pack_size) for _ in range(count)]}
        if len(pids) != count:
            raise RuntimeError(f"{len(pids)} of {count} floor workers started before the clock")
        with ThreadPoolExecutor(k + m) as io:
            start = time.perf_counter()
            encoded = [pool.submit(_encode_and_write, str(p), k, m, [str(r) for r in roots])
                       for p in packs]
            syncs = [io.submit(_fsync, path) for f in as_completed(encoded) for path in f.result()]
            written = sum(f.result() for f in syncs)
            seconds = time.perf_counter() - start
    for p in packs:
        p.unlink()
    return Floor(k, m, count, len(packs), total, written, seconds)


def _stage(data: Sequence[memoryview | bytes], pack_size: int, staging: Path) -> list[Path]:
    """Write the bytes as files of ``pack_size`` (the last shorter); their paths."""
    packs: list[Path] = []
    out = None
    filled = 0
    try:
        for buf in data:
            view = memoryview(buf).cast("B")
            while view:
                if out is None or filled == pack_size:
                    if out is not None:
                        out.close()
                    packs.append(staging / f"pack{len(packs):04d}")
                    out, filled = open(packs[-1], "wb"), 0  # noqa: SIM115 - closed above or below
                n = min(len(view), pack_size - filled)
                out.write(view[:n])
                view, filled = view[n:], filled + n
    finally:
        if out is not None:
            out.close()
    return packs
