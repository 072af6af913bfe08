"""The rows of ``tree_changes`` a commit records: the tensors whose leaf the tree encoder did
not reuse from the parent's tree, and the paths the parent had that the version lacks.

What the encoder made is what changed (or may have: a row whose digest equals the parent's
is harmless, history compares digests), so a row costs what writing it costs: its digest
(the rule of :func:`casckpt.engine.versions.tensorrows.tensor_rows`) and its changed bytes
(the rule of :func:`casckpt.catalog.tensorchanges.changed_bytes`), against the parent's entry
at the path, which the encoder's memo holds. A version whose memo is not its parent's (the
first commit of a run in a process, a process group's, or a state whose extents tensors
share) records none here: ``casckpt migrate-trees`` records it from its tree
(:mod:`casckpt.engine.maintenance.treeindex`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from casckpt.catalog.treechanges import Change
from casckpt.format.chunks import ID_BYTES, differing_bytes, object_hasher
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry
from casckpt.format.treeencode import TreeMemo

Made = Sequence[tuple[TensorEntry, ExtentEntry, Any, int]]


_HASHER = object_hasher()  # copied per digest: deriving its key is most of a short hash


def tensor_digest(t: TensorEntry, extent: ExtentEntry, hexes: Any = None) -> bytes:
    """The digest :func:`~casckpt.engine.versions.tensorrows.tensor_rows` gives a tensor saved
    whole by one process, as bytes (``hexes``: its extent's chunk ids in hex, when already made)."""
    if t.digest is not None:
        layout = (t.dtype, t.shape, t.stride, 0, [t.digest.hex()])
    else:
        layout = (t.dtype, t.shape, t.stride, t.offset,
                  hexes if isinstance(hexes, list) else [c.hex() for c in extent.chunks])
    hasher = _HASHER.copy()
    hasher.update(repr(layout).encode())
    return bytes(hasher.digest())


def _changed(was: TensorEntry, was_extent: ExtentEntry, t: TensorEntry, extent: ExtentEntry,
             nbytes: int) -> int:
    """:func:`casckpt.catalog.tensorchanges.changed_bytes` of a tensor and its parent's at the
    path (their contents: a packed tensor's is its own bytes, one chunk)."""
    size = extent.chunk_size
    if was.dtype != t.dtype or was.shape != t.shape or was_extent.chunk_size != size or size <= 0:
        return nbytes
    old = (was.digest,) if was.digest is not None else was_extent.chunks
    new = (t.digest,) if t.digest is not None else extent.chunks
    content = nbytes if t.digest is not None else extent.nbytes
    if len(new) == 1 and len(old) == 1 and len(new[0]) == ID_BYTES == len(old[0]):  # most tensors
        return 0 if new[0] == old[0] else min(nbytes, max(0, min(size, content)))
    joined_old, joined_new = b"".join(old), b"".join(new)
    if len(joined_old) % ID_BYTES or len(joined_new) % ID_BYTES:
        return nbytes
    return min(nbytes, differing_bytes(size, content, joined_old, joined_new))


def changes(m: Manifest, memo: TreeMemo, memo_version: str | None, made: Made) -> list[Change] | None:
    """The rows of version ``m`` (``memo``: its encoding's, made from the memo of version
    ``memo_version``; ``made``: what it did not reuse), or None where they cannot be told here."""
    parent = m.parent
    if memo.tensors < 0 or (parent is None and memo_version is not None) or (
            parent is not None and (memo_version != parent or memo.parent_tensors < 0)):
        return None
    expected = memo.parent_tensors if parent is not None else 0
    if not made and len(m.tensors) == expected:
        return []  # every tensor reused: the parent's, and no more of them
    by_path = memo.parent_entries() if parent is not None else {}
    rows: list[Change] = []
    matched = 0
    get, copy = by_path.get, _HASHER.copy
    for t, extent, blob, nbytes in made:
        old = get(t.path)
        changed = None
        if old is not None:
            matched += 1
            changed = _changed(old[0], old[1], t, extent, nbytes)
        shape, hexes = t.shape, blob.get("chunks")
        if t.digest is None and isinstance(hexes, list):  # tensor_digest, inline (most tensors)
            hasher = copy()
            hasher.update(repr((t.dtype, shape, t.stride, t.offset, hexes)).encode())
            digest = bytes(hasher.digest())
        else:
            digest = tensor_digest(t, extent, hexes)
        rows.append((t.path, t.dtype, f"[{shape[0]}]" if len(shape) == 1 else str(list(shape)), nbytes,
                     digest, changed))
    if len(m.tensors) - len(made) + matched != expected:  # the parent had paths this lacks
        now = {t.path for t in m.tensors}
        rows += [(path, None, None, 0, None, None) for path in by_path if path not in now]
    return rows
