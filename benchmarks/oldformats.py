"""The writer of manifest formats 1 and 2 (one-process commits before tree manifests; DCP
saves and group commits before they too wrote trees), kept outside the package: casckpt
writes only tree manifests (format 3) and reads every format. Benchmarks build old-format
catalogs with it, and tests use it to make the documents the readers must still accept."""

from __future__ import annotations

import json
from typing import Any

import zstandard

from casckpt.format.chunks import object_id
from casckpt.format.manifestmodel import MANIFEST_FORMAT, ExtentEntry, Manifest, TensorEntry

MANIFEST_VERSION = 2  # written only by versions that used its additions (sharded tensors, ranks)


def uses_v2(m: Manifest) -> bool:
    """Whether the manifest needs format version 2 (older readers could not read it)."""
    return m.world is not None or any(
        t.is_shard or t.rank is not None for t in m.tensors) or any(b.phase for b in m.extents)


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
        "version": MANIFEST_VERSION if uses_v2(m) else 1,
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

