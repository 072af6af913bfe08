"""Tensor history against a straightforward reference: consecutive visible versions compared.

A run of many versions with a fork, deleted versions (in the parent run, at and
after the fork point, and the fork's own first version), a tensor that changes
in every version (one chunk at a time), one that never changes, and tensors
that appear, disappear and come back. The reference walks the lineage's
visible versions in order and compares each with the one before through
``Store.diff`` (which reads manifests and trees, not the history query); the
history must list exactly the versions where the tensor was added, changed or
removed, with the same bytes.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.catalog import history as history_sql

CHUNK = 4096
PATHS = ("model.w", "model.frozen", "model.sometimes", "model.late", "opt.m")


def _state(step: int, variant: float = 0.0) -> dict[str, Any]:
    w = torch.zeros(4096)  # 4 chunks; one changes per version
    w[(step * 1024) % 4096] = float(step) + variant
    state: dict[str, Any] = {"model": {"w": w, "frozen": torch.ones(2048)},
                             "opt": {"m": torch.full((8,), float(step // 3))}}
    if 3 <= step < 8 or step >= 14:
        state["model"]["sometimes"] = torch.full((1024,), float(step // 4))
    if step >= 20:
        state["model"]["late"] = torch.arange(16, dtype=torch.float64)
    return state


def _lineage(store: casckpt.Store, run: str) -> list[casckpt.Version]:
    """The visible versions of ``run``'s lineage, oldest first (a fork continues its parent)."""
    node = {n.name: n for n in store.lineage()}[run]
    own = sorted(store.log(run), key=lambda v: v.step)
    if node.parent_run is None or node.fork_step is None:
        return own
    parent = [v for v in _lineage(store, node.parent_run) if v.step <= node.fork_step]
    return parent + own


def _reference(store: casckpt.Store, run: str, path: str) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    previous: casckpt.Version | None = None
    for version in _lineage(store, run):
        if previous is None:
            row = next((t for t in store.show(version.id, tensors=True).tensors if t.path == path), None)
            if row is not None:
                out.append((version.id, "added", row.nbytes, row.nbytes))
        else:
            d = store.diff(previous.id, version.id)
            for change in (*d.added, *d.removed, *d.changed):
                if change.path == path:
                    out.append((version.id, change.change, change.nbytes_after, change.changed_bytes))
        previous = version
    return out


def _history(store: casckpt.Store, run: str, path: str) -> list[tuple[Any, ...]]:
    try:
        entries = store.history(run, path)
    except casckpt.TensorNotFoundError:
        return []
    return [(e.version.id, e.change, e.nbytes, e.changed_bytes) for e in entries]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as s:
        for step in range(30):
            s.commit(_state(step), run="base", step=step)
        s.fork("base@12", "ft")
        for step in range(13, 25):
            s.commit(_state(step, variant=0.5), run="ft", step=step)
        for ref in ("base@5", "base@6", "base@12", "base@13", "base@21", "ft@13", "ft@17"):
            s.delete(ref)
        yield s
        assert s.ops.check().ok


@pytest.mark.parametrize("whole_listing", [False, True])
def test_history_matches_consecutive_diffs(store: casckpt.Store, whole_listing: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways the query reads a lineage's versions: their ids, then the kept ones by key,
    when the tensor has few distinct contents, and each segment's whole listing when it has
    many (forced here by a batch of 2)."""
    if whole_listing:
        monkeypatch.setattr(history_sql, "BATCH", 2)
    for run in ("base", "ft"):
        for path in PATHS:
            assert _history(store, run, path) == _reference(store, run, path), (run, path)


def test_a_store_from_before_the_history_indexes_answers_the_same(tmp_path: Path) -> None:
    """The golden store (catalog at 0007; a format 1 version with tensor rows, then tree
    versions, and a fork) upgrades to the covering indexes and its histories match."""
    root = tmp_path / "store-0.1"
    shutil.copytree(Path(__file__).parents[2] / "golden" / "store-0.1", root)
    with casckpt.open(root, create=False) as store:
        indexes = _indexes(root)
        assert {"ix_tensors_history", "ix_versions_history"} <= indexes
        assert not {"ix_tensors_path", "ix_tensors_path_version", "ix_versions_run_state_step"} & indexes
        for run in ("main", "ft"):
            paths = {t.path for t in store.show(f"{run}@latest", tensors=True).tensors}
            paths |= {t.path for t in store.show("main@0", tensors=True).tensors}
            assert len(paths) > 5
            for path in sorted(paths):
                assert _history(store, run, path) == _reference(store, run, path), (run, path)


def _indexes(root: Path) -> set[str]:
    with closing(sqlite3.connect(root / "catalog.db")) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}


def test_reference_sees_every_kind_of_change(store: casckpt.Store) -> None:
    """The scenario is not vacuous: additions, removals and returns, and partial changes."""
    kinds = [e[1] for e in _history(store, "base", "model.sometimes")]
    assert kinds == ["added", "changed", "removed", "added", "changed", "changed", "changed", "changed"]
    w = _history(store, "ft", "model.w")
    assert len(w) == 20 and all(e[1] == "changed" and 0 < e[3] < e[2] for e in w[1:])
    assert len(_history(store, "ft", "model.frozen")) == 1
