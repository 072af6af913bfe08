"""Garbage collection: what it reclaims, what it never touches, and how it fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.catalog import gc as sql
from casckpt.catalog.locks import gc_lock
from casckpt.errors import CatalogError, GCRunningError, StorageError
from casckpt.testing.internals import internals

CHUNK = 4096


def _noise(seed: int, n: int = 20_000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _objects(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and p.parts[len(root.parts)] in ("packs", "manifests")}


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK, pack_size=64 << 10) as opened:
        yield opened


def test_deleted_version_is_reclaimed_and_others_survive(store: casckpt.Store) -> None:
    old = store.commit({"w": _noise(1)}, run="r", step=1)
    keep = store.commit({"w": _noise(2)}, run="r", step=2)
    before = store.ops.stats()
    store.delete(old.id)
    report = store.gc(grace=0)
    assert report.versions_purged == 1 and report.chunks_swept > 0 and report.packs_deleted > 0
    after = store.ops.stats()
    assert after.unique_bytes == before.unique_bytes - old.new_bytes
    assert after.pack_bytes < before.pack_bytes
    assert [v.step for v in store.log("r")] == [2]
    assert torch.equal(store.restore(keep.id)["w"], _noise(2))
    assert store.ops.check(read_data=True).ok
    assert not any(old.id in key for key in _objects(store.path))


def test_grace_keeps_data_and_allows_undelete(store: casckpt.Store) -> None:
    old = store.commit({"w": _noise(1)}, run="r", step=1)
    store.commit({"w": _noise(2)}, run="r", step=2)
    objects = _objects(store.path)
    store.delete(old.id)
    report = store.gc(grace=3600)
    assert report.chunks_condemned > 0 and report.chunks_swept == 0 and report.versions_purged == 0
    assert _objects(store.path) == objects  # nothing deleted inside the grace period
    store.undelete(old.id)
    assert torch.equal(store.restore("r@1")["w"], _noise(1))
    assert store.gc(grace=0).chunks_swept == 0  # undeleted data is referenced again
    assert store.ops.check(read_data=True).ok


def test_dry_run_changes_nothing(store: casckpt.Store) -> None:
    for step in range(1, 5):
        store.commit({"w": _noise(step)}, run="r", step=step)
    store.retention.set("r", keep_last=1)
    objects, stats = _objects(store.path), store.ops.stats()
    report = store.gc(dry_run=True, grace=0)
    assert report.dry_run and report.versions_deleted == 3
    assert report.bytes_freed >= 3 * _noise(1).numel() * 4 * 0.9  # incompressible noise
    [plan] = report.retention
    assert [d.keep for d in plan.decisions] == [True, False, False, False]
    assert _objects(store.path) == objects and store.ops.stats() == stats
    assert [v.step for v in store.log("r")] == [4, 3, 2, 1]
    real = store.gc(grace=0)
    assert real.versions_deleted == 3 and real.versions_purged == 3
    assert [v.step for v in store.log("r")] == [4]
    assert store.ops.check(read_data=True).ok


def test_orphan_objects_go_only_after_the_grace_period(store: casckpt.Store) -> None:
    store.commit({"w": _noise(1)}, run="r", step=1)
    orphan = store.path / "packs" / "ff" / ("ff" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a crashed commit")
    assert store.gc(grace=3600).orphans_deleted == 0 and orphan.exists()
    assert store.gc(grace=0).orphans_deleted == 1 and not orphan.exists()
    assert store.ops.check(read_data=True).ok


def test_commit_reusing_condemned_chunks_stays_whole(store: casckpt.Store) -> None:
    first = store.commit({"w": _noise(1)}, run="r", step=1)
    store.delete(first.id)
    assert store.gc(grace=3600).chunks_condemned > 0
    again = store.commit({"w": _noise(1)}, run="r", step=2)  # same chunks, now condemned
    store.gc(grace=0)  # purges step 1; step 2 must keep every chunk it shares
    assert torch.equal(store.restore(again.id)["w"], _noise(1))
    assert store.ops.check(read_data=True).ok


def test_commit_reusing_condemned_chunks_without_cache_hint(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK) as store:
        first = store.commit({"w": _noise(1)}, run="r", step=1)
        store.delete(first.id)
        store.gc(grace=3600)
    with casckpt.open(root, chunk_size=CHUNK, cache=tmp_path / "fresh-cache") as store:
        again = store.commit({"w": _noise(1)}, run="r", step=2)
        assert again.new_bytes == first.new_bytes  # condemned chunks are not trusted for dedup
        store.gc(grace=0)
        assert torch.equal(store.restore(again.id)["w"], _noise(1))
        assert store.ops.check(read_data=True).ok


def test_partly_dead_packs_are_repacked(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as store:  # one 64 MiB pack target
        versions = [store.commit({"w": _noise(i)}, run="r", step=i) for i in range(6)]
        assert store.ops.stats().packs == 6
        big = store.commit({f"w{i}": _noise(100 + i) for i in range(4)}, run="big", step=0)
        small = store.commit({"w0": _noise(100)}, run="small", step=0)  # shares 1/4 of big's pack
        store.delete(big.id)
        report = store.gc(grace=0)
        assert report.packs_repacked == 1
        assert torch.equal(store.restore(small.id)["w0"], _noise(100))
        store.gc(grace=0)  # the old pack, now empty, goes
        assert store.ops.check(read_data=True).ok
        assert all(torch.equal(store.restore(v.id)["w"], _noise(i)) for i, v in enumerate(versions))


def test_only_one_gc_at_a_time(store: casckpt.Store) -> None:
    with gc_lock(internals(store).catalog):
        with pytest.raises(GCRunningError):
            store.gc(grace=0)
    store.gc(grace=0)


class _FailingList:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def list(self, prefix: str = "") -> Any:
        raise StorageError("injected: listing failed")


def test_listing_error_aborts_before_anything_is_deleted(store: casckpt.Store) -> None:
    old = store.commit({"w": _noise(1)}, run="r", step=1)
    store.commit({"w": _noise(2)}, run="r", step=2)
    store.delete(old.id)
    objects, stats = _objects(store.path), store.ops.stats()
    from dataclasses import replace

    from casckpt.storage.locations import LocationSet

    internals(store).replace_locations(LocationSet(
        [replace(loc, blobs=_FailingList(loc.blobs)) for loc in internals(store).locations.all]))
    with pytest.raises(StorageError):
        store.gc(grace=0)
    assert _objects(store.path) == objects and store.ops.stats() == stats
    store.undelete(old.id)  # not purged either
    assert torch.equal(store.restore(old.id)["w"], _noise(1))


def test_database_error_in_sweep_deletes_no_object(store: casckpt.Store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    old = store.commit({"w": _noise(1)}, run="r", step=1)
    keep = store.commit({"w": _noise(2)}, run="r", step=2)
    store.delete(old.id)

    def broken_sweep(*args: Any, **kwargs: Any) -> Any:
        raise CatalogError("injected: database went away")

    monkeypatch.setattr(sql, "sweep", broken_sweep)
    objects = {k for k in _objects(store.path) if k.startswith("packs/")}
    with pytest.raises(CatalogError):
        store.gc(grace=0)
    assert {k for k in _objects(store.path) if k.startswith("packs/")} == objects
    monkeypatch.undo()
    assert store.gc(grace=0).packs_deleted > 0  # the next run finishes the job
    assert torch.equal(store.restore(keep.id)["w"], _noise(2))
    assert store.ops.check(read_data=True).ok


def test_undelete_racing_the_purge_keeps_the_version_whole(store: casckpt.Store,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    version = store.commit({"w": _noise(1)}, run="r", step=1)
    store.delete(version.id)
    real = sql.expired_deleted_versions

    def expired_then_undeleted(*args: Any, **kwargs: Any) -> list[str]:
        found = real(*args, **kwargs)
        store.undelete(version.id)  # lands between gc's read and its purge
        return found

    monkeypatch.setattr(sql, "expired_deleted_versions", expired_then_undeleted)
    assert store.gc(grace=0).versions_purged == 0
    assert torch.equal(store.restore(version.id)["w"], _noise(1))
    assert store.ops.check(read_data=True).ok


def test_recommitting_swept_content_before_its_objects_go(store: casckpt.Store,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine.maintenance import gc as gc_engine

    old = store.commit({"w": _noise(1)}, run="a", step=1)
    store.delete(old.id)
    real_delete = gc_engine._Deleter.delete
    recommitted: list[casckpt.Version] = []

    def commit_first(self: Any, keys: list[tuple[int, str]], **kwargs: Any) -> int:
        if keys and keys[0][1].startswith("packs/") and not recommitted:
            # the same bytes again, after the sweep dropped their rows, before the objects go
            recommitted.append(store.commit({"w": _noise(1)}, run="b", step=1))
        return real_delete(self, keys, **kwargs)

    monkeypatch.setattr(gc_engine._Deleter, "delete", commit_first)
    store.gc(grace=0)
    assert recommitted, "the sweep deleted no pack; the race was not exercised"
    assert torch.equal(store.restore("b@1")["w"], _noise(1))
    assert store.ops.check(read_data=True).ok
