"""Hostile review of issue 17's speed changes: what each attack found (see the report)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.errors import CasckptError, CatalogError, SchemaTooNewError


def _store(path: Path) -> Path:
    with casckpt.open(path) as store:
        store.commit({"w": torch.arange(64.0)}, run="r", step=1)
    return path / "catalog.db"


def _tamper(db: Path, sql: str) -> None:
    conn = sqlite3.connect(db)
    conn.execute(sql)
    conn.commit()
    conn.close()


def test_two_alembic_version_rows_are_a_typed_refusal(tmp_path: Path) -> None:
    """Open without Alembic: a catalog recording two revisions fell through to Alembic, whose
    CommandError is no CasckptError. Refused, typed, and nothing changed."""
    db = _store(tmp_path / "s")
    _tamper(db, "INSERT INTO alembic_version VALUES ('0007')")
    with pytest.raises(CatalogError, match="2 schema revisions"):
        casckpt.open(tmp_path / "s")
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    assert sorted(rows) == [("0007",), ("0008",)]
    conn.close()


@pytest.mark.parametrize("revision", ["zzzz", "0009", "0008 "])
def test_unknown_revision_is_refused(tmp_path: Path, revision: str) -> None:
    db = _store(tmp_path / "s")
    _tamper(db, f"UPDATE alembic_version SET version_num='{revision}'")
    with pytest.raises(SchemaTooNewError):
        casckpt.open(tmp_path / "s")


@pytest.mark.parametrize("sql", ["DELETE FROM alembic_version", "DROP TABLE alembic_version"])
def test_missing_revision_is_a_typed_error_and_changes_nothing(tmp_path: Path, sql: str) -> None:
    db = _store(tmp_path / "s")
    _tamper(db, sql)
    with pytest.raises(CasckptError):
        casckpt.open(tmp_path / "s")
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM versions").fetchone() == (1,)
    conn.close()


def test_unchanged_hint_after_the_parent_was_deleted_stores_the_state(tmp_path: Path) -> None:
    """Change hints: another handle deletes the run's newest version; this process's next
    ``unchanged=`` commit vouched for its tensors since ITS last commit, but the hint reused
    the older surviving version's chunk ids: the version silently stored stale bytes."""
    with casckpt.open(tmp_path / "s") as mine, casckpt.open(tmp_path / "s") as other:
        frozen = torch.arange(65536.0)
        mine.commit({"frozen": frozen, "w": torch.ones(65536)}, run="r", step=1)
        w = torch.full((65536,), 2.0)
        mine.commit({"frozen": frozen, "w": w}, run="r", step=2)
        other.delete("r@2")
        version = mine.commit({"frozen": frozen, "w": w}, run="r", step=3, unchanged="w")
        assert torch.equal(other.restore(version.id)["w"], w)


@pytest.mark.parametrize("mutate", [False, True])
def test_gc_between_a_background_snapshot_and_its_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        mutate: bool) -> None:
    """The lease now begins after the snapshot: another handle deletes the only version holding
    the chunks a queued background commit deduped against, and gc(grace=0) sweeps them before
    the lease. The commit must publish a version that restores bit-exact (rewritten from the
    state), or -- the state mutated meanwhile -- fail loudly with nothing visible."""
    import threading

    import casckpt.engine.background as background

    torch.manual_seed(0)
    a, b = torch.randn(200_000), torch.randn(1000)
    with casckpt.open(tmp_path / "s") as mine, casckpt.open(tmp_path / "s") as other:
        mine.commit({"a": a, "b": b}, run="r", step=1)
        mine.commit({"a": torch.randn(200_000), "b": b}, run="r", step=2)
        reached, go = threading.Event(), threading.Event()
        real = background.begin_lease

        def paused(catalog: object, version_id: str | None = None) -> str:
            reached.set()
            go.wait(30)
            return real(catalog, version_id)  # type: ignore[arg-type]

        monkeypatch.setattr(background, "begin_lease", paused)
        state = {"a": a.clone(), "b": b}
        handle = mine.commit(state, run="r", step=3, block=False)
        assert reached.wait(30)
        if mutate:
            state["a"].add_(1.0)  # allowed: a background commit's snapshot is taken
        other.delete("r@1")
        assert other.gc(grace=0).chunks_swept > 0
        go.set()
        if mutate:
            with pytest.raises(CatalogError, match="commit again"):
                handle.wait()
            assert [v.step for v in other.log("r")] == [2]
        else:
            restored = other.restore(handle.wait().id)
            assert torch.equal(restored["a"], a) and torch.equal(restored["b"], b)
        other.gc(grace=0)
        assert other.check(read_data=True).ok
