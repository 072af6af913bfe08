"""Golden data: the store casckpt 0.1 wrote (tests/golden/store-0.1, made by
tests/golden/make_store.py) must open and restore bit-exact in every later release, and
manifest encodings keep their pinned ids."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from benchmarks.oldformats import encode_manifest
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry
from casckpt.format.state import encode_state, iter_leaves
from casckpt.format.treemanifest import encode_tree_manifest

GOLDEN = Path(__file__).parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))
from make_store import state  # noqa: E402

VERSIONS = {  # ref -> the version id casckpt 0.1 gave it (the object id of its manifest)
    "main@0": "9dcde7b35baf80b85daca716e317086436580d14c909b6dcc749f5298bb33a6f",  # format 1
    "main@1": "ce25bea73ea246ddd16747e6440f0b83de1ec6081f6d8535cd156cd8a32d9b3b",
    "main@2": "c02a3ed133d79f5b177fa6c3c3bb928f88ad159d7a00c64b725f936437725076",
    "main@3": "4d9e10d29464e38e3c8e0007bd5919945e133006fcd622c559e2bce6eabaeccd",
    "ft@5": "198ea6e7e7182f201915db6f87e019db2b6c07e2901eed872e6cdf68a903cd95",
}


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    """A copy of the golden store (opening it may upgrade its catalog: never the original)."""
    copy = tmp_path / "store-0.1"
    shutil.copytree(GOLDEN / "store-0.1", copy)
    return copy


def _same(a: object, b: object) -> None:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    assert la.keys() == lb.keys()
    for path, x in la.items():
        y = lb[path]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                               y.contiguous().view(-1).view(torch.uint8) if y.numel() else y), path
        else:
            assert type(x) is type(y) and x == y, path


def test_the_golden_store_opens_and_restores_bit_exact(golden: Path) -> None:
    with casckpt.open(golden, create=False) as store:
        assert {f"{v.run}@{v.step}": v.id for v in store.log()} == VERSIONS
        for ref, version_id in VERSIONS.items():
            back = store.restore(version_id)
            _same(back, state(int(ref.split("@")[1])))
            assert back["model"]["embed.weight"].data_ptr() == back["model"]["head.weight"].data_ptr()
        assert store.resolve("tag:best").id == VERSIONS["main@3"]
        assert store.resolve("ft@5").parent == VERSIONS["main@2"]
        assert store.retention.get("main") == casckpt.RetentionPolicy(keep_last=10)
        assert torch.equal(store.load_tensor("main@3", "model.experts.e7"), torch.full((4,), 7.0))
        assert [c.path for c in store.diff("main@2", "main@3").changed] == [
            "model.layers.0.w", "model.layers.1.w", "model.layers.2.w", "optim.mask", "optim.step"]
        assert store.ops.check(read_data=True).ok


def test_the_golden_store_migrates_its_old_version_and_still_restores(golden: Path) -> None:
    with casckpt.open(golden, create=False) as store:
        report = store.ops.migrate_trees()
        assert report.versions_migrated == 1 and store.ops.stats().versions_without_tree == 0
        _same(store.restore("main@0"), state(0))
        assert store.ops.check(read_data=True).ok


def _manifest(tree_state: Any) -> Manifest:
    root, leaves = encode_state(tree_state)
    tensors = tuple(TensorEntry(leaf.path, "torch", "float32", tuple(leaf.value.shape), i)
                    for i, leaf in enumerate(leaves))
    extents = tuple(ExtentEntry(4 * leaf.value.numel(), 1 << 20, (bytes([i]) * 32,))
                    for i, leaf in enumerate(leaves))
    return Manifest("golden", 3, "a" * 64, 1700000000.5, root, tensors, extents,
                    metadata={"k": [1, "x"]}, metrics={"loss": 0.25}, message="pinned", tags=("t",))


def test_manifest_encodings_keep_their_pinned_ids() -> None:
    """A format change that alters what an existing state encodes to changes every version id
    a new commit of it gets, and breaks dedup of manifests across releases: decide it, then
    pin the new ids."""
    pinned = _manifest({"model": {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, "lr": 0.5, "n": [1, 2]})
    assert encode_manifest(pinned)[0] == FORMAT_1_ID
    assert encode_tree_manifest(pinned)[0] == FORMAT_3_ID


FORMAT_1_ID = "2cbab0ac1769f5bc4f7397bb3aa89bbce5fecf91c71037d5bf835016295e0658"
FORMAT_3_ID = "e256f71fda381503a4a56ea807c1c92335cbea5d834296366ca8193b5549ae01"
