"""Copying versions saved before casckpt wrote trees (manifest formats 1 and 2) between stores
keyed alike: each arrives as the same version (its document as it is), migrated to the tree
``casckpt catalog migrate-trees`` gives it whether or not the source migrated it, restores
bit-exact from the destination alone, answers log/show/diff/history there as the source does,
and ``check`` is clean there.

The sources are the golden stores the writers of those formats made: tests/golden/store-formats
(one-process format 1, a DCP save and a group commit in format 2) and
tests/golden/store-legacy/tree-migration (format 1: a run, a fork, a tag, delta-coded chunks).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.catalog.treemigrate import tree_root
from casckpt.format.state import iter_leaves
from casckpt.testing.internals import internals

GOLDEN = Path(__file__).parents[2] / "golden"
sys.path.insert(0, str(GOLDEN))
from make_formats import dcp_state, one_state, rank_state  # noqa: E402
from make_legacy import OPTIONS, TREE_REFS, legacy, tree_state  # noqa: E402

FORMATS = {"one@0": "6f825969146674446bd87269294bb1253d1460cbef3744f21f24f4f3ce0095b0",  # format 1
           "dcp@1": "0d7f27b4dce508a17f6a8e671d50afea2ebfff911f9ebc1dd6b0fb73d5ab2e1e",  # format 2, DCP
           "grp@2": "2bc05dfba8d2f14f98300e803b487ad872228f974e422cdefebe413aff4b2003"}  # format 2, group=
LEGACY = OPTIONS["tree-migration"]


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _same(a: object, b: object) -> None:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    assert la.keys() == lb.keys()
    for path, x in la.items():
        y = lb[path]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and (x.dtype, x.shape) == (y.dtype, y.shape), path
            assert _bits(x) == _bits(y), path
        else:
            assert type(x) is type(y) and x == y, path


def _roots(store: casckpt.Store) -> dict[str, str | None]:
    catalog = internals(store).catalog
    return {v.id: tree_root(catalog, v.id) for v in store.log()}


def _shown(store: casckpt.Store, refs: list[str]) -> dict[str, Any]:
    out = {}
    for ref in refs:
        d = store.show(ref)
        out[ref] = (d.tensors, d.values, d.tensor_count, d.tensor_bytes, d.world_size, d.saved_with)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("migrated", [False, True], ids=["unmigrated", "migrated"])
def test_versions_of_formats_1_and_2_copy_as_the_same_versions(tmp_path: Path, migrated: bool) -> None:
    source = tmp_path / "src"
    shutil.copytree(GOLDEN / "store-formats", source)
    with casckpt.open(source, create=False) as src, casckpt.open(tmp_path / "dst") as dst:
        if migrated:
            src.ops.migrate_trees()
        report = src.copy(["one", "dcp", "grp"], to=dst)
        assert sorted(v.id for v in report.versions if v.sent) == sorted(FORMATS.values())
        assert report.ids == {i: i for i in FORMATS.values()}  # the documents travelled as they are
        assert dst.ops.stats().versions_without_tree == 0  # the destination holds them migrated
        if not migrated:  # the tree the copy derived is the one migrate-trees gives the source
            src.ops.migrate_trees()
        assert _roots(dst) == _roots(src)
        assert _shown(dst, list(FORMATS)) == _shown(src, list(FORMATS))
        assert src.copy(["one", "dcp", "grp"], to=dst).nothing_sent
    shutil.rmtree(source)
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert {f"{v.run}@{v.step}": v.id for v in dst.log()} == FORMATS
        _same(dst.restore("one@0"), one_state())
        whole = dcp_state()
        flat = {f"{k}.{n}": x for k, v in whole.items() if isinstance(v, dict) for n, x in v.items()}
        _same(dst.restore("dcp@1"), {**flat, **{k: v for k, v in whole.items() if not isinstance(v, dict)}})
        assert _bits(dst.load_tensor("dcp@1", "model.emb")) == _bits(whole["model.emb"])
        for rank in (0, 1):
            _same(dst.restore("grp@2", rank=rank), rank_state(rank))
        assert dst.show("dcp@1").world_size == 2 and dst.show("grp@2").saved_with == "group"
        assert dst.ops.check(read_data=True).ok


def _answers(store: casckpt.Store) -> dict[str, Any]:
    """What queries say about the legacy store's versions (compared across the copy)."""
    out: dict[str, Any] = {"log": [(v.id, v.run, v.step, v.parent, v.metadata, v.created_at)
                                   for v in store.log()], "best": store.resolve("tag:best").id}
    for ref in TREE_REFS:
        d = store.show(ref)
        out[f"show {ref}"] = (d.tensors, d.values, d.tensor_count, d.tensor_bytes)
    for a, b in (("r@0", "r@1"), ("r@1", "r@3"), ("r@1", "f@7"), ("r@3", "f@8")):
        d = store.diff(a, b)
        out[f"diff {a} {b}"] = (d.added, d.removed, d.changed, d.unchanged, d.changed_bytes)
    for run in ("r", "f"):
        for path in ("model.layers.l1.w", "model.w", "model.head"):
            out[f"history {run} {path}"] = [(e.version.id, e.change, e.digest)
                                            for e in store.history(run, path)]
    return out


