"""Queries on tree versions: tensors, diff, history and one tensor, read from their nodes.

A tree version has no ``tensors`` rows: what those rows say (dtype, shape,
bytes, chunk count, content digest) is derived from the node that holds the
tensor, with the same digest a row would carry, so trees and older versions
compare alike (but for a DCP piece covering its whole tensor, which has the
digest of that tensor saved whole: :func:`rows_from`). Diff walks only the
subtrees whose ids differ; history follows the path down each version's tree,
reading a node once however many versions share it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

from casckpt.catalog import Catalog
from casckpt.catalog.rows import StoredContent, VersionRow, manifest_bytes
from casckpt.catalog.treemigrate import tree_root
from casckpt.engine.read.trees import adopted
from casckpt.engine.versions.nodes import StoreNodes
from casckpt.engine.versions.refs import load_manifest
from casckpt.engine.versions.tensorrows import tensor_rows
from casckpt.errors import CorruptManifestError
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, World, decode_manifest, validate
from casckpt.format.merkle import Nodes
from casckpt.format.state import decode_state
from casckpt.format.treemanifest import tensor_entry
from casckpt.format.treeread import LEAVES, TreeReader


class TensorRow(NamedTuple):
    """What a ``tensors`` row holds, for a tensor of any version."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    digest: str


def rows_from(entries: Sequence[TensorEntry], extents: Sequence[ExtentEntry]
              ) -> tuple[list[TensorRow], dict[str, StoredContent]]:
    """Tensor and content rows of tensors, as a commit of an older version records them.

    A tensor saved in one piece covering it (a DCP save's) gets the rows and digest of the
    same tensor saved whole, so show, diff and history see a DCP save and a commit of one
    state alike. A tensor saved in several pieces keeps a digest of its own."""
    pieces = Counter(t.path for t in entries if t.is_shard)
    rows, contents = tensor_rows("", [_whole(t) if pieces[t.path] == 1 else t for t in entries], extents)
    return ([TensorRow(r["path"], r["dtype"], tuple(r["shape"]), r["nbytes"], r["chunks"], r["digest"])
             for r in rows],
            {c["digest"]: StoredContent(c["nbytes"], c["chunk_size"], c["chunk_ids"]) for c in contents})


_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, OverflowError, IndexError, RecursionError)


def checked_tensor(path: str, value: Any, shared: Sequence[ExtentEntry]) -> Manifest:
    """The tensor value of a node (a tensor, or a tensor saved in pieces) as a manifest of
    that tensor alone, validated as a tensor of a decoded manifest is.

    Raises:
        CorruptManifestError: the value is malformed or impossible (outside its extent, ...).
    """
    extents = list(shared)
    try:
        sharded = value["t"] == "sharded"
        tensors = tuple(tensor_entry(path, piece["e"], extents) for piece in
                        (value["v"] if sharded else [value]))
    except _MALFORMED as exc:
        raise CorruptManifestError(f"tree tensor at {path!r} is malformed: {exc}") from exc
    root = {"t": "sharded", "i": list(range(len(tensors)))} if sharded else {"t": "tensor", "i": 0}
    world = World(1, "dcp") if sharded else None
    one = Manifest("", 0, None, 0.0, root, tensors, tuple(extents), world=world)
    validate(one)
    return one


def value_row(path: str, value: Any, shared: Sequence[ExtentEntry]) -> tuple[TensorRow, StoredContent]:
    """The rows of one tensor value of a node (one row for a tensor saved in pieces)."""
    one = checked_tensor(path, value, shared)
    rows, contents = rows_from(one.tensors, one.extents)
    return rows[0], contents[rows[0].digest]


def head(catalog: Catalog, version_id: str) -> Manifest:
    """A version's manifest head (a tree manifest's tree not read); a version migrated to a
    tree reads as one (:func:`casckpt.engine.read.trees.adopted`)."""
    manifest = decode_manifest(catalog.manifest(version_id), version_id)
    if manifest.tree is not None:
        return manifest
    return adopted(manifest, tree_root(catalog, version_id))


