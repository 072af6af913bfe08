"""Tree manifests (version 3): a version's description and the root of its node tree.

The document holds what versions 1 and 2 hold except the state, which
is replaced by ``"tree": {"root", "n", "b", "shared"}``: the root node's id
(:mod:`casckpt.format.merkle`), the tensor count and logical bytes, and the
extents several tensors share. The version id is the object id of the document,
so it names the whole state (the root id is a hash of every node below it).

Versions many ranks saved are tree manifests too, with ``"world": {"size", "api"}``:

- a tensor saved in pieces (DCP) is a ``{"t": "sharded", "v": [piece, ...]}`` value, each
  piece a tensor value whose entry adds the whole tensor's shape ``"gs"`` and the piece's
  offset in it ``"go"`` (readers reshard from these, as from a version 2 manifest);
- a version of per-rank states (``commit(group=)``) has a ``{"t": "ranks", "v": [...]}``
  root, one state per rank (paths shown as ``rank<N>/<path>``); ranks with the same
  state share its nodes.

Such a document keeps no summary (``groups``, ``values``): ``show`` reads its tree.

A commit that reused tensors on a change hint adds ``"hinted": {"v": 1, "t": {path:
fingerprint}}`` (:mod:`casckpt.format.hintsample`), which ``check --read-data`` verifies. It is
optional: other documents do not hold it, and readers that predate it ignore it (they read
the document's keys they know and no others).

This module does no I/O.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import zstandard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import ChunkIds, chunk_id, object_id
from casckpt.format.dtypes import element_size
from casckpt.format.hintsample import FINGERPRINT_BYTES, SCHEME
from casckpt.format.manifestmodel import (
    HEX_DIGITS,
    MANIFEST_FORMAT,
    TREE_VERSION,
    ExtentEntry,
    Manifest,
    TensorEntry,
    TreeHead,
    _dict,
    _extent_from_json,
    _header_from_json,
    _int,
    _ints,
    _list,
    _str,
)
from casckpt.format.merkle import Nodes, NodeSource
from casckpt.format.state import Node, decode_state, iter_value_nodes
from casckpt.format.treeencode import Tree, TreeEncoder, TreeMemo, extent_json, tensor_value
from casckpt.format.treeread import TreeReader
from casckpt.types import group_sizes

SUMMARY_GROUPS = 64
"""A document lists its tensors by path head when they have at most this many heads."""
SUMMARY_VALUES = 4096
"""A document repeats its plain values when their JSON is at most this many bytes."""
Groups = tuple[tuple[str, int, int], ...]
Values = tuple[tuple[str, Node], ...]


def encode_tree_manifest(m: Manifest, memo: TreeMemo | None = None, ids: ChunkIds = chunk_id,
                         made: list[tuple[TensorEntry, ExtentEntry, Any, int]] | None = None,
                         ) -> tuple[str, bytes, Tree]:
    """``(version id, compressed document, tree)`` of a manifest (reusing what ``memo``, the
    run's previous commit's, made for what did not change; ``ids`` names the nodes: the
    store's chunk ids).

    ``made`` (when given) gets ``(tensor, extent, blob JSON, bytes)`` of every tensor whose value
    was made rather than reused from ``memo`` (what the index of changes records,
    :mod:`casckpt.engine.write.treeindex`).

    Raises:
        ValueError: pieces or ranks in a manifest without a world, or a ranks node below the root.
    """
    if m.world is None and (m.root.get("t") == "ranks" or any(
            t.is_shard or t.rank is not None for t in m.tensors)):
        raise ValueError("pieces and ranks are saved by many ranks: the manifest needs its world")
    order = shared_extents(m)
    shared = {extent: n for n, extent in enumerate(order)}
    packed: dict[int, dict[str, Any]] = {}  # one JSON per packed extent
    memo = memo if memo is not None else TreeMemo()
    extents = memo.extents(m.extents)

    def tensor(i: int, memo: TreeMemo) -> Any:
        t = m.tensors[i]
        extent = extents[t.extent]
        if t.extent in shared:  # its entry names the extent by its place in the document
            return tensor_value(*make(t, extent))
        return memo.entry(t, extent, make)

    def make(t: TensorEntry, extent: ExtentEntry) -> tuple[dict[str, Any], int]:
        if extent.packed:  # named by each of its tensors (they restore separately)
            ref = packed.get(t.extent)
            if ref is None:
                ref = packed[t.extent] = {
                    **extent_json(extent.nbytes, extent.chunk_size, extent.chunks, extent.phase),
                    "packed": True}
        elif t.extent in shared:
            ref = {"s": shared[t.extent]}
        else:
            ref = extent_json(extent.nbytes, extent.chunk_size, extent.chunks, extent.phase)
        entry = {"kind": t.kind, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                 "stride": list(t.stride) if t.stride is not None else None, "blob": ref}
        if t.digest is not None:
            entry["h"] = t.digest.hex()
        if t.global_shape is not None and t.global_offset is not None:
            entry["gs"], entry["go"] = list(t.global_shape), list(t.global_offset)
        nbytes = t.numel * element_size(t.kind, t.dtype)
        if made is not None:
            made.append((t, extent, ref, nbytes))
        return entry, nbytes

    encoder = TreeEncoder(tensor, memo, ids)
    root, count, nbytes = encoder.encode(m.root)
    if not order and m.world is None:  # every tensor went through memo.entry
        memo.tensors = len(m.tensors)
    shared_json = [extent_json(e.nbytes, e.chunk_size, e.chunks, e.phase)
                   for e in (m.extents[b] for b in order)]
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT, "version": TREE_VERSION, "run": m.run, "step": m.step,
        "parent": m.parent, "created_at": m.created_at, "metadata": dict(m.metadata),
        "metrics": dict(m.metrics), "message": m.message, "tags": list(m.tags),
        "tree": {"root": root.hex(), "n": count, "b": nbytes, "shared": shared_json},
    }
    if m.world is not None:
        doc["world"] = {"size": m.world.size, "api": m.world.api}
    if m.hinted:  # only hinted commits add the key: every other document is as it was
        doc["hinted"] = {"v": SCHEME, "t": {path: fp.hex() for path, fp in m.hinted.items()}}
    groups, values = _summary(encoder.top, m.root) if m.world is None else (None, None)
    if groups is not None:
        doc["tree"]["groups"] = [list(g) for g in groups]
    if values is not None:
        doc["tree"]["values"] = [list(v) for v in values]
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    tree = Tree(root, count, nbytes, encoder.nodes, order, groups, values)
    return object_id(raw), zstandard.ZstdCompressor(level=3).compress(raw), tree


def headed(m: Manifest, tree: Tree) -> Manifest:
    """``m`` with the head and nodes of ``tree``, its tree (:func:`encode_tree_manifest`)."""
    return replace(m, tree=TreeHead(tree.root, tree.tensors, tree.nbytes,
                                    tuple(m.extents[i] for i in tree.shared_extents), tree.groups,
                                    tree.values), nodes=tuple(tree.nodes))


def shared_extents(m: Manifest) -> list[int]:
    """The extents (indexes) a tree manifest of ``m`` lists as shared: unpacked extents several
    tensors use, in the order the encoder meets their first tensor (depth first, as
    :class:`~casckpt.format.treeencode.TreeEncoder` walks ``m.root``)."""
    users = Counter(t.extent for t in m.tensors)
    if not any(n > 1 and not m.extents[b].packed for b, n in users.items()):
        return []  # the common case, without a walk of the tree
    order: dict[int, None] = {}
    stack: list[Any] = [m.root]
    while stack:
        node = stack.pop()
        kind = node.get("t")
        if kind == "tensor":
            extent = m.tensors[node["i"]].extent
            if users[extent] > 1 and not m.extents[extent].packed:
                order.setdefault(extent)
        elif kind in ("dict", "list", "tuple", "ranks", "sharded"):
            stack.extend(reversed(node["v"]) if kind != "sharded" else ())
    return list(order)


def with_tree(m: Manifest, ids: ChunkIds = chunk_id) -> tuple[Manifest, Tree]:
    """``m`` cut into its tree (what a one-process commit stores), with its tree head and
    nodes set: for a manifest of version 1, the tree it migrates to (same extents, chunks and
    digests), whose root a migrated version's catalog row names."""
    _, _, tree = encode_tree_manifest(m, ids=ids)
    return replace(m, tree=head_of(m, tree.root), nodes=tuple(tree.nodes)), tree


def head_of(m: Manifest, root: bytes) -> TreeHead:
    """The tree head of a version-1 manifest whose tree is ``root`` (a migrated version)."""
    return TreeHead(root, len(m.tensors), sum(t.numel * element_size(t.kind, t.dtype) for t in m.tensors),
                    tuple(m.extents[b] for b in shared_extents(m)))


def _summary(top: Sequence[tuple[str, int, int]], root: Node) -> tuple[Groups | None, Values | None]:
    """What ``show`` prints without reading the tree: tensors by path head (at most
    :data:`SUMMARY_GROUPS` heads; from the root's items, ``(key, tensors, bytes)``: a
    path's head is its root key's) and the plain values (at most :data:`SUMMARY_VALUES`
    bytes of JSON); a part over its limit is left out (``show`` then reads the tree)."""
    found: dict[str, list[int]] = {}
    for key, tensors, nbytes in top:
        slot = found.setdefault(key.partition(".")[0], [0, 0])
        slot[0] += tensors
        slot[1] += nbytes
    groups = tuple(sorted((h, n, b) for h, (n, b) in found.items())) if len(found) <= SUMMARY_GROUPS else None
    values: Values | None = tuple(iter_value_nodes(root))
    if len(_canonical(values)) > SUMMARY_VALUES:
        values = None
    return groups, values


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _check_summary(head: TreeHead, root: Node, tensors: Sequence[TensorEntry]) -> None:
    """A document's summary must say what its tree holds (it is written from the same state)."""
    if head.groups is not None:
        found = group_sizes((t.path, t.numel * element_size(t.kind, t.dtype)) for t in tensors)
        if sorted((h, n, b) for h, (n, b) in found.items()) != sorted(head.groups):
            raise CorruptManifestError("tree manifest's tensor groups disagree with its tree: it is corrupt")
    if head.values is not None and _canonical(head.values) != _canonical(tuple(iter_value_nodes(root))):
        raise CorruptManifestError("tree manifest's plain values disagree with its tree: it is corrupt")


def head_values(head: TreeHead) -> dict[str, object] | None:
    """The plain values a document's summary keeps, by path (None: not kept, read the tree)."""
    if head.values is None:
        return None
    return {path: decode_state(node, _no_tensor) for path, node in head.values}


def _no_tensor(i: int, path: str) -> object:
    raise CorruptManifestError(f"tree manifest's values hold a tensor at {path!r}: it is corrupt")


def tree_head(doc: dict[str, Any]) -> TreeHead:
    """The ``tree`` of a version 3 document, checked."""
    tree = _dict(doc["tree"], "tree")
    root = _str(tree["root"], "tree root")
    if len(root) != 64:
        raise ValueError("tree root is not a node id")
    shared = tuple(_extent_from_json(_dict(b, "extent")) for b in _list(tree["shared"], "shared extents"))
    groups = values = None
    if "groups" in tree:
        groups = tuple((_str(g[0], "group"), _int(g[1], "group tensors"), _int(g[2], "group bytes"))
                       for g in (_list(g, "group") for g in _list(tree["groups"], "groups")) if len(g) == 3)
        if len(groups) != len(tree["groups"]) or len(groups) > SUMMARY_GROUPS:
            raise ValueError("tree manifest has malformed tensor groups")
    if "values" in tree:
        values = tuple((_str(v[0], "value path"), _dict(v[1], "value"))
                       for v in (_list(v, "value") for v in _list(tree["values"], "values")) if len(v) == 2)
        if len(values) != len(tree["values"]):
            raise ValueError("tree manifest has malformed plain values")
    return TreeHead(bytes.fromhex(root), _int(tree["n"], "tree tensor count"),
                    _int(tree["b"], "tree bytes"), shared, groups, values)


def from_tree_json(doc: dict[str, Any], nodes: NodeSource | None) -> Manifest:
    """A version 3 document as a :class:`Manifest`, its tree read through ``nodes`` (None:
    the head only)."""
    head = tree_head(doc)
    manifest = Manifest(root={}, tensors=(), extents=(), tree=head, hinted=_hinted(doc),
                        **_header_from_json(doc))
    if nodes is None:
        return manifest
    reader = TreeReader(Nodes(nodes))
    root, found = reader.expand(head.root)
    extents: list[ExtentEntry] = list(head.shared)
    packed: dict[ExtentEntry, int] = {}
    tensors = [tensor_entry(path, entry, extents, packed, rank) for path, entry, rank in found]
    if (root.get("t") == "ranks" or any(t.is_shard for t in tensors)) and manifest.world is None:
        raise CorruptManifestError("tree manifest holds pieces or ranks but no world: it is corrupt")
    if len(tensors) != head.tensors:
        raise CorruptManifestError(
            f"tree manifest counts {head.tensors} tensors but its tree holds {len(tensors)}: it is corrupt")
    _check_summary(head, root, tensors)
    _check_hinted(manifest.hinted, tensors, extents)
    return replace(manifest, root=root, tensors=tuple(tensors), extents=tuple(extents),
                   nodes=tuple(sorted(reader.visited)))


def _hinted(doc: dict[str, Any]) -> dict[str, bytes]:
    """The fingerprints of hinted tensors (:mod:`casckpt.format.hintsample`) a document
    records: none without ``"hinted"``, and none of a sampling scheme this casckpt does not
    know (a newer one: its check cannot recompute them, and nothing else reads them)."""
    if "hinted" not in doc:
        return {}
    hinted = _dict(doc["hinted"], "hinted")
    scheme = hinted.get("v")
    if type(scheme) is not int or scheme != SCHEME:  # true and 1.0 are not scheme 1
        return {}
    out = {}
    for path, text in _dict(hinted.get("t"), "hinted tensors").items():
        if not (isinstance(text, str) and len(text) == 2 * FINGERPRINT_BYTES and HEX_DIGITS.issuperset(text)):
            raise ValueError(f"fingerprint of hinted tensor {path!r} is not {2 * FINGERPRINT_BYTES} "
                             "hex digits")
        out[path] = bytes.fromhex(text)
    return out


def _check_hinted(hinted: Mapping[str, bytes], tensors: Sequence[TensorEntry],
                  extents: Sequence[ExtentEntry]) -> None:
    """A fingerprint names a tensor a hint can reuse: one of the version, alone and whole in
    an extent of its own (what :func:`casckpt.engine.write.hint.reusable` reuses)."""
    if not hinted:
        return
    users = Counter(t.extent for t in tensors)
    alone = {t.path for t in tensors if users[t.extent] == 1 and not extents[t.extent].packed
             and not t.offset and t.stride is None and not t.is_shard and t.rank is None}
    stray = sorted(set(hinted) - alone)
    if stray:
        raise CorruptManifestError(f"tree manifest fingerprints tensor {stray[0]!r}, which no hint "
                                   "could have reused: it is corrupt")


_ENTRY_FIELDS = frozenset({"kind", "dtype", "shape", "offset", "stride", "blob"})
_OPTIONAL_FIELDS = frozenset({"h", "gs", "go"})


def tensor_entry(path: str, entry: Any, extents: list[ExtentEntry],
                 packed: dict[ExtentEntry, int] | None = None, rank: int | None = None) -> TensorEntry:
    """A node's tensor entry as a :class:`TensorEntry`, its extent appended to ``extents`` (or
    pointing at a shared one, which ``extents`` starts with; or at a packed one ``packed``
    already lists, so a packed extent is read once); ``rank``: the rank whose state holds it
    (a version of per-rank states)."""
    e = _dict(entry, "tensor entry")
    if not (_ENTRY_FIELDS <= set(e) <= _ENTRY_FIELDS | _OPTIONAL_FIELDS):
        raise ValueError(f"tensor {path!r} has unexpected fields")
    if ("gs" in e) != ("go" in e):
        raise ValueError(f"tensor {path!r} has only one of its whole shape and its offset")
    ref = _dict(e["blob"], "tensor extent")
    digest = None
    index: int | None
    if set(ref) == {"s"}:
        index = _int(ref["s"], "shared extent")
        if not 0 <= index < len(extents):
            raise ValueError(f"tensor {path!r} names a shared extent the manifest does not list")
    else:
        is_packed = ref.get("packed", False)
        if is_packed is not True and "packed" in ref:
            raise ValueError(f"tensor {path!r} has a malformed packed flag")
        fields = {k: v for k, v in ref.items() if k != "packed"}
        extent = _extent_from_json(fields)
        if is_packed:
            extent = ExtentEntry(extent.nbytes, extent.chunk_size, extent.chunks, extent.phase, packed=True)
            digest = _digest(e.get("h"), path)
        elif "h" in e:
            raise ValueError(f"tensor {path!r} has a digest but no packed extent")
        index = packed.get(extent) if packed is not None and is_packed else None
        if index is None:
            extents.append(extent)
            index = len(extents) - 1
            if packed is not None and is_packed:
                packed[extent] = index
    stride = e["stride"]
    return TensorEntry(path, _str(e["kind"], "tensor kind"), _str(e["dtype"], "tensor dtype"),
                       _ints(e["shape"], "shape"), index, _int(e["offset"], "tensor offset"),
                       _ints(stride, "stride") if stride is not None else None,
                       _ints(e["gs"], "whole shape") if "gs" in e else None,
                       _ints(e["go"], "piece offset") if "go" in e else None, rank, digest=digest)


def _digest(value: Any, path: str) -> bytes:
    text = _str(value, f"digest of tensor {path!r}")
    if len(text) != 64:
        raise ValueError(f"digest of tensor {path!r} is not 64 hex digits")
    return bytes.fromhex(text)
