"""Invariant 8 for gc: nothing is deleted without positive proof that it is garbage.

Issue 13, case 4 (swapped ``contents`` rows made gc sweep chunks kept versions
need) and the proofs of :mod:`casckpt.engine.maintenance.gcguard`: the mark comes from
verified manifests, a pack object goes only when its footer holds no chunk a
version needs that the catalog lacks elsewhere, a catalog missing published
versions (a stale backup) or a location full of unknown packs stops the run.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.catalog import Catalog
from casckpt.cli.main import app
from casckpt.engine.maintenance import gc as gc_engine
from casckpt.engine.maintenance.gcguard import DeletionGuard
from casckpt.errors import CatalogError, GCRefusedError

CHUNK = 4096
sys.path.insert(0, str(Path(__file__).parents[2] / "golden"))
from make_legacy import legacy  # noqa: E402


def _state(seed: int, n: int = 12_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g), "step": seed}


def _open(root: Path, **kwargs: Any) -> casckpt.Store:
    return casckpt.open(root, chunk_size=CHUNK, pack_size=16 << 10, **kwargs)


def _objects(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for top in ("packs", "manifests")
            for p in (root / top).rglob("*") if p.is_file()}


def _sql(root: Path, *statements: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        rows: list[tuple[Any, ...]] = []
        for statement in statements:
            rows = db.execute(statement, params).fetchall()
        return rows


def _assert_restores(store: casckpt.Store, steps: tuple[int, ...]) -> None:
    for step in steps:
        got, want = store.restore(f"r@{step}"), _state(step)
        assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"]), step


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with _open(root) as store:
        for step in (1, 2, 3):
            store.commit(_state(step), run="r", step=step)
    return root


@pytest.fixture
def legacy_root(tmp_path: Path) -> Path:
    """A store whose versions are of the format before tree manifests (with contents rows):
    the golden ``gc-guard``, ``_state(step)`` at steps 1-3."""
    return legacy("gc-guard", tmp_path / "store")


def test_swapped_content_rows_are_reported_and_gc_sweeps_nothing_needed(legacy_root: Path) -> None:
    """The issue's reproduction: two equal-size contents rows trade chunk lists."""
    root = legacy_root
    rows = _sql(root, "SELECT digest, chunk_ids FROM contents ORDER BY digest")
    (d1, c1), (d2, c2) = rows[0], rows[-1]
    assert len(c1) == len(c2) and c1 != c2
    _sql(root, "UPDATE contents SET chunk_ids = ? WHERE digest = ?", params=(c2, d1))
    _sql(root, "UPDATE contents SET chunk_ids = ? WHERE digest = ?", params=(c1, d2))
    with _open(root) as store:
        report = store.ops.check()
        assert {p.kind for p in report.problems} == {"catalog"}, report.problems
        store.delete("r@1")
        store.gc(grace=0)
        _assert_restores(store, (2, 3))
        assert store.ops.check(read_data=True).problems == report.problems  # still only the rows


def test_a_chunk_row_pointing_elsewhere_does_not_let_gc_delete_the_pack_holding_it(root: Path) -> None:
    """Every chunk row of one pack repointed at another: the pack looks empty; its footer says
    otherwise, so gc keeps it and says why."""
    pack_a, pack_b = (r[0] for r in _sql(root, "SELECT id FROM packs ORDER BY created_at LIMIT 2"))
    _sql(root, "UPDATE chunks SET pack_id = ? WHERE pack_id = ?", params=(pack_b, pack_a))
    before = _objects(root)
    with _open(root) as store:
        report = store.gc(grace=0)
        assert report.kept and any(pack_a in note for note in report.kept), report.kept
    assert _objects(root) == before  # the pack's object is still there


def test_a_stale_catalog_backup_makes_gc_refuse_to_delete_anything(root: Path, tmp_path: Path) -> None:
    backup = tmp_path / "backup.db"
    with closing(sqlite3.connect(root / "catalog.db")) as db, closing(sqlite3.connect(backup)) as out:
        db.backup(out)
    with _open(root) as store:
        for step in (4, 5):
            store.commit(_state(step), run="r", step=step)
    for file in root.glob("catalog.db*"):
        file.unlink()
    shutil.copy(backup, root / "catalog.db")  # yesterday's catalog comes back from a backup
    before = _objects(root)
    with _open(root) as store:  # same store, same generation: opening is allowed
        with pytest.raises(GCRefusedError, match="2 manifest"):
            store.gc(grace=0)
        assert not store.ops.check().ok  # check names the unknown manifests too
    result = CliRunner().invoke(app, ["--store", str(root), "gc", "--grace", "0s"])
    assert result.exit_code == 7 and "catalog rebuild" in result.stderr
    assert _objects(root) == before
    for file in root.glob("catalog.db*"):  # the way out: rebuild from the locations
        file.unlink()
    with _open(root, recover=True) as store:
        store.ops.rebuild_catalog()
        _assert_restores(store, (1, 2, 3, 4, 5))
        assert store.gc(grace=0).orphans_deleted == 0


