"""Manifests: a version's tree, tensors and chunk lists, as versioned JSON.

A manifest is self-describing and never pickled. Tensors reference *blobs*:
a blob is a run of bytes cut into chunks. A tensor normally owns one blob
holding its contiguous bytes; tensors that are views of one storage share a
blob covering the span they use, each recording its byte offset and strides,
so shared storage is written once and restored shared.

The manifest's JSON bytes are hashed (object context) to give the version id;
the blob store keeps them zstd-compressed under ``manifests/<id>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zstandard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import object_id
from casckpt.format.dtypes import element_size
from casckpt.format.tree import Node

MANIFEST_FORMAT = "casckpt.manifest"
MANIFEST_VERSION = 1
_MAX_MANIFEST = 1 << 31


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """A run of bytes stored as chunks of ``chunk_size`` (the last may be shorter)."""

    nbytes: int
    chunk_size: int
    chunks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor: a typed, shaped view of bytes in a blob.

    ``stride`` is None for a contiguous tensor starting at ``offset``.
    """

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    blob: int
    offset: int = 0
    stride: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to rebuild one version's state tree, except chunk bytes."""

    run: str
    step: int
    parent: str | None
    created_at: float
    root: Node
    tensors: tuple[TensorEntry, ...]
    blobs: tuple[BlobEntry, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    message: str | None = None
    tags: tuple[str, ...] = ()

    @property
    def logical_bytes(self) -> int:
        """Bytes of tensor data (each tensor counted in full, as torch.save would)."""
        return sum(
            t.numel * element_size(t.kind, t.dtype) for t in self.tensors
        )


def _to_json(m: Manifest) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "run": m.run,
        "step": m.step,
        "parent": m.parent,
        "created_at": m.created_at,
        "metadata": dict(m.metadata),
        "metrics": dict(m.metrics),
        "message": m.message,
        "tags": list(m.tags),
        "root": m.root,
        "blobs": [
            {"nbytes": b.nbytes, "chunk_size": b.chunk_size, "chunks": [c.hex() for c in b.chunks]}
            for b in m.blobs
        ],
        "tensors": [
            {
                "path": t.path, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
                "blob": t.blob, "offset": t.offset,
                "stride": list(t.stride) if t.stride is not None else None,
            }
            for t in m.tensors
        ],
    }


def encode_manifest(m: Manifest) -> tuple[str, bytes]:
    """Return ``(version_id, compressed_bytes)`` for a manifest."""
    text = json.dumps(_to_json(m), sort_keys=True, separators=(",", ":"), allow_nan=False)
    raw = text.encode("utf-8")
    return object_id(raw), zstandard.ZstdCompressor(level=3).compress(raw)


def decode_manifest(data: bytes, expected_id: str | None = None) -> Manifest:
    """Decode and validate compressed manifest bytes.

    Raises:
        CorruptManifestError: the bytes do not decompress, do not hash to
            ``expected_id``, or describe something impossible.
    """
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=_MAX_MANIFEST)
    except zstandard.ZstdError as exc:
        raise CorruptManifestError(f"manifest does not decompress: {exc}") from exc
    if expected_id is not None and object_id(raw) != expected_id:
        raise CorruptManifestError(
            f"manifest of version {expected_id[:12]} does not match its id; it is corrupt"
        )
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a casckpt manifest")
        if doc.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"manifest version {doc.get('version')} is not supported by this casckpt "
                f"(reads version {MANIFEST_VERSION}); upgrade casckpt"
            )
        manifest = _from_json(doc)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise CorruptManifestError(f"manifest is malformed: {exc}") from exc
    _validate(manifest)
    return manifest


def _from_json(doc: dict[str, Any]) -> Manifest:
    blobs = tuple(
        BlobEntry(int(b["nbytes"]), int(b["chunk_size"]), tuple(bytes.fromhex(c) for c in b["chunks"]))
        for b in doc["blobs"]
    )
    tensors = tuple(
        TensorEntry(
            str(t["path"]), str(t["kind"]), str(t["dtype"]), tuple(int(s) for s in t["shape"]),
            int(t["blob"]), int(t["offset"]),
            tuple(int(s) for s in t["stride"]) if t["stride"] is not None else None,
        )
        for t in doc["tensors"]
    )
    return Manifest(
        run=str(doc["run"]), step=int(doc["step"]), parent=doc["parent"],
        created_at=float(doc["created_at"]), root=doc["root"], tensors=tensors, blobs=blobs,
        metadata=doc["metadata"], metrics=doc["metrics"], message=doc["message"],
        tags=tuple(doc.get("tags", ())),
    )


def tensor_extent(t: TensorEntry, itemsize: int) -> int:
    """Bytes from the tensor's offset to one past its last element."""
    if t.numel == 0:
        return 0
    if t.stride is None:
        return t.numel * itemsize
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True)) + 1) * itemsize


def _tensor_indices(root: Node) -> Iterator[int]:
    """Every tensor index the node tree uses (iteratively: a forged tree may be deep)."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            raise CorruptManifestError("manifest tree holds a node that is not an object")
        kind = node.get("t")
        if kind == "tensor":
            index = node.get("i")
            if not isinstance(index, int) or isinstance(index, bool):
                raise CorruptManifestError("manifest tensor node has no integer index")
            yield index
        elif kind in ("dict", "list", "tuple"):
            children = node.get("v")
            if not isinstance(children, list):
                raise CorruptManifestError(f"manifest {kind} node has no item list")
            stack.extend(children)


def _validate(m: Manifest) -> None:
    used = sorted(_tensor_indices(m.root))
    if used != list(range(len(m.tensors))):
        raise CorruptManifestError(
            "manifest tree and tensor list disagree (each tensor must appear exactly once)"
        )
    for i, b in enumerate(m.blobs):
        expected = -(-b.nbytes // b.chunk_size) if b.chunk_size > 0 else -1
        if b.nbytes < 0 or b.chunk_size <= 0 or len(b.chunks) != expected:
            raise CorruptManifestError(f"manifest blob {i} has inconsistent sizes")
        if any(len(c) != 32 for c in b.chunks):
            raise CorruptManifestError(f"manifest blob {i} has a malformed chunk id")
    for t in m.tensors:
        if t.kind not in ("torch", "numpy") or not 0 <= t.blob < len(m.blobs):
            raise CorruptManifestError(f"manifest tensor {t.path!r} is malformed")
        if any(n < 0 for n in t.shape) or (t.stride is not None and (
            len(t.stride) != len(t.shape) or any(s < 0 for s in t.stride)
        )):
            raise CorruptManifestError(f"manifest tensor {t.path!r} has a bad shape or stride")
        itemsize = element_size(t.kind, t.dtype)
        if t.offset < 0 or t.offset % itemsize or (
            t.offset + tensor_extent(t, itemsize) > m.blobs[t.blob].nbytes
        ):
            raise CorruptManifestError(f"manifest tensor {t.path!r} lies outside its blob")
