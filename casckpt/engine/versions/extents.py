"""From tensors to extents and back.

:func:`plan_extents` decides which bytes each tensor of a state is stored
as: normally its own contiguous bytes; for tensors that are views of one
storage, one shared extent covering the span they use (written once, restored
shared). :func:`build_tensors` does the inverse from filled extent buffers.
Planning touches no storage: it only makes byte views of the tensors.
"""

from __future__ import annotations

import ctypes
import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from casckpt.errors import UnsupportedStateError
from casckpt.format.chunks import chunk_id
from casckpt.format.dtypes import numpy_dtype, numpy_dtype_name, torch_dtype, torch_dtype_name
from casckpt.format.manifest import TensorEntry
from casckpt.format.state import TensorLeaf

_SPAN_ALIGN = 16  # the largest element size (complex128), so every member stays aligned
SMALL_TENSOR = 16 << 10


def pack_limit(chunk_size: int) -> int:
    """The largest tensor packed with others (``pack`` of :func:`plan_extents`) in a store of
    ``chunk_size`` chunks: such a tensor alone is one chunk."""
    return min(SMALL_TENSOR, chunk_size - chunk_size % 16)
"""Tensors of at most this many bytes are packed with their neighbours (``plan_extents(pack=True)``)."""
PACK_AVERAGE = 32  # tensors per pack group, on average (a changed tensor rewrites its group)
PACK_MAX = 128 << 10  # a pack group closes once it holds this many bytes


@dataclass(slots=True)
class ExtentSource:
    """The bytes of one extent to commit, produced on demand.

    ``align`` is the element size chunk boundaries must respect. ``staged``,
    when set, gives the extent as a flat uint8 tensor on its device (a GPU
    tensor, never copied to the host whole): the commit streams it through
    staging buffers instead of calling ``read``. ``grid_offset`` is where the
    extent's bytes start within a larger tensor it is a shard of: chunks are cut
    on that tensor's grid (see :func:`casckpt.format.chunks.chunk_spans`).
    """

    nbytes: int
    align: int
    read: Callable[[], memoryview]
    staged: Callable[[], torch.Tensor] | None = None
    grid_offset: int = 0
    packed: bool = False  # small tensors packed together (see plan_extents)
    digest: bytes | None = None  # the chunk id of all its bytes, when known already


def _as_memoryview(array: np.ndarray) -> memoryview:
    return memoryview(array)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol


def _byte_view(t: torch.Tensor, path: str) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    try:
        # conj / neg views hold their values lazily: store what the tensor reads as
        flat = t.detach().resolve_conj().resolve_neg()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous().reshape(-1)
        if flat.stride(0) != 1:  # one-element slices count as contiguous yet keep their stride
            flat = flat.clone(memory_format=torch.contiguous_format)
        return _as_memoryview(flat.view(torch.uint8).numpy())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise UnsupportedStateError(
            f"tensor at {path!r} ({t.dtype}) cannot be stored as bytes: {exc}"
        ) from exc