def test_many_unknown_packs_trip_the_breaker_and_force_deletes_them(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    with _open(other) as store:  # another store's packs, copied into this location by mistake
        for step in range(10):
            store.commit(_state(100 + step, 20_000), run="x", step=step)
    copied = 0
    for pack in (other / "packs").rglob("*"):
        if pack.is_file():
            target = root / pack.relative_to(other)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pack, target)
            copied += 1
    assert copied > 16
    with _open(root) as store:
        with pytest.raises(GCRefusedError, match="packs the catalog does not know"):
            store.gc(grace=0)
        assert store.gc(grace=0, force=True).orphans_deleted == copied
        _assert_restores(store, (1, 2, 3))
        assert store.ops.check(read_data=True).ok


def test_a_damaged_manifest_in_the_catalog_stops_gc_before_any_pack_goes(root: Path) -> None:
    (version_id, manifest), = _sql(root, "SELECT id, manifest FROM versions WHERE step = 2")
    damaged = bytearray(manifest)
    damaged[len(damaged) // 2] ^= 0xFF
    _sql(root, "UPDATE versions SET manifest = ? WHERE id = ?", params=(bytes(damaged), version_id))
    with _open(root) as store:
        store.delete("r@1")
        with pytest.raises(GCRefusedError, match="r@2"):
            store.gc(grace=0)
    assert any("manifests/" + version_id == key for key in _objects(root))
    _sql(root, "UPDATE versions SET manifest = ? WHERE id = ?", params=(manifest, version_id))
    with _open(root) as store:
        store.undelete("r@1")
        _assert_restores(store, (1, 2, 3))


def test_an_orphan_pack_holding_chunks_the_catalog_lost_is_kept(root: Path) -> None:
    """The catalog lost a pack's rows (chunks, pack, shards) while versions still need them."""
    (pack,) = _sql(root, "SELECT id FROM packs ORDER BY created_at LIMIT 1")[0]
    _sql(root, "DELETE FROM chunks WHERE pack_id = ?", params=(pack,))
    _sql(root, "DELETE FROM shards WHERE pack_id = ?", params=(pack,))
    _sql(root, "DELETE FROM packs WHERE id = ?", params=(pack,))
    with _open(root) as store:
        report = store.gc(grace=0)
        assert report.orphans_deleted == 0 and any("need" in note for note in report.kept)
        assert any(p.kind == "chunk" for p in store.ops.check().problems)
    assert any(pack in key for key in _objects(root))


def test_a_commit_failing_after_its_manifest_leaves_a_tombstone_gc_acts_on(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise CatalogError("the publishing transaction failed (injected)")

    with _open(root) as store:
        monkeypatch.setattr(Catalog, "add_version", refuse)
        with pytest.raises(CatalogError, match="injected"):
            store.commit(_state(9), run="r", step=9)
        monkeypatch.undo()
        manifests = {p.name for p in (root / "manifests").iterdir()}
        assert len(manifests) == 4  # the failed commit's manifest was written
        store.gc(grace=0)  # not refused: the failed commit tombstoned its version
        assert len({p.name for p in (root / "manifests").iterdir()}) == 3
        _assert_restores(store, (1, 2, 3))
        assert store.ops.check(read_data=True).ok



class _StaleCopyOnX:
    """``ec:2+1`` over four directories, one pack: shard i moved from X to the free location W
    by a repair (X keeps a stale copy, backdated an hour), X active again, W retiring -- so
    the next repair moves shard i back onto X, at the stale copy's key."""

    def __init__(self, tmp_path: Path) -> None:
        self.dirs = [tmp_path / f"d{i}" for i in range(4)]
        self.root = tmp_path / "store"
        self.a = self.open()
        self.a.commit(_state(0), run="r", step=0)
        name_of = {Path(info.url.removeprefix("file://")).name: info.name
                   for info in self.a.locations.list()}
        used = {Path(url.removeprefix("file://")).name for url, _, _ in self.shard_rows()}
        w = next(d for d in self.dirs if d.name not in used)  # the location holding no shard
        x = next(d for d in self.dirs if d.name in used)
        self.a.locations.retire(name_of[x.name])
        assert self.a.ops.repair().shards_moved == 1
        stale = [p for p in (x / "packs").rglob("*") if p.is_file()]
        assert stale
        self.a.locations.activate(name_of[x.name])
        hour_ago = time.time() - 3600
        for p in stale:
            os.utime(p, (hour_ago, hour_ago))
        self.a.locations.retire(name_of[w.name])
        self.b = self.open()  # a second process's handle: the concurrent repair

    def open(self) -> casckpt.Store:  # big packs: one pack, so one location holds no shard
        return casckpt.open(self.root, blobs=[str(d) for d in self.dirs], redundancy="ec:2+1",
                            chunk_size=CHUNK, pack_size=4 << 20)

    def shard_rows(self) -> list[tuple[str, str, str]]:  # (location url, key, state)
        return _sql(self.root, "SELECT l.url, s.key, s.state FROM shards s JOIN locations l "
                               "ON l.id = s.location_id")

    def catalog_shards_on_disk(self) -> list[tuple[str, bool]]:
        return [(state, (Path(url.removeprefix("file://")) / key).is_file())
                for url, key, state in self.shard_rows()]

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_gc_keeps_a_shard_a_concurrent_repair_moved_back_onto_its_listed_stale_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repair lands after gc listed X's stale copy as an orphan and before gc judged it:
    the catalog names X's object by then, so gc keeps it."""
    s = _StaleCopyOnX(tmp_path)
    real = gc_engine._orphans

    def orphans_then_repair(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        assert found, "gc should have listed X's stale copy as an orphan"
        s.b.ops.repair()  # moves the shard from W back onto X, at the stale copy's key
        return found

    monkeypatch.setattr(gc_engine, "_orphans", orphans_then_repair)
    s.a.gc(grace=0)
    assert s.catalog_shards_on_disk() == [("ok", True)] * 3
    with s.open() as fresh:
        assert fresh.ops.check(read_data=True).ok
        _assert_restores(fresh, (0,))
    s.close()


def test_a_shard_deleted_as_repair_recorded_it_is_marked_missing_and_repair_restores_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repair records X's object after gc judged the stale copy and before it deleted
    it: gc's recheck sees the catalog naming what it just deleted and marks it missing, so
    nothing is silently short of redundancy, and the next repair writes it again."""
    s = _StaleCopyOnX(tmp_path)
    real = DeletionGuard.orphans

    def judge_then_repair(self: DeletionGuard, *args: Any, **kwargs: Any) -> Any:
        verdicts = real(self, *args, **kwargs)
        assert verdicts.delete, "gc should have cleared X's stale copy to go"
        s.b.ops.repair()
        return verdicts

    monkeypatch.setattr(DeletionGuard, "orphans", judge_then_repair)
    report = s.a.gc(grace=0)
    assert any("concurrent repair" in note for note in report.kept), report.kept
    assert sorted(s.catalog_shards_on_disk()) == [("missing", False), ("ok", True), ("ok", True)]
    with s.open() as fresh:
        assert fresh.ops.repair().shards_rewritten == 1
        assert fresh.ops.check(read_data=True).ok
        _assert_restores(fresh, (0,))
    assert s.catalog_shards_on_disk() == [("ok", True)] * 3
    s.close()


def test_gc_keeps_a_stale_copy_when_the_catalogs_own_shard_is_gone_unnoticed(tmp_path: Path) -> None:
    """The catalog says shard i is ``ok`` on W, but W's object vanished without a reader
    noticing: X's stale copy is then the only one of shard i, and gc keeps it."""
    s = _StaleCopyOnX(tmp_path)
    on_disk = {Path(url.removeprefix("file://")) / key for url, key, _ in s.shard_rows()}
    stale = [p for d in s.dirs for p in (d / "packs").rglob("*") if p.is_file() and p not in on_disk]
    assert len(stale) == 1
    moved = next(p for p in on_disk if p.name == stale[0].name)
    moved.unlink()
    report = s.a.gc(grace=0)
    assert stale[0].is_file()
    assert report.orphans_deleted == 0
    assert any("not healthy" in note for note in report.kept), report.kept
    s.close()
