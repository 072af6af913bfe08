"""Measuring tools: wall time, peak resident memory, tensor digests, the baselines.

Baselines: torch.save / torch.load, safetensors save_file / load_file (tensors
only) and torch.distributed.checkpoint save / load (FileSystemWriter/Reader, one
process, no process group). Every save is fsync'd before it returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import blake3
import torch
from typing_extensions import Self

from casckpt.format.state import iter_leaves

T = TypeVar("T")

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None


def current_rss() -> int:
    """Resident set size of this process in bytes, from /proc/self/statm."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE_SIZE


class RssSampler:
    """Sample RSS on a thread while the ``with`` body runs; ``peak_extra`` is max - start."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._start = 0
        self._peak = 0

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._peak = max(self._peak, current_rss())

    def __enter__(self) -> Self:
        self._start = self._peak = current_rss()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, current_rss())

    @property
    def peak_extra(self) -> int:
        """Bytes of RSS above the level at entry, at the highest sample."""
        return max(0, self._peak - self._start)


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS, so RSS baselines are clean."""
    gc.collect()
    if _MALLOC_TRIM is not None:  # glibc keeps freed small blocks mapped otherwise
        _MALLOC_TRIM(0)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Run ``fn`` after :func:`release_memory`; return its result and wall seconds."""
    release_memory()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def timed_with_rss(fn: Callable[[], T]) -> tuple[T, float, int]:
    """Like :func:`timed`, also returning the peak extra RSS in bytes."""
    release_memory()
    with RssSampler() as rss:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    return result, seconds, rss.peak_extra


def torch_save_fsync(state: Any, path: Path) -> None:
    """The baseline commit: torch.save to a file, flushed and fsync'd."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: Path) -> Any:
    """The baseline restore."""
    return torch.load(path, weights_only=True)


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """``{dotted_path: tensor}`` of a state: what safetensors can store (tensors only)."""
    return {path: t.detach().contiguous() for path, t in tensor_leaves(state)}


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_save_fsync(state: Any, path: Path) -> None:
    """The safetensors baseline: ``save_file`` of the state's tensors (flattened), then fsync."""
    from safetensors.torch import save_file

    save_file(flat_tensors(state), path)
    _fsync_file(path)


def safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    """``load_file`` with the ``pread`` backend: every byte read into memory.

    The default ``mmap`` backend returns tensors backed by a lazy mapping (the
    data is read on first touch), which would time almost nothing.
    """
    from safetensors.torch import load_file

    return load_file(path, backend="pread")


def dcp_save(state: Any, directory: Path) -> None:
    """The torch.distributed.checkpoint baseline: one process, no process group.

    ``FileSystemWriter`` defaults: one file per rank, ``sync_files=True`` (each
    file fsync'd), one writer thread.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(state, storage_writer=FileSystemWriter(directory), no_dist=True)


def empty_like_tree(tree: Any) -> Any:
    """A copy of a state's containers and plain values, every tensor replaced by ``empty_like``."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: empty_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [empty_like_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(empty_like_tree(v) for v in tree)
    return tree


def dcp_load(template: Any, directory: Path) -> Any:
    """DCP load: allocate a tree shaped like ``template`` and read the checkpoint into it in place.

    DCP cannot build a tree by itself; allocating the target is part of the
    timed restore, as it is for torch.load and casckpt.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    target = empty_like_tree(template)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(target, storage_reader=FileSystemReader(directory), no_dist=True)
    return target


def path_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def remove(path: Path) -> None:
    """Delete a baseline file or directory."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def tensor_leaves(state: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted_path, tensor)`` for every torch tensor of a state."""
    for path, leaf in iter_leaves(state):
        if isinstance(leaf, torch.Tensor):
            yield path, leaf


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's data as a flat byte view (a contiguous copy only if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def blake3_all(views: Sequence[memoryview]) -> bytes:
    """BLAKE3 of all ``views`` on all cores (one hasher, ``max_threads=AUTO``): the floor of a
    verified re-commit, which must hash every byte."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for view in views:
        hasher.update(view)
    return hasher.digest()


def tensor_digests(state: Any) -> dict[str, tuple[int, bytes]]:
    """``{path: (nbytes, BLAKE3 of dtype, shape and data)}`` for every tensor."""
    digests: dict[str, tuple[int, bytes]] = {}
    for path, t in tensor_leaves(state):
        header = f"{t.dtype}{tuple(t.shape)}".encode()
        hasher = blake3.blake3(header, max_threads=blake3.blake3.AUTO)
        hasher.update(raw_bytes(t))
        digests[path] = (t.nbytes, hasher.digest())
    return digests


def changed_bytes(before: dict[str, tuple[int, bytes]], after: dict[str, tuple[int, bytes]]) -> int:
    """Total size of the tensors of ``after`` that are new or whose content differs."""
    return sum(entry[0] for path, entry in after.items() if before.get(path) != entry)


def leaf_equal(a: object, b: object) -> bool:
    """True when two leaves are equal (tensors: same dtype, shape and elements)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def trees_equal(expected: Any, actual: Any) -> bool:
    """True when both trees have the same paths, equal plain values and equal tensors."""
    left = list(iter_leaves(expected))
    right = list(iter_leaves(actual))
    if [p for p, _ in left] != [p for p, _ in right]:
        return False
    return all(leaf_equal(a, b) for (_, a), (_, b) in zip(left, right, strict=True))


def largest_tensor(state: Any) -> tuple[str, torch.Tensor]:
    """The path and value of the biggest tensor (by bytes) of a state."""
    return max(tensor_leaves(state), key=lambda item: item[1].nbytes)


def logical_bytes(state: Any) -> int:
    """Bytes of tensor data in a state."""
    return sum(t.nbytes for _, t in tensor_leaves(state))


def fmt_bytes(n: float) -> str:
    """``n`` bytes for a table: B, KiB, MiB or GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"
