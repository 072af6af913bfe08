"""Invariant 8: a missing, emptied, stale or foreign catalog never deletes a store's data.

Issue 13, case 1: with ``catalog.db`` gone, ``casckpt.open`` used to create an
empty catalog, ``check`` found nothing and the next ``gc`` deleted every pack
and manifest as orphans. Every location now carries an identity record
(store id, catalog generation) the catalog must match.
"""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import empty_postgres_catalog
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import GCRefusedError, StoreIdentityError
from casckpt.format.identity import IDENTITY_NAME, decode_identity
from casckpt.testing.internals import internals

CHUNK = 4096


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "step": seed}


def _open(root: Path, **kwargs: Any) -> casckpt.Store:
    return casckpt.open(root, chunk_size=CHUNK, pack_size=32 << 10, **kwargs)


def _objects(root: Path) -> dict[str, bytes]:
    """Every pack, manifest and ref object of a local store, by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for top in ("packs", "manifests", "refs")
            for p in sorted((root / top).rglob("*")) if p.is_file()}


def _make(root: Path, steps: tuple[int, ...] = (1, 2)) -> dict[str, bytes]:
    with _open(root) as store:
        for step in steps:
            store.commit(_state(step), run="r", step=step)
    return _objects(root)


def _drop_catalog(root: Path) -> None:
    for file in root.glob("catalog.db*"):
        file.unlink()


def _cli(root: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["--store", str(root), *args])


def _assert_restores(store: casckpt.Store, steps: tuple[int, ...] = (1, 2)) -> None:
    for step in steps:
        got = store.restore(f"r@{step}")
        assert torch.equal(got["w"], _state(step)["w"]) and got["step"] == step


def test_a_new_store_writes_its_identity_on_every_location(tmp_path: Path) -> None:
    root = tmp_path / "store"
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    with casckpt.open(root, blobs=[str(d) for d in dirs]) as store:
        store.commit(_state(1), run="r", step=1)
        store_id = internals(store).catalog.store_id
    for d in dirs:
        record = decode_identity((d / IDENTITY_NAME).read_bytes(), str(d))
        assert (record.store_id, record.generation) == (store_id, 1)


@pytest.mark.parametrize("damage", ["missing", "emptied", "other-file"])
def test_a_lost_catalog_is_refused_and_gc_deletes_nothing(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "store"
    before = _make(root)
    if damage == "missing":
        _drop_catalog(root)
    elif damage == "emptied":
        _drop_catalog(root)
        (root / "catalog.db").write_bytes(b"")
    else:  # the config now names a catalog file that does not exist yet
        config = root / "casckpt.toml"
        config.write_text(config.read_text().replace(
            "[store]\n", f"[store]\ncatalog = \"sqlite:///{tmp_path / 'new.db'}\"\n"))
    with pytest.raises(StoreIdentityError, match="catalog rebuild"):
        _open(root)
    for args in (("gc", "--grace", "0s"), ("check", "--read-data"), ("gc", "--grace", "0s", "--force")):
        result = _cli(root, *args)
        assert result.exit_code == 5, (args, result.output)
        assert "catalog rebuild" in result.stderr and "Traceback" not in result.output
    assert _objects(root) == before  # not one object deleted or rewritten


def test_catalog_rebuild_recovers_a_lost_catalog_and_takes_over_the_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _make(root)
    old = tmp_path / "old-catalog.db"
    shutil.copy(root / "catalog.db", old)
    _drop_catalog(root)
    result = _cli(root, "catalog", "rebuild")
    assert result.exit_code == 0, result.output
    with _open(root) as store:
        _assert_restores(store)
        assert store.ops.check(read_data=True).ok
        assert store.gc(grace=0).orphans_deleted == 0
        new_id = internals(store).catalog.store_id
    record = decode_identity((root / IDENTITY_NAME).read_bytes(), "")
    assert record.generation == 2 and record.store_id == new_id  # the store keeps its id
    # the catalog from before the rebuild turns up again: refused (a lower generation)
    _drop_catalog(root)
    shutil.copy(old, root / "catalog.db")
    with pytest.raises(StoreIdentityError, match="taken over by a catalog rebuild"):
        _open(root)


def test_another_stores_catalog_is_refused_naming_both_stores(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    before = _make(a)
    _make(b, (7,))
    _drop_catalog(a)
    shutil.copy(b / "catalog.db", a / "catalog.db")
    with pytest.raises(StoreIdentityError) as info:
        _open(a)
    ids = [decode_identity((d / IDENTITY_NAME).read_bytes(), "").store_id for d in (a, b)]
    assert all(i in str(info.value) for i in ids)
    assert _objects(a) == before


def test_recover_mode_refuses_to_commit_or_collect_until_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "store"
    before = _make(root)
    _drop_catalog(root)
    with _open(root, recover=True) as store:
        assert store.log() == []
        with pytest.raises(StoreIdentityError, match="rebuild"):
            store.commit(_state(3), run="r", step=3)
        with pytest.raises(StoreIdentityError, match="rebuild"):
            store.gc(grace=0)
        with pytest.raises(StoreIdentityError, match="rebuild"):
            store.ops.repair()
        assert _objects(root) == before
        store.ops.rebuild_catalog()
        store.commit(_state(3), run="r", step=3)
        _assert_restores(store, (1, 2, 3))


def test_a_store_from_before_identity_records_is_adopted_by_its_own_catalog(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _make(root)
    (root / IDENTITY_NAME).unlink()
    with _open(root) as store:
        _assert_restores(store)
        store_id = internals(store).catalog.store_id
    assert decode_identity((root / IDENTITY_NAME).read_bytes(), "").store_id == store_id


def test_a_store_from_before_identity_records_with_a_lost_catalog_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    before = _make(root)
    (root / IDENTITY_NAME).unlink()
    _drop_catalog(root)
    with pytest.raises(StoreIdentityError, match="no identity record"):
        _open(root)
    assert _objects(root) == before
    with _open(root, recover=True) as store:  # and the rebuild still works
        store.ops.rebuild_catalog()
        _assert_restores(store)


def test_a_damaged_identity_record_is_rewritten_only_for_a_catalog_that_knows_the_data(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    _make(root)
    (root / IDENTITY_NAME).write_bytes(b'{"format": "casckpt.identity", "garbage": 1}')
    with _open(root) as store:  # the catalog knows the location's manifests: rewritten
        _assert_restores(store)
    decode_identity((root / IDENTITY_NAME).read_bytes(), "")
    (root / IDENTITY_NAME).write_bytes(b"\x00\xff")
    _drop_catalog(root)
    with pytest.raises(StoreIdentityError, match="damaged identity record"):
        _open(root)


def test_adding_another_stores_location_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _make(a)
    before = _make(b, (7,))
    with _open(a) as store:
        with pytest.raises(StoreIdentityError, match="belongs to store"):
            store.locations.add(str(b))
        assert [loc.name for loc in store.locations.list()] == ["loc0"]
    assert _objects(b) == before


def test_gc_refuses_a_location_whose_record_went_missing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    dirs = [tmp_path / f"d{i}" for i in range(2)]
    with casckpt.open(root, blobs=[str(d) for d in dirs], chunk_size=CHUNK) as store:
        store.commit(_state(1), run="r", step=1)
        (dirs[1] / IDENTITY_NAME).unlink()  # e.g. another process replaced the directory
        with pytest.raises(GCRefusedError, match="does not prove it belongs"):
            store.gc(grace=0)


def test_postgres_catalog_dropped_is_refused_then_rebuilt(tmp_path: Path, pg_url: str) -> None:

    root = tmp_path / "store"
    with casckpt.open(root, catalog=pg_url, chunk_size=CHUNK) as store:
        for step in (1, 2):
            store.commit(_state(step), run="r", step=step)
    before = _objects(root)
    empty_postgres_catalog(pg_url)
    with pytest.raises(StoreIdentityError):
        casckpt.open(root)
    assert _objects(root) == before
    with casckpt.open(root, recover=True) as store:
        store.ops.rebuild_catalog()
        _assert_restores(store)


def test_s3_location_with_a_lost_catalog_is_refused(tmp_path: Path, s3_bucket_url: Any,
                                                     moto_endpoint: str) -> None:
    root = tmp_path / "store"
    bucket = s3_bucket_url()
    s3 = {"endpoint_url": moto_endpoint}
    with casckpt.open(root, blobs=bucket, s3=s3, chunk_size=CHUNK) as store:
        store.commit(_state(1), run="r", step=1)
        keys = sorted(info.key for loc in internals(store).locations.all for info in loc.blobs.list(""))
    _drop_catalog(root)
    with pytest.raises(StoreIdentityError):
        casckpt.open(root)
    with casckpt.open(root, recover=True) as store:
        locations = internals(store).locations.all
        assert sorted(info.key for loc in locations for info in loc.blobs.list("")) == keys
        store.ops.rebuild_catalog()
        _assert_restores(store, (1,))


def test_sqlite_catalog_rows_of_another_store_id_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    before = _make(root)
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        db.execute("UPDATE store_info SET value = ? WHERE key = 'store_id'", ("0" * 32,))
    with pytest.raises(StoreIdentityError):
        _open(root)
    assert _objects(root) == before
