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
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import zstandard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import chunk_spans, object_id
from casckpt.format.dtypes import element_size
from casckpt.format.manifestcheck import HEX_DIGITS, tensor_nodes
from casckpt.format.manifestcheck import tensor_span as tensor_span
from casckpt.format.manifestcheck import validate as validate
from casckpt.format.tree import MAX_MANIFEST_NESTING, Node, json_nesting

if TYPE_CHECKING:
    from casckpt.format.merkle import NodeSource

MANIFEST_FORMAT = "casckpt.manifest"
MANIFEST_VERSION = 2  # written only by versions that use its additions (sharded tensors, ranks)
TREE_VERSION = 3  # a tree manifest: the state tree as shared nodes (casckpt.format.merkle)
_READS = (1, 2, 3)
_MAX_MANIFEST = 512 << 20  # JSON of ~5 million tensors; decompression stops here, whatever a frame declares
MAX_MANIFEST_JSON = _MAX_MANIFEST
"""No manifest document is larger (decoded JSON): a larger one is corrupt."""
MAX_MANIFEST_OBJECT = _MAX_MANIFEST  # compressed, it is never larger: a bigger object is not one


@dataclass(frozen=True, slots=True)
class ExtentEntry:
    """A run of bytes stored as chunks of ``chunk_size`` (the first and last may be shorter).

    ``phase`` (0 unless the extent is a shard of a larger tensor) is where the
    extent starts on the chunk grid: see :func:`casckpt.format.chunks.chunk_spans`.
    """

    nbytes: int
    chunk_size: int
    chunks: tuple[bytes, ...]
    phase: int = 0
    packed: bool = False  # small tensors packed together: each restores as its own tensor

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each chunk within the extent, in chunk order."""
        return list(chunk_spans(self.nbytes, self.chunk_size, self.phase))

    def covering(self, start: int, end: int) -> range:
        """Indices of the chunks holding bytes ``[start, end)`` of the extent."""
        if end <= start:
            return range(0)
        first = (start + self.phase) // self.chunk_size
        last = (end - 1 + self.phase) // self.chunk_size
        return range(first, last + 1)


@dataclass(frozen=True, slots=True)
class World:
    """How many ranks saved a version, and through which API (``dcp`` or ``group``)."""

    size: int
    api: str


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor: a typed, shaped view of bytes in an extent.

    ``stride`` is None for a contiguous tensor starting at ``offset``.

    A shard of a larger tensor (saved by many ranks) also records the whole
    tensor's ``global_shape`` and where the shard starts in it
    (``global_offset``); ``shape`` is then the shard's own. ``rank`` is the
    rank that saved the entry, in versions saved by a process group.
    """

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    extent: int
    offset: int = 0
    stride: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    rank: int | None = None
    digest: bytes | None = None  # the chunk id of its own bytes, for a tensor in a packed extent

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def is_shard(self) -> bool:
        """Whether the entry is one piece of a tensor sharded across ranks."""
        return self.global_shape is not None


@dataclass(frozen=True, slots=True)
class TreeHead:
    """What a tree manifest says about its tree: the root node, and what it holds."""

    root: bytes
    tensors: int
    nbytes: int
    shared: tuple[ExtentEntry, ...] = ()  # extents several tensors share (views of one storage)
    groups: tuple[tuple[str, int, int], ...] | None = None  # (path head, tensors, bytes); None: not kept
    values: tuple[tuple[str, Any], ...] | None = None  # (path, plain-value node); None: not kept


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to rebuild one version's state tree, except chunk bytes."""

    run: str
    step: int
    parent: str | None
    created_at: float
    root: Node
    tensors: tuple[TensorEntry, ...]
    extents: tuple[ExtentEntry, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    message: str | None = None
    tags: tuple[str, ...] = ()
    world: World | None = None
    tree: TreeHead | None = None  # a tree manifest's root node (None: versions 1 and 2)
    nodes: tuple[bytes, ...] = ()  # a tree manifest's nodes (chunks too: gc keeps them, check reads them)

    def chunk_ids(self) -> Iterator[bytes]:
        """Every chunk the version needs: its extents' chunks, then its tree nodes."""
        for b in self.extents:
            yield from b.chunks
        yield from self.nodes

    @property
    def logical_bytes(self) -> int:
        """Bytes of tensor data (each tensor counted in full, as torch.save would; a
        sharded tensor as the sum of its shards)."""
        return sum(
            t.numel * element_size(t.kind, t.dtype) for t in self.tensors
        )

    @property
    def uses_v2(self) -> bool:
        """Whether the manifest needs format version 2 (older readers could not read it)."""
        return self.world is not None or any(
            t.is_shard or t.rank is not None for t in self.tensors) or any(b.phase for b in self.extents)


def _extent_json(b: ExtentEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"nbytes": b.nbytes, "chunk_size": b.chunk_size,
                           "chunks": [c.hex() for c in b.chunks]}
    if b.phase:
        doc["phase"] = b.phase
    return doc


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "path": t.path, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
        "blob": t.extent, "offset": t.offset,
        "stride": list(t.stride) if t.stride is not None else None,
    }
    if t.global_shape is not None and t.global_offset is not None:
        doc["global_shape"], doc["global_offset"] = list(t.global_shape), list(t.global_offset)
    if t.rank is not None:
        doc["rank"] = t.rank
    return doc