@pytest.mark.parametrize("migrated", [False, True], ids=["unmigrated", "migrated"])
def test_a_run_of_format_1_copies_with_its_fork_tag_and_lineage(tmp_path: Path, migrated: bool) -> None:
    """The fork's lineage comes first (f@8 brings r@0, r@1, f@7), then the rest of the run; a
    version committed today on top of a format 1 version brings its format 1 ancestors."""
    legacy("tree-migration", tmp_path / "src")
    with casckpt.open(tmp_path / "src", create=False, **LEGACY) as src, \
            casckpt.open(tmp_path / "dst", **LEGACY) as dst:
        if migrated:
            src.ops.migrate_trees()
        ids = {ref: src.resolve(ref).id for ref in TREE_REFS}
        first = src.copy("f@8", to=dst)
        assert [(f"{v.run}@{v.step}", v.asked) for v in first.versions] == [
            ("r@0", False), ("r@1", False), ("f@7", False), ("f@8", True)]
        src.copy("r", to=dst)
        assert {ref: dst.resolve(ref).id for ref in TREE_REFS} == ids
        src.ops.migrate_trees()  # queries of both sides read trees: they answer the same
        assert _answers(dst) == _answers(src)
        src.commit(tree_state(4), run="r", step=4)  # a tree version whose parent is of format 1
        with casckpt.open(tmp_path / "fresh", **LEGACY) as fresh:
            assert [v.step for v in src.copy("r@4", to=fresh).versions] == [0, 1, 2, 3, 4]
            _same(fresh.restore("r@4"), tree_state(4))
            assert fresh.ops.check(read_data=True).ok
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "dst", create=False, **LEGACY) as dst:
        for ref in TREE_REFS:
            _same(dst.restore(ref), tree_state(int(ref.split("@")[1])))
        assert dst.ops.check(read_data=True).ok


def test_a_source_row_naming_another_tree_is_refused(tmp_path: Path) -> None:
    """A migrated version whose row names a tree that is not its document's (a damaged
    catalog): the copy refuses it rather than give the destination a tree check would fail."""
    from sqlalchemy import update

    from casckpt.catalog import schema
    from casckpt.errors import CorruptManifestError

    legacy("tree-migration", tmp_path / "src")
    with casckpt.open(tmp_path / "src", create=False, **LEGACY) as src, \
            casckpt.open(tmp_path / "dst", **LEGACY) as dst:
        src.ops.migrate_trees()
        wrong = tree_root(internals(src).catalog, src.resolve("r@1").id)
        with internals(src).catalog.write() as conn:
            conn.execute(update(schema.versions).where(schema.versions.c.id == src.resolve("r@0").id)
                         .values(tree_root=wrong))
        with pytest.raises(CorruptManifestError, match="catalog rebuild"):
            src.copy("r@0", to=dst)
        assert dst.log() == []
