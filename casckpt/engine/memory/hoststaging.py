"""Host staging for background commits: a mirror of the state's tensors, reused across commits.

``Store.commit(..., block=False)`` copies every tensor of the state into host buffers
on the caller's thread and returns; the worker then hashes, dedups, encodes and writes
from those buffers. The buffers are kept (a *staging set* per run), so a steady series
of commits copies into memory that is already faulted in, at memcpy speed, instead of
allocating (and faulting in) a fresh copy each time -- the way DCP's cached staging
keeps a CPU copy of each source storage.

* Tensors that share a storage (tied weights, views) are staged together: the byte span
  of the storage they use is copied once and each tensor becomes a view of the copy, with
  the same dtype, shape, strides and relative offset, so the commit plans the same
  extents and cuts the same chunks as from the live state.
* A buffer is keyed by the first path of its group, its byte size, dtype and kind; a
  commit whose layout differs reuses the buffers whose key matches and allocates the rest.
* CUDA tensors are copied into page-locked buffers with ``non_blocking`` copies, and the
  caller's thread waits on one event before returning (the state may be mutated then).
* The change hint: a tensor vouched for on the caller's thread (see
  :mod:`casckpt.engine.write.hint`) is not copied when the set's buffer still holds what
  it held (it was copied into this set and vouched for unchanged at every commit since).
* The mirror's views of a buffer are kept with the set and reused while each tensor keeps
  its dtype, shape, strides, offset and conjugate/negative bits, so a group not copied
  costs a lookup; host copies go by address, pieces under :data:`SMALL` on the caller's
  thread (handing them to the pool cost more than copying them).

A set is *held* from the commit that filled it until the worker has written it; a second
set of a run is made only when the first is still held (the committer admits it within
``commit_memory``). Sets a run is not using may be freed to make room.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from casckpt.format.state import TensorLeaf, decode_state

_ALIGN = 16  # spans start at a multiple of the largest element size, as commit extents do
PIECE = 4 << 20
"""Host copies are made in pieces of this many bytes, spread over the pool's threads with
``memmove`` (which releases the GIL). One large ``torch`` copy splits its work evenly over
OpenMP threads and waits for the slowest: on a busy machine that was 5x slower."""

SMALL = 256 << 10
"""Pieces smaller than this are copied on the caller's thread."""

Piece = tuple[int, int, int]  # destination address, source address, bytes

Key = tuple[str, int, str, str]  # first path, bytes, dtype, "torch" / "numpy" / "cuda"


@dataclass(slots=True)
class _Group:
    key: Key
    leaves: list[int]  # indices into the state's leaves
    start: int  # byte offset of the span in its source storage
    anchor: torch.Tensor | np.ndarray  # a tensor viewing the largest storage, or the array

    def device_bytes(self, anchor: torch.Tensor) -> torch.Tensor:
        """The span's bytes on a device other than the host (a uint8 tensor), to copy from;
        host spans are copied by address."""
        return _storage_bytes(anchor)[self.start:self.start + self.key[1]]


@dataclass(slots=True)
class Layout:
    """How one state maps onto staging buffers: groups of leaves by source storage."""

    groups: list[_Group]
    nbytes: int


def _span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.is_contiguous():
        return start, start + int(t.numel()) * size
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def layout(leaves: list[TensorLeaf]) -> Layout:
    """Group ``leaves`` by the storage they view (as the commit's extent planner does)."""
    by_storage: dict[tuple[torch.device, int], list[int]] = {}
    groups: list[_Group] = []
    for i, leaf in enumerate(leaves):
        value = leaf.value
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            groups.append(_Group((leaf.path, array.nbytes, str(array.dtype), "numpy"), [i], 0, array))
        else:
            by_storage.setdefault((value.device, value.untyped_storage().data_ptr()), []).append(i)
    for members in by_storage.values():
        tensors = [cast(torch.Tensor, leaves[i].value) for i in members]  # numpy leaves are grouped above
        if len(tensors) == 1:
            anchor = tensors[0]
            start, end = _span(anchor)
        else:
            spans = [_span(t) for t in tensors]
            start, end = min(s for s, _ in spans), max(e for _, e in spans)
            # from_numpy views of one array may hold separate storages of different sizes: the largest
            anchor = max(tensors, key=lambda t: t.untyped_storage().nbytes())
        start -= start % _ALIGN
        end = max(end, start)
        kind = "cuda" if anchor.device.type == "cuda" else "torch"
        groups.append(_Group((leaves[members[0]].path, end - start, str(anchor.dtype), kind), members,
                             start, anchor))
    return Layout(groups, sum(g.key[1] for g in groups))


