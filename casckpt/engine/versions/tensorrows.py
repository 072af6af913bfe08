"""The catalog rows that describe a version's tensors (versions of manifest formats 1 and 2,
which no writer makes any more): one per tensor, and one per distinct tensor content (its
chunk list).

Built from a manifest's tensor entries by catalog rebuilds, checks and tree views alike, so
each of them derives the rows and digests those versions' writers recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from casckpt.format.chunks import object_id
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import ExtentEntry, TensorEntry
from casckpt.format.state import rank_path


def tensor_rows(
    version_id: str, entries: Sequence[TensorEntry], extents: Sequence[ExtentEntry]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Catalog rows: one per tensor, and one per distinct tensor content (its chunk list).

    A tensor sharded across ranks is one row (its whole shape, every shard's
    chunks); a tensor of one rank's own state is named by :func:`rank_path`.
    """
    groups: dict[str, list[TensorEntry]] = {}
    for t in entries:
        path = rank_path(t.rank, t.path) if t.rank is not None and not t.is_shard else t.path
        groups.setdefault(path, []).append(t)
    rows, contents = [], {}
    for path, group in groups.items():
        group.sort(key=lambda t: t.global_offset or ())
        first = group[0]
        layout: object = [(t.dtype, t.shape, t.stride, 0 if t.digest else t.offset, t.global_offset,
                           [c.hex() for c in _own_chunks(t, extents)]) for t in group]
        if first.digest is not None and len(group) == 1:  # packed: as alone, one chunk of its own bytes
            layout = (first.dtype, first.shape, first.stride, 0, [first.digest.hex()])
        elif not first.is_shard:  # as before shards existed: digests of older versions stay the same
            layout = (first.dtype, first.shape, first.stride, first.offset,
                      [c.hex() for c in extents[first.extent].chunks])
        digest = object_id(repr(layout).encode())
        chunks = [c for t in group for c in _own_chunks(t, extents)]
        rows.append({
            "version_id": version_id, "path": path, "dtype": first.dtype,
            "shape": list(first.global_shape if first.global_shape is not None else first.shape),
            "nbytes": sum(t.numel for t in group) * element_size(first.kind, first.dtype),
            "chunks": len(chunks), "digest": digest,
        })
        contents[digest] = {"digest": digest, "nbytes": sum(_own_nbytes(t, extents) for t in group),
                            "chunk_size": extents[first.extent].chunk_size, "chunk_ids": b"".join(chunks)}
    return rows, list(contents.values())


def _own_chunks(t: TensorEntry, extents: Sequence[ExtentEntry]) -> Sequence[bytes]:
    """A tensor's chunk list: its extent's, or for a packed tensor the one chunk it would be alone."""
    return (t.digest,) if t.digest is not None else extents[t.extent].chunks


def _own_nbytes(t: TensorEntry, extents: Sequence[ExtentEntry]) -> int:
    return t.numel * element_size(t.kind, t.dtype) if t.digest is not None else extents[t.extent].nbytes
