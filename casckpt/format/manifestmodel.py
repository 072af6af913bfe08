"""The manifest's values and limits: what a decoded manifest is, shared by the document codec
(:mod:`casckpt.format.manifest`), its checks (:mod:`casckpt.format.manifestcheck`) and the
tree manifest codec (:mod:`casckpt.format.treemanifest`). No I/O; imports no other manifest
module, so each of those builds on this one without a cycle.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zstandard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import chunk_spans
from casckpt.format.dtypes import element_size
from casckpt.format.state import Node

HEX_DIGITS = frozenset("0123456789abcdef")
MANIFEST_FORMAT = "casckpt.manifest"
TREE_VERSION = 3  # a tree manifest: the state as shared nodes (casckpt.format.merkle)
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
    """Everything needed to rebuild one version's state, except chunk bytes."""

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
    hinted: Mapping[str, bytes] = field(default_factory=dict)
    """Path -> fingerprint of the bytes the caller handed the commit, for each tensor whose
    chunks a change hint made it reuse unread (:mod:`casckpt.format.hintsample`; a tree
    manifest's optional ``"hinted"``, which readers that predate it ignore)."""

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


def _header_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Manifest` fields every document version holds alike, each checked."""
    metrics, world = _dict(doc["metrics"], "metrics"), doc.get("world")
    return {
        "run": _str(doc["run"], "run"), "step": _int(doc["step"], "step"),
        "parent": _opt_str(doc["parent"], "parent"), "created_at": _number(doc["created_at"], "created_at"),
        "metadata": _dict(doc["metadata"], "metadata"),
        "metrics": {k: v for k, v in metrics.items() if _number(v, f"metric {k!r}") is not None},
        "message": _opt_str(doc["message"], "message"),
        "tags": tuple(_str(t, "tag") for t in _list(doc.get("tags", []), "tags")),
        "world": None if world is None else World(
            _int(_dict(world, "world")["size"], "world size"), _str(world["api"], "world api")),
    }


def _extent_from_json(b: dict[str, Any]) -> ExtentEntry:
    return ExtentEntry(_int(b["nbytes"], "extent nbytes"), _int(b["chunk_size"], "extent chunk_size"),
                       tuple(_chunk_id(c) for c in _list(b["chunks"], "extent chunks")),
                       _int(b.get("phase", 0), "extent phase"))