_ids = itertools.count()

Geometry = tuple[Any, ...]  # what a view of a staging buffer is made from (see _geometry)
_Views = tuple[int, list[str], list[Geometry], list[torch.Tensor | np.ndarray]]  # start, paths, ...


@dataclass(eq=False, slots=True)
class StagingSet:
    """The buffers of one run's staged state; held while a commit of it is pending."""

    run: str
    buffers: dict[Key, torch.Tensor] = field(default_factory=dict)
    views: dict[Key, _Views] = field(default_factory=dict)
    """The mirror's tensors of each buffer as last made: a group whose tensors have the same
    paths and geometry again views its buffer as it did, so they are reused."""
    held: bool = False
    ident: int = field(default_factory=lambda: next(_ids))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


@dataclass(slots=True)
class Staged:
    """One commit's staged state: ``mirror`` (the state, each tensor a view of the staging
    set), the set that holds it, and the bytes copied (vouched tensors are not)."""

    mirror: object
    held: StagingSet
    copied: int
    skipped: set[str] = field(default_factory=set)  # paths of the vouched tensors not copied


class HostStaging:
    """The staging sets of one committer, and which buffers still match the live tensors.
    Not thread-safe: the committer calls it under its lock (allocation, release) and from the
    one submitting thread (copies)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # its own: never queued behind a commit's hashing
        self.sets: list[StagingSet] = []
        self._fresh: dict[str, dict[Key, set[int]]] = {}  # run -> key -> sets matching the live bytes

    @property
    def allocated(self) -> int:
        """Bytes of every staging set, held or not."""
        return sum(s.nbytes for s in self.sets)

    def idle(self, run: str) -> StagingSet | None:
        """A set of ``run`` no commit holds (the one most used first), if any."""
        return next((s for s in self.sets if s.run == run and not s.held), None)

    def growth(self, found: StagingSet | None, plan: Layout) -> int:
        """Bytes more the staging would hold once ``plan`` is staged into ``found`` (None: a new set)."""
        return plan.nbytes - (found.nbytes if found is not None else 0)

    def free_idle(self, keep: StagingSet | None) -> int:
        """Free every set no commit holds except ``keep``; the bytes freed."""
        freed = [s for s in self.sets if not s.held and s is not keep]
        self.sets = [s for s in self.sets if s not in freed]
        for s in freed:
            for run_fresh in self._fresh.values():
                for sets in run_fresh.values():
                    sets.discard(s.ident)
        return sum(s.nbytes for s in freed)

    def hold(self, found: StagingSet | None, run: str) -> StagingSet:
        """Hold ``found``, or a new set of ``run``."""
        if found is None:
            found = StagingSet(run)
            self.sets.append(found)
        found.held = True
        return found

    def release(self, staged: StagingSet) -> None:
        staged.held = False

    def close(self) -> None:
        """Free every set and stop the copying threads."""
        self.sets = []
        self._fresh.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def forget(self, run: str) -> None:
        """No buffer of ``run`` matches its live tensors any more (a commit of the run went
        another way, or failed before its copies were all made)."""
        self._fresh.pop(run, None)

    def stage(self, target: StagingSet, root: Any, leaves: list[TensorLeaf], plan: Layout,
              vouched: Callable[[str], bool]) -> Staged:
        """Copy ``plan``'s groups into ``target`` (a group all of whose tensors ``vouched``
        holds is skipped when ``target``'s buffer still holds its bytes) and build the mirror."""
        fresh = self._fresh.setdefault(target.run, {})
        wanted = {g.key for g in plan.groups}
        for key in [k for k in target.buffers if k not in wanted]:
            del target.buffers[key]
            target.views.pop(key, None)
        mirrors: list[torch.Tensor | np.ndarray | None] = [None] * len(leaves)
        copied, events, skipped = 0, [], set[str]()
        pieces: list[Piece] = []  # the host copies
        for group in plan.groups:
            buffer = target.buffers.get(group.key)
            paths = [leaves[i].path for i in group.leaves]
            kept = all(vouched(path) for path in paths)
            if buffer is None:
                pinned = group.key[3] == "cuda" and torch.cuda.is_available()
                buffer = torch.empty(group.key[1], dtype=torch.uint8, pin_memory=pinned)
                target.buffers[group.key] = buffer
                target.views.pop(group.key, None)
                fresh.get(group.key, set()).discard(target.ident)
            made = target.views.get(group.key)
            if made is not None and (made[0] != group.start or made[1] != paths):
                made = None
            shapes = [_geometry(leaves[i].value) for i in group.leaves]
            if kept and target.ident in fresh.get(group.key, ()):
                # vouched since this set was filled: same bytes; its views are reused only if
                # every tensor reads them as it did then (dtype, strides, offset, and the
                # conjugate and negative bits, which a counter does not see)
                skipped.update(paths)
                if made is not None and made[2] == shapes:
                    for i, view in zip(group.leaves, made[3], strict=True):
                        mirrors[i] = view
                    continue
            else:
                anchor = group.anchor
                if isinstance(anchor, np.ndarray):
                    pieces.extend(_pieces(buffer.data_ptr(), anchor.ctypes.data, anchor.nbytes))
                elif anchor.device.type == "cpu":  # the span lies within the anchor's storage
                    pieces.extend(_pieces(buffer.data_ptr(), anchor.untyped_storage().data_ptr()
                                          + group.start, group.key[1]))
                elif anchor.device.type == "cuda":
                    buffer.copy_(group.device_bytes(anchor), non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(torch.cuda.current_stream(anchor.device))
                    events.append(event)
                else:
                    buffer.copy_(group.device_bytes(anchor))
                copied += group.key[1]
                fresh[group.key] = (fresh.get(group.key, set()) if kept else set()) | {target.ident}
            if made is not None and made[2] == shapes:  # cheaper to compare than to make again
                views = made[3]
            else:
                views = [_view(leaves[i].value, buffer, group.start) for i in group.leaves]
                target.views[group.key] = (group.start, paths, shapes, views)
            for i, view in zip(group.leaves, views, strict=True):
                mirrors[i] = view
        for key in [k for k in fresh if k not in wanted]:
            del fresh[key]
        large = [piece for piece in pieces if piece[2] >= SMALL]
        if large:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(min(4, os.cpu_count() or 1), "casckpt-stage")
            done = self._pool.map(_memmove, large)  # ``leaves`` keep the sources alive meanwhile
        for piece in pieces:  # small ones here: a hand-off to the pool costs more than the copy
            if piece[2] < SMALL:
                _memmove(piece)
        if large:
            for _ in done:
                pass
        for event in events:
            event.synchronize()  # the copies have landed: the caller may mutate its tensors
        return Staged(decode_state(root, lambda i, _path: mirrors[i]), target, copied, skipped)


def _pieces(dst: int, src: int, nbytes: int) -> Iterator[Piece]:
    for offset in range(0, nbytes, PIECE):
        yield dst + offset, src + offset, min(PIECE, nbytes - offset)


def _memmove(piece: Piece) -> None:
    ctypes.memmove(*piece)


def _geometry(value: torch.Tensor | np.ndarray) -> Geometry:
    """What :func:`_view` makes a view of a buffer from (the buffer and span start apart)."""
    if isinstance(value, np.ndarray):
        return value.dtype, value.shape
    return (value.dtype, value.shape, value.stride(), value.storage_offset(), value.is_conj(),
            value.is_neg())


def _view(value: torch.Tensor | np.ndarray, buffer: torch.Tensor, start: int) -> torch.Tensor | np.ndarray:
    """``value`` as it reads from ``buffer``, a copy of its storage's bytes from ``start``."""
    if isinstance(value, np.ndarray):
        return buffer.numpy().view(value.dtype).reshape(value.shape)
    offset = int(value.storage_offset()) * value.element_size() - start
    out = torch.empty(0, dtype=value.dtype).set_(
        buffer.untyped_storage(), offset // value.element_size(), value.shape, value.stride())
    if value.is_conj():
        out = out.conj()
    if value.is_neg():
        out = torch._neg_view(out)
    return out

