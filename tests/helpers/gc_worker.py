"""Processes for the GC concurrency and crash tests (tests/engine/maintenance/test_gc_processes.py).

    python gc_worker.py writer STORE CACHE WRITER COMMITS STOP_FILE DONE_FILE
    python gc_worker.py collector STORE STOP_FILE COUNT_FILE
    python gc_worker.py killed-gc STORE POINT N

``writer`` commits COMMITS versions of run ``w<WRITER>``; version i reuses the
content of version i-4, which it deleted two commits earlier (so its commits
keep hitting chunks a concurrent GC has just condemned or swept). Each step it
keeps visible is appended to DONE_FILE only after ``commit`` returned.

``collector`` runs ``gc(grace=0)`` in a loop until STOP_FILE exists, then
writes how many runs it completed to COUNT_FILE.

``killed-gc`` runs one ``gc(grace=0)`` that SIGKILLs itself on the N-th call
of the protocol step POINT (exit status 3 if that call never happens).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import casckpt
from casckpt.catalog import gc as sql
from casckpt.storage.local import LocalBlobStore

CHUNK = 4096


def content(writer: int, i: int) -> dict[str, torch.Tensor]:
    """Version i of a writer: a cycle of 4 contents, plus one tensor all writers share."""
    def noise(*seed: int, n: int = 6000) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(hash(seed) % (1 << 62)))

    return {"own": noise(1, writer, i % 4), "common": noise(2, i % 3, n=2000)}


def writer(root: str, cache: str, w: int, commits: int, stop: str, done: str) -> None:
    with casckpt.open(root, cache=cache, chunk_size=CHUNK, pack_size=32 << 10, create=False) as store:
        for i in range(commits):
            store.commit(content(w, i), run=f"w{w}", step=i)
            with open(done, "a") as f:
                f.write(f"+{i}\n")
            if i >= 2:
                store.delete(f"w{w}@{i - 2}")
                with open(done, "a") as f:
                    f.write(f"-{i - 2}\n")


def collector(root: str, stop: str, count_file: str) -> None:
    runs = 0
    with casckpt.open(root, create=False) as store:
        while not Path(stop).exists():
            store.gc(grace=0)
            runs += 1
    Path(count_file).write_text(str(runs))


_POINTS: dict[str, tuple[Any, str]] = {
    "purge": (sql, "purge_versions"),
    "mark": (sql, "add_live"),
    "condemn": (sql, "condemn"),
    "sweep": (sql, "sweep"),
    "relocate": (sql, "relocate"),
    "delete-object": (LocalBlobStore, "delete"),
}


def killed_gc(root: str, point: str, n: int) -> None:
    owner, name = _POINTS[point]
    real = getattr(owner, name)
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = real(*args, **kwargs)
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapped)
    with casckpt.open(root, create=False) as store:
        store.gc(grace=0)
    sys.exit(3)  # the kill point was never reached


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "writer":
        writer(args[0], args[1], int(args[2]), int(args[3]), args[4], args[5])
    elif mode == "collector":
        collector(args[0], args[1], args[2])
    else:
        killed_gc(args[0], args[1], int(args[2]))
