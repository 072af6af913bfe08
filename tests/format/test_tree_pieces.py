"""Tree manifests of versions many ranks saved: tensors in pieces (``sharded`` values) and
per-rank states (a ``ranks`` root) round-trip through the encoder and the readers, and the
tree walkers (find, leaves, diff, gc's mark) see what the whole manifest holds."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import object_id
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, World, decode_manifest
from casckpt.format.merkle import Nodes, NodeSource
from casckpt.format.state import Node, rank_path
from casckpt.format.treemanifest import encode_tree_manifest
from casckpt.format.treeread import TreeReader, referenced


class _Dict(NodeSource):
    def __init__(self, nodes: Mapping[bytes, bytes]) -> None:
        self.nodes = nodes

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        return {i: self.nodes[i] for i in ids if i in self.nodes}


def _extent(seed: int, nbytes: int) -> ExtentEntry:
    count = max(1, math.ceil(nbytes / 64))
    return ExtentEntry(nbytes, 64, tuple(bytes([seed % 256, n % 256]) * 16 for n in range(count)))


class _Builder:
    """Builds a manifest's tensors and extents while drawing its tree."""

    def __init__(self) -> None:
        self.tensors: list[TensorEntry] = []
        self.extents: list[ExtentEntry] = []

    def tensor(self, path: str, rows: int, rank: int | None, whole: tuple[int, int] | None = None,
               at: int = 0) -> int:
        self.extents.append(_extent(len(self.extents), rows * 4 * 3))
        self.tensors.append(TensorEntry(path, "torch", "float32", (rows, 3), len(self.extents) - 1,
                                        global_shape=whole, global_offset=(at, 0) if whole else None,
                                        rank=rank))
        return len(self.tensors) - 1

    def state(self, draw: Any, rank: int | None, pieces: bool) -> Node:
        keys: list[Any] = []
        values: list[Node] = []
        for n, key in enumerate(draw(st.lists(st.sampled_from(["w", "b", "emb", "x1", "y"]), min_size=1,
                                              max_size=4, unique=True))):
            keys.append(key)
            kind = draw(st.sampled_from(["tensor", "value", "list"] + (["sharded"] if pieces else [])))
            if kind == "tensor":
                values.append({"t": "tensor", "i": self.tensor(key, n + 1, rank)})
            elif kind == "value":
                values.append({"t": "int", "v": n} if n % 2 else {"t": "str", "v": key})
            elif kind == "list":
                values.append({"t": "list", "v": [{"t": "tensor", "i": self.tensor(f"{key}.0", 2, rank)},
                                                  {"t": "str", "v": "x"}]})
            else:
                sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                whole = (sum(sizes), 3)
                values.append({"t": "sharded", "i": [self.tensor(key, s, None, whole, a)
                                                     for s, a in zip(sizes, starts, strict=True)]})
        return {"t": "dict", "k": keys, "v": values}


@st.composite
def saved_by_ranks(draw: Any) -> Manifest:
    build = _Builder()
    if draw(st.booleans()):  # a group commit: one state per rank (some the same)
        ranks = draw(st.integers(1, 4))
        root: Node = {"t": "ranks", "v": [build.state(draw, r, False) for r in range(ranks)]}
        world = World(ranks, "group")
    else:  # a DCP save: tensors in pieces
        root = build.state(draw, None, True)
        world = World(draw(st.integers(1, 8)), "dcp")
    return Manifest("r", 3, None, 1.5, root, tuple(build.tensors), tuple(build.extents), world=world)


@settings(max_examples=60, deadline=None)
@given(m=saved_by_ranks())
def test_pieces_and_ranks_round_trip_through_a_tree_manifest(m: Manifest) -> None:
    version_id, data, tree = encode_tree_manifest(m)
    back = decode_manifest(data, version_id, _Dict(tree.nodes))
    assert back.world == m.world and back.root == m.root
    assert back.tensors == m.tensors and back.extents == m.extents
    head = decode_manifest(data, version_id)
    assert head.world == m.world and head.tree is not None and head.tree.groups is None
    # gc's mark reaches every chunk, the walkers every tensor by its shown path
    assert {c for e in m.extents for c in e.chunks} <= set(referenced(_Dict(tree.nodes), tree.root, set()))
    reader = TreeReader(Nodes(_Dict(tree.nodes)))
    for t in m.tensors:
        shown = rank_path(t.rank, t.path) if t.rank is not None else t.path
        hit = reader.find_tensor(tree.root, shown)
        assert hit is not None and hit[0] == shown
        assert hit[1]["t"] == ("sharded" if t.is_shard else "tensor")
    leaves = reader.leaves(reader.node(tree.root)["v"])
    shown_paths = {p for p, v in leaves if v.get("t") in ("tensor", "sharded")}
    assert shown_paths == {rank_path(t.rank, t.path) if t.rank is not None else t.path for t in m.tensors}


def test_a_diff_of_ranks_names_each_ranks_paths() -> None:
    build = _Builder()
    a = Manifest("r", 1, None, 1.0, {"t": "ranks", "v": [
        {"t": "dict", "k": ["w"], "v": [{"t": "tensor", "i": build.tensor("w", 1, r)}]} for r in range(2)]},
        tuple(build.tensors), tuple(build.extents), world=World(2, "group"))
    moved = TensorEntry("w", "torch", "float32", (1, 3), 2, rank=1)  # rank 1's w changed
    changed = Manifest("r", 2, None, 1.0, a.root, (a.tensors[0], moved), (*a.extents, _extent(9, 12)),
                       world=a.world)
    _, _, ta = encode_tree_manifest(a)
    _, _, tb = encode_tree_manifest(changed)
    reader = TreeReader(Nodes(_Dict({**ta.nodes, **tb.nodes})))
    assert [p for p, _, _ in reader.differences(ta.root, tb.root)] == ["rank1/w"]


def test_pieces_without_a_world_are_refused_both_ways() -> None:
    build = _Builder()
    i = build.tensor("w", 2, None, (4, 3), 0)
    m = Manifest("r", 1, None, 1.0, {"t": "dict", "k": ["w"], "v": [{"t": "sharded", "i": [i]}]},
                 tuple(build.tensors), tuple(build.extents), world=World(2, "dcp"))
    with pytest.raises(ValueError, match="world"):
        encode_tree_manifest(Manifest(m.run, m.step, None, 1.0, m.root, m.tensors, m.extents))
    version_id, data, tree = encode_tree_manifest(m)
    doc = json.loads(zstandard.ZstdDecompressor().decompress(data))
    del doc["world"]
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptManifestError, match="world"):
        decode_manifest(zstandard.ZstdCompressor().compress(raw), object_id(raw), _Dict(tree.nodes))