def _to_json(m: Manifest) -> dict[str, Any]:
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION if m.uses_v2 else 1,
        "run": m.run,
        "step": m.step,
        "parent": m.parent,
        "created_at": m.created_at,
        "metadata": dict(m.metadata),
        "metrics": dict(m.metrics),
        "message": m.message,
        "tags": list(m.tags),
        "root": m.root,
        "blobs": [_extent_json(b) for b in m.extents],
        "tensors": [_tensor_json(t) for t in m.tensors],
    }
    if m.world is not None:
        doc["world"] = {"size": m.world.size, "api": m.world.api}
    return doc


def encode_manifest(m: Manifest) -> tuple[str, bytes]:
    """Return ``(version_id, compressed_bytes)`` for a manifest."""
    text = json.dumps(_to_json(m), sort_keys=True, separators=(",", ":"), allow_nan=False)
    raw = text.encode("utf-8")
    return object_id(raw), zstandard.ZstdCompressor(level=3).compress(raw)


def _decompress(data: bytes) -> bytes:
    """The manifest JSON (at most :data:`_MAX_MANIFEST` bytes, see :func:`decompress_capped`)."""
    return decompress_capped(data, _MAX_MANIFEST, "manifest")


def decompress_capped(data: bytes, limit: int, what: str) -> bytes:
    """zstd ``data`` decompressed a piece at a time: a frame's declared size is never trusted
    to allocate, and more than ``limit`` bytes is refused.

    Raises:
        CorruptManifestError: ``what`` (for the message) does not decompress, or passes ``limit``.
    """
    parts, total = [], 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        while piece := reader.read(1 << 20):
            total += len(piece)
            if total > limit:
                raise CorruptManifestError(f"{what} decompresses to more than {limit} bytes; it is corrupt")
            parts.append(piece)
    except zstandard.ZstdError as exc:
        raise CorruptManifestError(f"{what} does not decompress: {exc}") from exc
    return b"".join(parts)


def decode_manifest(data: bytes, expected_id: str | None = None,
                    nodes: NodeSource | None = None) -> Manifest:
    """Decode and validate compressed manifest bytes.

    Only what :func:`encode_manifest` can write is accepted: every field of
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
            from casckpt.format.treemanifest import from_tree_json  # it builds on this module

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
            f"manifest nests deeper than any committed state tree can (over "
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


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    return None if value is None else _str(value, what)


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} is not an integer")
    return value


def _ints(values: Any, what: str) -> tuple[int, ...]:
    return tuple(_int(v, what) for v in _list(values, what))


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is not a finite number")
    return float(value)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is not a list")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _chunk_id(value: Any) -> bytes:
    if not isinstance(value, str) or len(value) != 64 or not HEX_DIGITS.issuperset(value):
        raise ValueError(f"chunk id {value!r:.70} is not 64 hex digits")
    return bytes.fromhex(value)


def _from_json(doc: dict[str, Any]) -> Manifest:
    extents = tuple(_extent_from_json(_dict(b, "extent")) for b in _list(doc["blobs"], "blobs"))
    tensors = tuple(_tensor_from_json(_dict(t, "tensor")) for t in _list(doc["tensors"], "tensors"))
    world = doc.get("world")
    metrics = _dict(doc["metrics"], "metrics")
    return Manifest(
        run=_str(doc["run"], "run"), step=_int(doc["step"], "step"), parent=_opt_str(doc["parent"], "parent"),
        created_at=_number(doc["created_at"], "created_at"), root=_dict(doc["root"], "root"), tensors=tensors,
        extents=extents, metadata=_dict(doc["metadata"], "metadata"),
        metrics={k: v for k, v in metrics.items() if _number(v, f"metric {k!r}") is not None},
        message=_opt_str(doc["message"], "message"),
        tags=tuple(_str(t, "tag") for t in _list(doc.get("tags", []), "tags")),
        world=None if world is None else World(
            _int(_dict(world, "world")["size"], "world size"), _str(world["api"], "world api")),
    )


def _extent_from_json(b: dict[str, Any]) -> ExtentEntry:
    return ExtentEntry(_int(b["nbytes"], "extent nbytes"), _int(b["chunk_size"], "extent chunk_size"),
                       tuple(_chunk_id(c) for c in _list(b["chunks"], "extent chunks")),
                       _int(b.get("phase", 0), "extent phase"))


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
