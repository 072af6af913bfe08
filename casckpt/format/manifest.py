"""Manifests: a version's tree, tensors and chunk lists, as versioned JSON.

A manifest is self-describing and never pickled. Tensors reference *extents*:
an extent is a run of bytes cut into chunks. A tensor normally owns one extent
holding its contiguous bytes; tensors that are views of one storage share an
extent covering the span they use, each recording its byte offset and strides,
so shared storage is written once and restored shared.

The stored JSON keeps the historical name of an extent: the key ``"blobs"``
lists a manifest's extents, a tensor's ``"blob"`` is the index of its extent
(and in a tree manifest, :mod:`casckpt.format.treemanifest`, a tensor entry's
``"blob"`` is its extent inline or ``{"s": i}``). The keys stay as they are so
stored manifests and version ids do not change; the code says extent. (A
*blob* in this package is only ever an object a location stores.)

The manifest's JSON bytes are hashed (object context) to give the version id;
the blob store keeps them zstd-compressed under ``manifests/<id>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import object_id
from casckpt.format.manifestcheck import tensor_nodes
from casckpt.format.manifestcheck import tensor_span as tensor_span
from casckpt.format.manifestcheck import validate as validate
from casckpt.format.manifestmodel import MANIFEST_FORMAT as MANIFEST_FORMAT
from casckpt.format.manifestmodel import MAX_MANIFEST_JSON as MAX_MANIFEST_JSON
from casckpt.format.manifestmodel import MAX_MANIFEST_OBJECT as MAX_MANIFEST_OBJECT
from casckpt.format.manifestmodel import TREE_VERSION as TREE_VERSION
from casckpt.format.manifestmodel import ExtentEntry as ExtentEntry
from casckpt.format.manifestmodel import Manifest as Manifest
from casckpt.format.manifestmodel import TensorEntry as TensorEntry
from casckpt.format.manifestmodel import TreeHead as TreeHead
from casckpt.format.manifestmodel import World as World
from casckpt.format.manifestmodel import (
    _dict,
    _extent_from_json,
    _header_from_json,
    _int,
    _ints,
    _list,
    _str,
    decompress_capped,
)
from casckpt.format.merkle import NodeSource
from casckpt.format.state import MAX_MANIFEST_NESTING, Node, json_nesting
from casckpt.format.treemanifest import from_tree_json

_READS = (1, 2, 3)  # the document versions this casckpt decodes


def _decompress(data: bytes) -> bytes:
    """The manifest JSON (at most :data:`MAX_MANIFEST_JSON` bytes, see :func:`decompress_capped`)."""
    return decompress_capped(data, MAX_MANIFEST_JSON, "manifest")


def decode_manifest(data: bytes, expected_id: str | None = None,
                    nodes: NodeSource | None = None) -> Manifest:
    """Decode and validate compressed manifest bytes.

    Only what casckpt's writers of each format wrote is accepted: every field of
    its JSON type (nothing is coerced: ``"step": 1.5`` or ``"tags": "ab"`` is
    refused, not read as 1 or two tags). A tree manifest (version 3) is read
    whole, its nodes through ``nodes`` (each verified against its id); without
    ``nodes`` only its head is read (``tree`` set, ``root`` empty, no tensors).

    Raises:
        CorruptManifestError: the bytes do not decompress, do not hash to
            ``expected_id``, or describe something impossible.
    """
    doc = decode_document(data, expected_id)
    try:
        if doc["version"] == TREE_VERSION:
            manifest = from_tree_json(doc, nodes)
        else:
            manifest = _from_json(doc)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
            IndexError) as exc:
        raise CorruptManifestError(f"manifest is malformed: {exc}") from exc
    if manifest.tree is None or nodes is not None:
        validate(manifest)
    return manifest


def decode_document(data: bytes, expected_id: str | None = None) -> dict[str, Any]:
    """The JSON document of compressed manifest bytes, checked against its id and format.

    Raises:
        CorruptManifestError: as :func:`decode_manifest`.
    """
    raw = _decompress(data)
    if expected_id is not None and object_id(raw) != expected_id:
        raise CorruptManifestError(
            f"manifest of version {expected_id[:12]} does not match its id; it is corrupt"
        )
    if json_nesting(raw) > MAX_MANIFEST_NESTING:  # before json.loads recurses into a forged tree
        raise CorruptManifestError(
            f"manifest nests deeper than any committed state can (over "
            f"{MAX_MANIFEST_NESTING} levels of JSON): it is corrupt or forged. Restore another "
            "version, and run `casckpt check` to find what else is damaged"
        )
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a casckpt manifest")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in _READS:
            raise ValueError(
                f"manifest version {version!r:.20} is not supported by this casckpt "
                f"(reads versions up to {TREE_VERSION}); upgrade casckpt"
            )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise CorruptManifestError(f"manifest is malformed: {exc}") from exc
    return doc


def _from_json(doc: dict[str, Any]) -> Manifest:
    extents = tuple(_extent_from_json(_dict(b, "extent")) for b in _list(doc["blobs"], "blobs"))
    tensors = tuple(_tensor_from_json(_dict(t, "tensor")) for t in _list(doc["tensors"], "tensors"))
    return Manifest(root=_dict(doc["root"], "root"), tensors=tensors, extents=extents,
                    **_header_from_json(doc))


def _tensor_from_json(t: dict[str, Any]) -> TensorEntry:
    path = _str(t["path"], "tensor path")
    if ("global_shape" in t) != ("global_offset" in t):
        raise ValueError(f"tensor {path!r} has only one of global_shape and global_offset")
    stride, rank = t["stride"], t.get("rank")
    return TensorEntry(
        path, _str(t["kind"], "tensor kind"), _str(t["dtype"], "tensor dtype"), _ints(t["shape"], "shape"),
        _int(t["blob"], "tensor extent"), _int(t["offset"], "tensor offset"),
        _ints(stride, "stride") if stride is not None else None,
        _ints(t["global_shape"], "global_shape") if "global_shape" in t else None,
        _ints(t["global_offset"], "global_offset") if "global_shape" in t else None,
        _int(rank, "rank") if rank is not None else None,
    )


def rank_count(m: Manifest) -> int | None:
    """How many per-rank trees the manifest holds (None: one tree for every rank)."""
    return len(m.root["v"]) if m.root.get("t") == "ranks" else None


def rank_view(m: Manifest, rank: int) -> Manifest:
    """The manifest of one rank's state, from a version a process group saved rank by rank.

    Raises:
        IndexError: the version holds no state for ``rank``.
    """
    tree = m.root["v"][rank]
    used = sorted(i for _, indices in tensor_nodes(tree) for i in indices)
    index = {old: new for new, old in enumerate(used)}
    return replace(m, root=renumber_tensors(tree, index.__getitem__),
                   tensors=tuple(m.tensors[i] for i in used))


def renumber_tensors(node: Node, new_index: Callable[[int], int]) -> Node:
    """A copy of a tree whose tensor and shard indices are mapped through ``new_index``."""
    kind = node.get("t")
    if kind == "tensor":
        return {"t": "tensor", "i": new_index(node["i"])}
    if kind == "sharded":
        return {"t": "sharded", "i": [new_index(i) for i in node["i"]]}
    if kind in ("dict", "list", "tuple", "ranks"):
        return {**node, "v": [renumber_tensors(child, new_index) for child in node["v"]]}
    return node


def sharding(m: Manifest) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Path -> (shard count, dimensions the shards cut) of every tensor saved in pieces."""
    found: dict[str, tuple[int, set[int]]] = {}
    for t in m.tensors:
        if t.global_shape is None:
            continue
        count, dims = found.get(t.path, (0, set()))
        dims |= {d for d, (n, g) in enumerate(zip(t.shape, t.global_shape, strict=True)) if n != g}
        found[t.path] = (count + 1, dims)
    return {path: (count, tuple(sorted(dims))) for path, (count, dims) in found.items()}
