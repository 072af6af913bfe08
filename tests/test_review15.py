"""Review 15: commit memos, the tree summary, tree migration and gc marking through nodes.

Each test reproduces one finding of the review (see the docstrings).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.engine import commit as commit_engine
from casckpt.format.tree import iter_leaves

_BIG = 52 << 20  # bytes whose base64 JSON (69 MiB) passed the 64 MiB a tree node could hold


def _equal(a: object, b: object) -> bool:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    return la.keys() == lb.keys() and all(
        torch.equal(x, lb[k]) and x.dtype == lb[k].dtype if isinstance(x, torch.Tensor) else x == lb[k]
        for k, x in la.items())


def test_migrating_a_version_with_a_large_plain_value_leaves_gc_and_queries_working(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version of format 1 may hold a plain value whose JSON passes MAX_NODE (its document
    may reach 512 MiB). Migrating it gave it a tree node no reader accepts: show raised
    CorruptManifestError ("does not match its id"), and every gc after refused to run
    (GCRefusedError), for a version that restored fine before the migration."""
    state = {"w": torch.arange(6, dtype=torch.float32), "blob": bytes(_BIG)}
    monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", False)
    with casckpt.open(tmp_path / "s") as store:
        store.commit(state, run="r", step=0)
    monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", True)
    with casckpt.open(tmp_path / "s") as store:
        store.ops.migrate_trees()
        store.gc(grace=0)
        shown = store.show("r@0")
        assert shown.tensor_count == 1 and shown.values["blob"] == state["blob"]
        assert _equal(store.restore("r@0"), state)
        assert store.ops.check().ok


def test_a_committed_large_plain_value_restores_or_the_commit_is_refused(tmp_path: Path) -> None:
    """A tree commit whose plain value makes a node larger than MAX_NODE published a version
    that no reader accepts (restore: CorruptManifestError; gc: refused while it is visible)."""
    state = {"w": torch.arange(6, dtype=torch.float32), "blob": bytes(_BIG)}
    with casckpt.open(tmp_path / "s") as store:
        try:
            store.commit(state, run="r", step=0)
        except casckpt.errors.UnsupportedStateError:
            return  # refused before anything was published: fine
        assert _equal(store.restore("r@0"), state)
        store.gc(grace=0)


def test_a_commit_whose_node_no_reader_accepts_is_refused_before_publishing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node over MAX_NODE is refused when the commit encodes it (a typed error, nothing
    published), never written for every reader (and gc) to refuse afterwards."""
    from casckpt.format import merkle, treeencode

    monkeypatch.setattr(merkle, "MAX_NODE", 1 << 20)
    monkeypatch.setattr(treeencode, "MAX_NODE", 1 << 20)
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"w": torch.ones(3)}, run="r", step=0)
        with pytest.raises(casckpt.errors.UnsupportedStateError, match="tree node"):
            store.commit({"w": torch.ones(3), "blob": bytes(1 << 20)}, run="r", step=1)
        assert [v.step for v in store.log("r")] == [0]
        store.gc(grace=0)
        assert store.ops.check().ok


def _tied(step: int) -> dict[str, torch.Tensor]:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    return {"w": w, "wt": w.t(), "b": torch.ones(3)}  # w and wt: one storage, one shared extent


def _changed(diff: casckpt.VersionDiff) -> tuple[list[str], int]:
    return sorted(c.path for c in diff.changed), diff.unchanged


def test_diff_sees_a_change_of_tensors_sharing_a_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors sharing one storage (tied weights) are tree entries ``{"s": i}`` naming the
    document's shared extent i: equal JSON in two versions whatever the extent holds, so the
    tree walk of diff skipped them (versions whose only change is a tied pair even have one
    tree root) and reported them unchanged. Format-1 versions, right before, got the same
    wrong answer once migrated."""
    with casckpt.open(tmp_path / "t") as store:
        store.commit(_tied(0), run="r", step=0)
        store.commit(_tied(2), run="r", step=2)
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
    monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", False)
    with casckpt.open(tmp_path / "old") as store:
        store.commit(_tied(0), run="r", step=0)
        store.commit(_tied(2), run="r", step=2)
    monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", True)
    with casckpt.open(tmp_path / "old") as store:
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
        assert store.ops.migrate_trees().versions_migrated == 2
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
