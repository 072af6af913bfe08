"""Manifest version 2: shards of tensors saved by many ranks, chunk grids, per-rank trees."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.oldformats import encode_manifest
from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import chunk_count, chunk_spans
from casckpt.format.manifest import (
    ExtentEntry,
    Manifest,
    TensorEntry,
    World,
    decode_manifest,
    rank_count,
    rank_view,
    sharding,
)

PROPERTY = settings(max_examples=200, deadline=None)


def _cid(i: int) -> bytes:
    return bytes([i]) * 32


def _sharded() -> Manifest:
    """``w`` (10, 4) float32 in two dim-0 shards on a 64-byte grid, and a plain value."""
    root = {"t": "dict", "k": ["w", "step"], "v": [{"t": "sharded", "i": [0, 1]}, {"t": "int", "v": 7}]}
    return Manifest(
        run="r", step=1, parent=None, created_at=1.0, root=root,
        tensors=(
            TensorEntry("w", "torch", "float32", (6, 4), 0, global_shape=(10, 4), global_offset=(0, 0)),
            TensorEntry("w", "torch", "float32", (4, 4), 1, global_shape=(10, 4), global_offset=(6, 0)),
        ),
        extents=(ExtentEntry(96, 64, (_cid(1), _cid(2))), ExtentEntry(64, 64, (_cid(2), _cid(3)), phase=32)),
        world=World(2, "dcp"),
    )


def _ranks() -> Manifest:
    tree = {"t": "dict", "k": ["x", "pos"], "v": [{"t": "tensor", "i": 0}, {"t": "int", "v": 0}]}
    other = copy.deepcopy(tree)
    other["v"] = [{"t": "tensor", "i": 1}, {"t": "int", "v": 1}]
    return Manifest(
        run="g", step=2, parent=None, created_at=1.0, root={"t": "ranks", "v": [tree, other]},
        tensors=(TensorEntry("x", "torch", "int8", (3,), 0, rank=0),
                 TensorEntry("x", "torch", "int8", (5,), 1, rank=1)),
        extents=(ExtentEntry(3, 64, (_cid(4),)), ExtentEntry(5, 64, (_cid(5),))), world=World(2, "group"),
    )


def _doc(data: bytes) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(zstandard.ZstdDecompressor().decompress(data))
    return result


def _bytes(doc: dict[str, Any]) -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(doc).encode())


@pytest.mark.parametrize("make", [_sharded, _ranks])
def test_version_2_round_trips(make: Any) -> None:
    manifest = make()
    version_id, data = encode_manifest(manifest)
    assert _doc(data)["version"] == 2
    assert decode_manifest(data, version_id) == manifest


def test_rank_view_is_one_ranks_state_renumbered() -> None:
    manifest = _ranks()
    assert rank_count(manifest) == 2 and rank_count(_sharded()) is None
    view = rank_view(manifest, 1)
    assert view.root["v"][0] == {"t": "tensor", "i": 0} and view.tensors == (manifest.tensors[1],)
    assert view.extents == manifest.extents  # entries keep pointing at the version's extents
    with pytest.raises(IndexError):
        rank_view(manifest, 2)


def test_sharding_names_the_cut_dimensions() -> None:
    assert sharding(_sharded()) == {"w": (2, (0,))}
    assert sharding(_ranks()) == {}


def _damage(doc: dict[str, Any], how: str) -> None:
    tensors, extents = doc["tensors"], doc["blobs"]
    if how == "shard_outside":
        tensors[1]["global_offset"] = [7, 0]
    elif how == "shard_rank_mismatch":
        tensors[1]["global_shape"] = [11, 4]
    elif how == "shard_alone":
        doc["root"]["v"][0] = {"t": "tensor", "i": 0}
        doc["root"]["v"].append({"t": "tensor", "i": 1})
        doc["root"]["k"].append("z")
    elif how == "plain_in_sharded":
        del tensors[1]["global_shape"]
    elif how == "sharded_no_list":
        doc["root"]["v"][0]["i"] = 0
    elif how == "phase_too_big":
        extents[1]["phase"] = 64
    elif how == "phase_wrong_count":
        extents[1]["phase"] = 0  # 64 bytes from 0 on a 64-byte grid is one chunk, not two
    elif how == "ranks_below_root":
        doc["root"]["v"][1] = {"t": "ranks", "v": []}
    elif how == "shard_gap":
        tensors[1]["shape"] = [3, 4]  # rows 9.. are in no shard
    elif how == "shard_overlap":
        tensors[1]["global_offset"] = [5, 0]
        tensors[1]["global_shape"] = tensors[0]["global_shape"] = [10, 4]
        tensors[0]["shape"] = [6, 4]
    elif how == "impossibly_large":
        tensors[0]["global_shape"] = tensors[1]["global_shape"] = [1 << 30, 1 << 30]
    elif how == "dict_keys_short":
        doc["root"]["k"] = doc["root"]["k"][:1]
    elif how == "bad_world":
        doc["world"] = {"size": 0, "api": "dcp"}
    elif how == "unknown_api":
        doc["world"] = {"size": 2, "api": "mpi"}


@pytest.mark.parametrize("how", ["shard_outside", "shard_rank_mismatch", "shard_alone", "plain_in_sharded",
                                 "sharded_no_list", "phase_too_big", "phase_wrong_count", "ranks_below_root",
                                 "shard_gap", "shard_overlap", "impossibly_large", "dict_keys_short",
                                 "bad_world", "unknown_api"])
def test_impossible_sharded_manifest_is_refused(how: str) -> None:
    _, data = encode_manifest(_sharded())
    doc = _doc(data)
    _damage(doc, how)
    with pytest.raises(CorruptManifestError):
        decode_manifest(_bytes(doc))


@given(whole=st.integers(0, 5000), chunk=st.integers(1, 300),
       cuts=st.lists(st.integers(0, 5000), max_size=6))
@PROPERTY
def test_shards_chunked_on_the_whole_grid_share_every_uncut_chunk(
        whole: int, chunk: int, cuts: list[int]) -> None:
    """Cutting a run of bytes anywhere and chunking each piece on the whole run's grid yields
    the whole run's chunks, except those a cut falls inside -- which split in two."""
    grid = list(chunk_spans(whole, chunk))
    bounds = sorted({0, whole, *(c for c in cuts if c < whole)})
    pieces = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        spans = list(chunk_spans(end - start, chunk, start % chunk))
        assert len(spans) == chunk_count(end - start, chunk, start % chunk)
        assert spans[0][0] == 0 and spans[-1][1] == end - start
        assert all(a < b and b - a <= chunk for a, b in spans)
        assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))
        pieces += [(start + a, start + b) for a, b in spans]
    cut_inside = {span for span in grid if any(span[0] < c < span[1] for c in bounds)}
    assert {p for p in pieces if p in grid} == set(grid) - cut_inside
    assert len(pieces) == len(grid) + sum(1 for c in bounds[1:-1] if c % chunk)
    extent = ExtentEntry(whole, chunk, tuple(_cid(0) for _ in grid))
    for start, end in zip(bounds, bounds[1:], strict=False):
        touched = [s for s in grid if s[0] < end and start < s[1]]
        assert [grid[i] for i in extent.covering(start, end)] == touched