def head_of(data: object, version_id: str, root: str | None) -> Manifest:
    """:func:`head` of a manifest already read (``versions.manifest``) and the row's
    ``tree_root``: what history uses to read many versions' heads in one query.

    Raises:
        CorruptManifestError: the manifest column does not hold a valid manifest.
    """
    manifest = decode_manifest(manifest_bytes(data, version_id), version_id)
    if manifest.tree is not None:
        return manifest
    return adopted(manifest, root)


class Trees:
    """Tree queries over one store, sharing one node cache."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.reader = TreeReader(Nodes(StoreNodes(catalog)))

    def rows_of(self, row: VersionRow, manifest: Manifest) -> tuple[list[Any], dict[str, StoredContent]]:
        """A version's tensor rows (each as a ``tensors`` row reads) and the contents rows a
        tree derives, whatever its format: a document of format 1 or 2 not migrated has them
        in the catalog. ``manifest``: the version's, whole or only its head."""
        if manifest.tree is None:
            return list(self.catalog.tensors_of(row.id)), {}
        return self.tensor_rows(self.whole(row, manifest))

    def whole(self, row: VersionRow, manifest: Manifest) -> Manifest:
        """A version's manifest (:func:`head`) whole: a tree head's tree read."""
        return manifest if manifest.root else load_manifest(self.catalog, row)

    def comparable(self, a: Manifest, b: Manifest) -> bool:
        """Whether two versions compare by walking their trees (:meth:`differences`)."""
        return a.tree is not None and b.tree is not None

    def tensor_rows(self, manifest: Manifest) -> tuple[list[TensorRow], dict[str, StoredContent]]:
        """Every tensor of a whole (expanded) manifest, by path."""
        rows, contents = rows_from(manifest.tensors, manifest.extents)
        rows.sort(key=lambda r: r.path)
        return rows, contents

    def find(self, manifest: Manifest, path: str) -> tuple[TensorRow, StoredContent] | None:
        """The rows of the tensor at ``path`` in a tree version (None: no tensor there)."""
        tree = manifest.tree
        if tree is None:
            raise ValueError("not a tree version")
        hit = _typed(lambda: self.reader.find_tensor(tree.root, path))
        return None if hit is None else value_row(hit[0], hit[1], tree.shared)

    def entry(self, manifest: Manifest, path: str) -> Manifest | None:
        """The tensor at ``path`` in a tree version, as a manifest of it alone (its entries,
        one per piece, named ``path``; None: no tensor there, or not a tree: read the
        manifest whole)."""
        tree = manifest.tree
        if tree is None:
            return None
        hit = _typed(lambda: self.reader.find_tensor(tree.root, path))
        if hit is None:
            return None
        one = checked_tensor(hit[0], hit[1], tree.shared)
        return replace(manifest, root=one.root, tensors=one.tensors, extents=one.extents)

    def differences(self, a: Manifest, b: Manifest) -> tuple[
            list[tuple[str, TensorRow | None, TensorRow | None]], dict[str, StoredContent],
            dict[str, object], dict[str, object]]:
        """Tensors and plain values that differ between two tree versions: ``(path, row in a,
        row in b)`` sorted by path (None where a side lacks the tensor), their contents, and
        each side's differing values.

        Paths are dotted, so a key ``model.w`` (a DCP save's) and a key ``w`` under ``model``
        (a commit's) name one path: the tensors each side holds at a path are matched by
        content, whichever way their keys nest, and only those left unmatched differ."""
        if a.tree is None or b.tree is None:
            raise ValueError("not tree versions")
        contents: dict[str, StoredContent] = {}
        values: tuple[dict[str, object], dict[str, object]] = ({}, {})
        sides: dict[str, tuple[list[TensorRow], list[TensorRow]]] = {}
        ra, rb = a.tree.root, b.tree.root
        found = _typed(lambda: list(self.reader.differences(ra, rb)))
        if a.tree.shared != b.tree.shared:
            found += _typed(lambda: self._same_shared_entries(ra, rb))
        for path, x, y in found:
            if _same_packed(x, y):
                continue  # its group was rewritten around it: the same digest, in another pack
            for side, (value, shared) in enumerate(((x, a.tree.shared), (y, b.tree.shared))):
                if not isinstance(value, dict):
                    continue
                if value.get("t") in LEAVES:
                    row, content = value_row(path, value, shared)
                    sides.setdefault(path, ([], []))[side].append(row)
                    contents[row.digest] = content
                else:
                    values[side][path] = _plain(value, path)
        tensors: list[tuple[str, TensorRow | None, TensorRow | None]] = []
        for path in sorted(sides):
            left, right = _unmatched(*sides[path])
            tensors.extend((path, x, y) for x, y in itertools.zip_longest(left, right))
        return tensors, contents, values[0], values[1]

    def _same_shared_entries(self, a: bytes, b: bytes) -> list[tuple[str, Any, Any]]:
        """``(path, entry, entry)`` of every tensor both trees hold as the same entry naming a
        shared extent (``{"s": i}``, an index into each document's own list): equal nodes, which
        the walk of :meth:`differences` skips, though the extents they name may differ. Reads
        both trees whole (only when two versions' shared extents differ)."""
        left = dict(self.reader.leaves(self.reader.node(a)["v"]))
        return [(path, value, value) for path, value in self.reader.leaves(self.reader.node(b)["v"])
                if _names_shared(value) and left.get(path) == value]