def flat_bytes(t: torch.Tensor, path: str) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its own device (no host copy)."""
    try:
        flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:
            flat = flat.clone(memory_format=torch.contiguous_format)
        return flat.view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise UnsupportedStateError(
            f"tensor at {path!r} ({t.dtype}) cannot be stored as bytes: {exc}"
        ) from exc


def _storage_flat(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return whole[start:end]


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _single(leaf: TensorLeaf, extent: int) -> tuple[TensorEntry, ExtentSource]:
    value = leaf.value
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value).reshape(value.shape)  # ascontiguousarray makes 0-d 1-d
        entry = TensorEntry(leaf.path, "numpy", numpy_dtype_name(array.dtype), tuple(array.shape), extent)
        return entry, ExtentSource(
            array.nbytes, array.itemsize, lambda: _as_memoryview(array.reshape(-1).view(np.uint8))
        )
    t = value
    entry = TensorEntry(leaf.path, "torch", torch_dtype_name(t.dtype), tuple(t.shape), extent)
    if t.element_size() == 0:
        raise UnsupportedStateError(f"tensor at {leaf.path!r} has dtype {t.dtype} with no byte size")
    _refuse_unviewable(t.dtype, leaf.path)
    staged = (lambda: flat_bytes(t, leaf.path)) if t.device.type != "cpu" else None
    return entry, ExtentSource(t.numel() * t.element_size(), t.element_size(),
                               lambda: _byte_view(t, leaf.path), staged)


@functools.lru_cache(maxsize=64)  # a few dtypes, checked for every tensor of every commit
def _unviewable(dtype: torch.dtype) -> str | None:
    try:
        _byte_view(torch.empty(1, dtype=dtype), "")
    except UnsupportedStateError as exc:
        return str(exc.__cause__)
    return None


def _refuse_unviewable(dtype: torch.dtype, path: str) -> None:
    """Refuse a dtype whose bytes cannot be viewed, before any write."""
    why = _unviewable(dtype)
    if why is not None:
        raise UnsupportedStateError(f"tensor at {path!r} ({dtype}) cannot be stored as bytes: {why}")


def _same_view(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(
        t.dtype == first.dtype and t.shape == first.shape and t.stride() == first.stride()
        and t.storage_offset() == first.storage_offset()
        for t in tensors[1:]
    )


def _shared(group: list[TensorLeaf], extent: int) -> tuple[list[TensorEntry], ExtentSource]:
    tensors = [cast(torch.Tensor, leaf.value) for leaf in group]
    starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
    span_start = min(starts) - min(starts) % _SPAN_ALIGN
    span_end = max(s + _extent(t) for s, t in zip(starts, tensors, strict=True))
    entries = [
        TensorEntry(
            leaf.path, "torch", torch_dtype_name(t.dtype), tuple(t.shape), extent,
            offset=start - span_start, stride=tuple(t.stride()),
        )
        for leaf, t, start in zip(group, tensors, starts, strict=True)
    ]
    # views made by torch.from_numpy of one array share memory through separate
    # storages of different sizes: read through the largest
    anchor = max(tensors, key=lambda t: t.untyped_storage().nbytes())
    staged = (lambda: _storage_flat(anchor, span_start, span_end)) if anchor.device.type != "cpu" else None
    return entries, ExtentSource(
        span_end - span_start, _SPAN_ALIGN,
        lambda: _byte_view(_storage_flat(anchor, span_start, span_end), "<shared storage>"), staged
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # packable: no subclass with bytes of its own


@functools.lru_cache(maxsize=1 << 20)  # a state's paths come back in every commit
def _group_end(path: str) -> bool:
    """Whether a pack group ends after the tensor at ``path`` (content-defined: adding or
    removing a tensor moves one group boundary, not the ones after it)."""
    return zlib.crc32(path.encode("utf-8")) % PACK_AVERAGE == 0


class PackMemo:
    """What one commit's planning derived, for the next commit of the run to reuse.

    * The plan's layout (which leaves share which extent, and each pack group's offsets),
      keyed by every leaf's :func:`_signature`: a pure function of those, so a state whose
      leaves are the same paths with the same metadata is laid out again without
      re-deciding it. Its bytes are still read and hashed: nothing about them is trusted.
    * The tensor entries of the pack groups, for a group whose bytes and strides are the
      same (its tensors' digests are not computed again). Keyed by the group's bytes' chunk
      id, extent index, paths, dtypes and shapes: entries are a function of these.

    Holds one commit's plan and groups, and no tensor (the signatures hold addresses, not
    storages: a state dropped by its caller is freed as before)."""

    def __init__(self, previous: PackMemo | None = None) -> None:
        self._old = previous._new if previous is not None else {}
        self._new: dict[tuple[object, ...], list[TensorEntry]] = {}
        self._old_plan = previous._plan if previous is not None else None
        self._plan: tuple[tuple[object, ...], list[_Planned]] | None = None

    def entries(self, key: tuple[object, ...], make: Callable[[], list[TensorEntry]]) -> list[TensorEntry]:
        found = self._old.get(key)
        if found is None:
            found = make()
        self._new[key] = found
        return found

    def layout(self, key: tuple[object, ...], make: Callable[[], list[_Planned]]) -> list[_Planned]:
        """The plan of leaves whose signatures are ``key`` (the last commit's when they match)."""
        old = self._old_plan
        found = old[1] if old is not None and old[0] == key else make()
        self._plan = (key, found)
        return found


@dataclass(frozen=True, slots=True)
class _Planned:
    """One extent of a plan: the leaves it holds (indexes) and how. ``how`` is ``single`` (one
    leaf), ``view`` (leaves that are the same contiguous view of one storage), ``shared``
    (views of one storage) or ``packed`` (small tensors of ``sizes`` bytes at ``offsets``,
    ``total`` bytes in all, with the members' ``paths``, ``dtypes`` and ``shapes``)."""

    how: str
    members: tuple[int, ...]
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    total: int = 0
    paths: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    shapes: tuple[torch.Size, ...] = ()
    align: int = 1


def _signature(leaf: TensorLeaf) -> tuple[object, ...]:
    """All that :func:`_layout` reads of a leaf: a layout is a function of its leaves'
    signatures (and of the pack limit). The data pointer with the storage offset and
    element size gives the storage's address (which leaves share one)."""
    t = leaf.value
    if not isinstance(t, torch.Tensor):
        return (leaf.path, leaf.kind)  # an array is always an extent of its own
    return (leaf.path, type(t), t.device, t.data_ptr(), t.dtype, t.shape, t.stride(), t.storage_offset(),
            t.is_conj(), t.is_neg())


def _pack(leaves: Sequence[TensorLeaf], planned: _Planned, extent: int, memo: PackMemo,
          ids: Callable[[bytes | memoryview], bytes]) -> tuple[list[TensorEntry], ExtentSource]:
    """Small tensors packed into one extent: their bytes copied now (plain contiguous CPU
    tensors, see :func:`plan_extents`), each at its planned offset (a 16-byte boundary), each
    tensor's own chunk id recorded (its digest: history and diff tell them apart)."""
    buffer = np.zeros(planned.total, dtype=np.uint8)
    base = buffer.ctypes.data
    for i, offset, size in zip(planned.members, planned.offsets, planned.sizes, strict=True):
        # contiguous: its bytes are one run. The address is read now, not taken from the
        # signature: the tensor may have been given another storage since (by another thread)
        ctypes.memmove(base + offset, cast(torch.Tensor, leaves[i].value).data_ptr(), size)
    view = _as_memoryview(buffer)

    def make() -> list[TensorEntry]:
        return [TensorEntry(path, "torch", torch_dtype_name(dtype), tuple(shape), extent, offset=o,
                            digest=ids(view[o : o + size]))
                for path, dtype, shape, o, size in zip(planned.paths, planned.dtypes, planned.shapes,
                                                       planned.offsets, planned.sizes, strict=True)]

    digest = ids(view)
    entries = memo.entries((digest, extent, planned.paths, planned.dtypes, planned.shapes), make)
    return entries, ExtentSource(planned.total, planned.align, lambda: view, packed=True, digest=digest)


def packable(value: torch.Tensor, pack: int) -> bool:
    """Whether :func:`plan_extents` (with ``pack``) packs ``value`` with its neighbours, unless it
    shares its storage with another leaf: a small, plain, contiguous CPU tensor that is not a
    conjugate or negative view (stored as the values it reads as). The one rule: the change
    hint's caller-side sampling skips exactly the tensors this says are packed."""
    return bool(pack) and value.is_cpu and value.numel() > 0 and value.nbytes <= pack \
        and type(value) in _PLAIN and value.is_contiguous() and not (value.is_conj() or value.is_neg())


def plan_extents(leaves: Sequence[TensorLeaf], *, pack: int = 0,
                 memo: PackMemo | None = None, ids: Callable[[bytes | memoryview], bytes] = chunk_id,
                 ) -> tuple[list[TensorEntry], list[ExtentSource]]:
    """Assign every tensor leaf to an extent; views of one storage share an extent.

    Returns tensor entries in leaf order and the extent sources they index.
    Tensors off the CPU are streamed through staging buffers (``staged``).

    With ``pack`` (a size in bytes, at most the chunk size: such a tensor alone
    would be one chunk, whose id its digest is), CPU tensors of at most that
    size, not sharing storage with another leaf, are packed into shared extents, in leaf
    order, a group ending after a tensor whose path hashes to a boundary (or
    at :data:`PACK_MAX` bytes): one chunk holds many tensors, and a changed
    tensor rewrites its group, not every group after it. ``memo`` (the previous
    commit's, see :class:`PackMemo`) spares re-deriving the layout of leaves whose
    signatures did not change, and the entries of unchanged groups. ``ids`` hashes
    a chunk (the store's chunk ids: keyed in an encrypted store).
    """
    memo = memo if memo is not None else PackMemo()
    layout = memo.layout((pack, *map(_signature, leaves)), lambda: _layout(leaves, pack))
    entries: list[TensorEntry | None] = [None] * len(leaves)
    sources: list[ExtentSource] = []
    for planned in layout:
        index, members = len(sources), planned.members
        if planned.how == "single":
            entries[members[0]], source = _single(leaves[members[0]], index)
        elif planned.how == "view":
            entry, source = _single(leaves[members[0]], index)
            for i in members:
                entries[i] = TensorEntry(leaves[i].path, entry.kind, entry.dtype, entry.shape, entry.extent)
        else:
            made, source = (_shared([leaves[i] for i in members], index) if planned.how == "shared" else
                            _pack(leaves, planned, index, memo, ids))
            for i, entry in zip(members, made, strict=True):
                entries[i] = entry
        sources.append(source)
    return [e for e in entries if e is not None], sources


def _layout(leaves: Sequence[TensorLeaf], pack: int) -> list[_Planned]:
    """Which leaves share which extent, in the order of the extents (see :func:`plan_extents`):
    the leaves sharing a storage first, then each other leaf, or pack group, in leaf order."""
    groups: dict[tuple[str | None, int], list[int]] = {}
    sizes: dict[int, int] = {}  # leaf -> bytes, of the tensors small and plain enough to pack
    for i, leaf in enumerate(leaves):
        value = leaf.value
        if isinstance(value, torch.Tensor) and value.numel() > 0 and not (
            value.is_conj() or value.is_neg()  # stored as the values they read as, not shared
        ):
            cpu = value.is_cpu
            groups.setdefault((None if cpu else str(value.device), value.untyped_storage().data_ptr()),
                              []).append(i)
            if packable(value, pack):
                sizes[i] = value.nbytes
    layout: list[_Planned] = []
    done: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        tensors = [cast(torch.Tensor, leaves[i].value) for i in members]
        view = _same_view(tensors) and tensors[0].is_contiguous()
        layout.append(_Planned("view" if view else "shared", tuple(members)))
        done.update(members)
    pending: list[int] = []  # the pack group being filled
    size = 0

    def close() -> None:
        nonlocal size
        offsets, total = [], 0
        for i in pending:
            total += -total % _SPAN_ALIGN
            offsets.append(total)
            total += sizes[i]
        tensors = [cast(torch.Tensor, leaves[i].value) for i in pending]
        sizes_of = {t.element_size() for t in tensors}
        layout.append(_Planned(
            "packed", tuple(pending), tuple(offsets), tuple(sizes[i] for i in pending), total,
            tuple(leaves[i].path for i in pending), tuple(t.dtype for t in tensors),
            tuple(t.shape for t in tensors), sizes_of.pop() if len(sizes_of) == 1 else 1))
        pending.clear()
        size = 0

    for i, leaf in enumerate(leaves):
        if i in done:
            continue
        nbytes = sizes.get(i)
        if nbytes is not None:
            pending.append(i)
            size += nbytes + _SPAN_ALIGN
            if size >= PACK_MAX or _group_end(leaf.path):
                close()
            continue
        layout.append(_Planned("single", (i,)))
    if pending:
        close()
    return layout


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def tensor_from_extent(entry: TensorEntry, buffer: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Build the tensor ``entry`` describes as a view of a filled extent buffer (uint8)."""
    if entry.kind == "numpy":
        np_dtype = numpy_dtype(entry.dtype)
        end = entry.offset + math.prod(entry.shape) * np_dtype.itemsize
        flat = np.asarray(buffer).view(np.uint8)[entry.offset : end]
        return flat.view(np_dtype).reshape(entry.shape)
    dtype = torch_dtype(entry.dtype)
    if not isinstance(buffer, torch.Tensor):
        buffer = torch.from_numpy(np.asarray(buffer))
    itemsize = torch.empty((), dtype=dtype).element_size()
    stride = entry.stride if entry.stride is not None else contiguous_strides(entry.shape)
    out = torch.empty(0, dtype=dtype, device=buffer.device)
    return out.set_(buffer.untyped_storage(), entry.offset // itemsize, entry.shape, stride)


def can_fill_in_place(entry: TensorEntry, target: object, extent_users: int) -> bool:
    """Whether ``target`` can receive this tensor's extent bytes directly (no second copy)."""
    if extent_users != 1 or entry.stride is not None or entry.offset:
        return False
    if entry.kind == "torch":
        return (
            isinstance(target, torch.Tensor) and target.device.type == "cpu"
            and target.is_contiguous() and torch_dtype_name(target.dtype) == entry.dtype
            and tuple(target.shape) == entry.shape and not target.is_conj() and not target.is_neg()
        )
    return (
        isinstance(target, np.ndarray) and target.flags.c_contiguous and target.flags.writeable
        and numpy_dtype_name(target.dtype) == entry.dtype and tuple(target.shape) == entry.shape
    )


def byte_buffer(target: torch.Tensor | np.ndarray) -> memoryview:
    """A writable byte view of a contiguous CPU tensor or array."""
    if isinstance(target, np.ndarray):
        return _as_memoryview(target.reshape(-1).view(np.uint8)).cast("B")
    return _as_memoryview(target.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
