"""What a manifest may hold: the bounds and consistency checks every decoded manifest passes.

A manifest comes from storage that may be damaged or forged: its tree must be well formed,
each tensor must lie inside its extent, shards must tile their tensor exactly once, and no
size may be impossible. :func:`validate` raises :class:`CorruptManifestError` saying which
check failed. Used by :func:`casckpt.format.manifest.decode_manifest`; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import chunk_count
from casckpt.format.dtypes import element_size
from casckpt.format.manifestmodel import HEX_DIGITS, Manifest, TensorEntry
from casckpt.format.state import Node


def tensor_span(t: TensorEntry, itemsize: int) -> int:
    """Bytes from the tensor's offset to one past its last element."""
    if t.numel == 0:
        return 0
    if t.stride is None:
        return t.numel * itemsize
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True)) + 1) * itemsize


_LEAVES: dict[str, Callable[[Node], bool]] = {  # what each plain-value node must hold (state.encode_state)
    "none": lambda n: True,
    "bool": lambda n: isinstance(n.get("v"), bool),
    "int": lambda n: _is_int(n.get("v")) if "h" not in n else _is_hex_int(n["h"]),
    "float": lambda n: isinstance(n.get("v"), str) and len(n["v"]) == 16 and HEX_DIGITS.issuperset(n["v"]),
    "str": lambda n: isinstance(n.get("v"), str),
    "bytes": lambda n: isinstance(n.get("v"), str),
}


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex_int(value: Any) -> bool:
    digits = value.removeprefix("-") if isinstance(value, str) else ""
    return bool(digits) and HEX_DIGITS.issuperset(digits)


def _is_key(key: Any) -> bool:
    return isinstance(key, str) or (isinstance(key, dict) and _is_int(key.get("i")))


def tensor_nodes(root: Node) -> Iterator[tuple[str, list[int]]]:
    """``("tensor", [i])`` or ``("sharded", [i, ...])`` for every tensor node of the tree
    (iteratively: a forged tree may be deep), checking every other node on the way: a
    ``ranks`` node may only be the root, plain values must hold their JSON type, dict keys
    must be str or ``{"i": int}``, and no node may be of an unknown type."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            raise CorruptManifestError("manifest tree holds a node that is not an object")
        kind = node.get("t")
        if kind == "tensor":
            index = node.get("i")
            if not _is_int(index):
                raise CorruptManifestError("manifest tensor node has no integer index")
            yield "tensor", [index]
        elif kind == "sharded":
            indices = node.get("i")
            if not isinstance(indices, list) or not indices or not all(_is_int(i) for i in indices):
                raise CorruptManifestError("manifest sharded node has no list of shard indices")
            yield "sharded", indices
        elif kind in ("dict", "list", "tuple") or (kind == "ranks" and node is root):
            children = node.get("v")
            if not isinstance(children, list):
                raise CorruptManifestError(f"manifest {kind} node has no item list")
            keys = node.get("k")
            if kind == "dict" and (not isinstance(keys, list) or len(keys) != len(children)
                                   or not all(_is_key(k) for k in keys)):
                raise CorruptManifestError("manifest dict node's keys and values disagree")
            stack.extend(children)
        elif kind == "ranks":
            raise CorruptManifestError("manifest has a ranks node below the root")
        elif not isinstance(kind, str) or kind not in _LEAVES or not _LEAVES[kind](node):
            raise CorruptManifestError(f"manifest tree holds a malformed {str(kind)[:20]!r} node")


_MAX_TENSOR_ELEMENTS = 1 << 48  # no real tensor is larger: a forged shape would allocate it
_DISJOINT_CHECKED = 256  # shards compared pairwise up to this many (a few tensor-parallel ways more is rare)


def _validate_sharded(m: Manifest, indices: list[int]) -> None:
    shards = [m.tensors[i] for i in indices]
    first = shards[0]
    whole = math.prod(first.global_shape or ())
    if whole > _MAX_TENSOR_ELEMENTS:
        raise CorruptManifestError(f"manifest tensor {first.path!r} is impossibly large")
    for t in shards:
        if (not t.is_shard or t.path != first.path or t.dtype != first.dtype or t.kind != "torch"
                or t.global_shape != first.global_shape):
            raise CorruptManifestError(f"manifest shards of {first.path!r} disagree on what they are part of")
        offset, shape = t.global_offset, t.global_shape
        inside = offset is not None and shape is not None and len(offset) == len(t.shape) == len(shape) \
            and all(0 <= o and o + n <= g for o, n, g in zip(offset, t.shape, shape, strict=True))
        if not inside:
            raise CorruptManifestError(f"manifest shard of {t.path!r} lies outside the tensor it is part of")
    pieces = [t for t in shards if t.numel]  # DCP may list an empty piece more than once
    if sum(t.numel for t in pieces) != whole or (len(pieces) <= _DISJOINT_CHECKED and any(
            _overlap(a, b) for i, a in enumerate(pieces) for b in pieces[i + 1:])):
        raise CorruptManifestError(f"manifest shards of {first.path!r} do not cover the tensor exactly once")


def _overlap(a: TensorEntry, b: TensorEntry) -> bool:
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in
               zip(a.global_offset or (), a.shape, b.global_offset or (), b.shape, strict=True))


def _check_nodes(m: Manifest) -> None:
    used: list[int] = []
    for kind, indices in tensor_nodes(m.root):
        if any(not 0 <= i < len(m.tensors) for i in indices):
            raise CorruptManifestError("manifest tree refers to a tensor it does not list")
        if kind == "sharded":
            _validate_sharded(m, indices)
        elif m.tensors[indices[0]].is_shard:
            raise CorruptManifestError(f"manifest shard of {m.tensors[indices[0]].path!r} stands alone")
        used.extend(indices)
    if sorted(used) != list(range(len(m.tensors))):
        raise CorruptManifestError(
            "manifest tree and tensor list disagree (each tensor must appear exactly once)"
        )


def validate(m: Manifest) -> None:
    """Check a manifest built from parts (one tensor of a tree) as a decoded one is checked.

    Raises:
        CorruptManifestError: it describes something impossible.
    """
    if m.world is not None and (m.world.size < 1 or m.world.api not in ("dcp", "group")):
        raise CorruptManifestError("manifest names an impossible world of ranks")
    _check_nodes(m)
    for i, b in enumerate(m.extents):
        sane = b.nbytes >= 0 and b.chunk_size > 0 and 0 <= b.phase < b.chunk_size
        if not sane or len(b.chunks) != chunk_count(b.nbytes, b.chunk_size, b.phase):
            raise CorruptManifestError(f"manifest extent {i} has inconsistent sizes")
        if any(len(c) != 32 for c in b.chunks):
            raise CorruptManifestError(f"manifest extent {i} has a malformed chunk id")
    for t in m.tensors:
        if t.kind not in ("torch", "numpy") or not 0 <= t.extent < len(m.extents):
            raise CorruptManifestError(f"manifest tensor {t.path!r} is malformed")
        if any(n < 0 for n in t.shape) or (t.stride is not None and (
            len(t.stride) != len(t.shape) or any(s < 0 for s in t.stride) or t.kind == "numpy"
        )):  # arrays are stored whole and contiguous: a stride would be ignored on restore
            raise CorruptManifestError(f"manifest tensor {t.path!r} has a bad shape or stride")
        itemsize = element_size(t.kind, t.dtype)
        if t.offset < 0 or t.offset % itemsize or (
            t.offset + tensor_span(t, itemsize) > m.extents[t.extent].nbytes
        ):
            raise CorruptManifestError(f"manifest tensor {t.path!r} lies outside its extent")