def _whole(piece: TensorEntry) -> TensorEntry:
    """A piece covering its whole tensor as that tensor saved whole (any other entry as it is)."""
    if piece.global_shape != piece.shape or any(piece.global_offset or ()):
        return piece
    return replace(piece, global_shape=None, global_offset=None, rank=None)


def _unmatched(left: list[TensorRow], right: list[TensorRow]) -> tuple[list[TensorRow], list[TensorRow]]:
    """The rows of each side that no row of the other side has the digest of (one for one)."""
    rest = list(right)
    alone = []
    for row in left:
        twin = next((i for i, other in enumerate(rest) if other.digest == row.digest), None)
        if twin is None:
            alone.append(row)
        else:
            del rest[twin]
    return alone, rest


def _same_packed(x: Any, y: Any) -> bool:
    """Whether two node values are packed tensors with the same bytes, dtype and shape (their
    rows' digests are equal), without building the rows."""
    if not (isinstance(x, dict) and isinstance(y, dict) and x.get("t") == y.get("t") == "tensor"):
        return False
    ex, ey = x.get("e"), y.get("e")
    return (isinstance(ex, dict) and isinstance(ey, dict) and "h" in ex
            and all(ex.get(k) == ey.get(k) for k in ("h", "kind", "dtype", "shape", "stride")))


T = TypeVar("T")


def _typed(walk: Callable[[], T]) -> T:
    """``walk()``, a malformed node's Python error turned into CorruptManifestError."""
    try:
        return walk()
    except _MALFORMED as exc:
        raise CorruptManifestError(f"a tree node is malformed: {type(exc).__name__}: {exc}") from exc


def _names_shared(value: Any) -> bool:
    """Whether a leaf is a tensor entry naming a shared extent by its index (``{"s": i}``)."""
    entry = value.get("e") if isinstance(value, dict) and value.get("t") == "tensor" else None
    return isinstance(entry, dict) and isinstance(entry.get("blob"), dict) and "s" in entry["blob"]


def _plain(value: Mapping[str, Any], path: str) -> object:
    return decode_state(dict(value), _no_tensor)


def _no_tensor(i: int, path: str) -> object:
    raise CorruptManifestError(f"unexpected tensor at {path!r}")
