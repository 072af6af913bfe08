"""A hostile review of issue 19 (encryption, read-only mode, roles, audit): each test is a way
the merged work could be broken that its own tests missed, run for real."""

from __future__ import annotations

import json
import shutil
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import casckpt
from casckpt.errors import StoreKeyError
from casckpt.format import keys as object_keys

NEEDLE_SEED = 5


def _pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _state(seed: int = NEEDLE_SEED, nbytes: int = 1 << 20) -> dict[str, torch.Tensor]:
    return {"w": torch.frombuffer(bytearray(_pattern(seed, nbytes)), dtype=torch.uint8).clone()}


def _key(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "keys" / name
    path.parent.mkdir(exist_ok=True)
    casckpt.generate_key_file(path)
    return path


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# -- the key record ------------------------------------------------------------------------------


def test_a_key_record_row_holding_json_null_is_damaged_not_a_plain_store(tmp_path: Path) -> None:
    """A catalog writer (the writer role has UPDATE on store_info: the refs counter lives there)
    sets the key record's value to the JSON text ``null``. That must read as a damaged record
    (the store refuses to open), never as 'no record' -- a keyless open would then take the
    store for a plain one and a commit would write plaintext to the locations."""
    key, loc = _key(tmp_path, "k.key"), tmp_path / "loc"
    with casckpt.open(tmp_path / "store", blobs=str(loc), key_file=key) as store:
        store.commit(_state(), run="r", step=1)
    with sqlite3.connect(tmp_path / "store" / "catalog.db") as db:
        db.execute("UPDATE store_info SET value = 'null' WHERE key = 'key_record'")
    with pytest.raises(StoreKeyError, match="damaged"):
        casckpt.open(tmp_path / "store", blobs=str(loc)).close()
    with pytest.raises(StoreKeyError, match="damaged"):
        casckpt.open(tmp_path / "store", blobs=str(loc), key_file=key).close()


def test_a_rebuild_finds_the_current_key_record_beside_a_stale_one(tmp_path: Path) -> None:
    """A location unreachable while a key is rotated keeps the old key record (publish writes
    to readable locations only). If the catalog is then lost, a rebuild with the NEW key must
    still unlock the store from the location that holds the current record, whatever the
    order the locations are named in -- not fail with WrongKeyError on the stale copy (the
    old key may be destroyed by then: rotation is how a stolen key is retired)."""
    old, new = _key(tmp_path, "old.key"), _key(tmp_path, "new.key")
    a, b = tmp_path / "a", tmp_path / "b"
    with casckpt.open(tmp_path / "store", blobs=[str(a), str(b)], key_file=old) as store:
        store.commit(_state(), run="r", step=1)
        stale = (b / object_keys.KEYS_RECORD).read_bytes()
        assert (a / object_keys.KEYS_RECORD).read_bytes() == stale
    b.rename(tmp_path / "b-away")  # b is unreachable while the key is rotated
    with casckpt.open(tmp_path / "store", blobs=[str(a), str(b)], key_file=old) as store:
        rotated = store.keys.rotate(new)
    (tmp_path / "b-away").rename(b)
    assert (b / object_keys.KEYS_RECORD).read_bytes() == stale
    assert (a / object_keys.KEYS_RECORD).read_bytes() != stale
    old.unlink()  # the retired key is gone
    shutil.rmtree(tmp_path / "store")
    with casckpt.open(tmp_path / "store2", blobs=[str(b), str(a)], recover=True, key_file=new) as store:
        assert store.ops.rebuild_catalog().versions == 1
        assert torch.equal(store.restore("r@1")["w"], _state()["w"])
        assert [k.id for k in store.keys.list()] == [rotated.id]  # the current record was adopted


def test_the_writer_role_cannot_take_the_key_record_row_away(
        pg_server: Any, new_pg_url: Callable[[], str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SECURITY.md: a catalog writer who removes the key record row makes keyless processes
    commit plaintext, and 'the writer role cannot delete catalog rows'. But it may UPDATE
    store_info (the refs counter): renaming the row's key is a delete by another name. The
    printed writer grants must let it bump the counter (a commit still works) and nothing else
    of store_info's keys."""
    import sqlalchemy as sa
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    key = _key(tmp_path, "k.key")
    owner_url = new_pg_url()
    url = owner_url.replace("postgresql+psycopg://postgres:@/", "postgresql+psycopg:///", 1)
    monkeypatch.setenv("PGUSER", "postgres")
    root = tmp_path / "store"
    with casckpt.open(root, catalog=url, key_file=key) as store:
        store.commit(_state(), run="r", step=1)
    writer = f"casckpt_writer_{uuid.uuid4().hex[:8]}"
    pg_server.psql(f"CREATE ROLE {writer} LOGIN;")
    printed = CliRunner().invoke(app, ["init", str(root), "--print-grants", "writer",
                                       "--role-name", writer, "--json"])
    assert printed.exit_code == 0, printed.output
    owner = sa.create_engine(owner_url)
    with owner.begin() as conn:
        conn.exec_driver_sql("\n".join(json.loads(printed.stdout)["sql"]))
    owner.dispose()
    monkeypatch.setenv("PGUSER", writer)
    with casckpt.open(root, key_file=key) as store:  # a writer commits an encrypted store
        store.commit(_state(6), run="r", step=2, tags=["t"])
        assert torch.equal(store.restore("tag:t")["w"], _state(6)["w"])
    as_writer = sa.create_engine(url)
    try:
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), as_writer.begin() as conn:
            conn.exec_driver_sql("UPDATE store_info SET key = 'gone' WHERE key = 'key_record'")
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), as_writer.begin() as conn:
            conn.exec_driver_sql("DELETE FROM store_info WHERE key = 'key_record'")
    finally:
        as_writer.dispose()
    monkeypatch.setenv("PGUSER", "postgres")
    with casckpt.open(root, key_file=key) as store:
        assert [v.step for v in store.log("r")] == [2, 1]


def test_an_encrypted_store_on_s3_is_rebuilt_from_its_bucket_with_a_rotated_key(
        tmp_path: Path, s3_bucket_url: Callable[[], str], moto_endpoint: str) -> None:
    """`catalog rebuild` of an encrypted store whose only location is S3, after a rotation:
    the new key unlocks the record on the bucket and every version reads back; the retired key
    and no key are refused."""
    from casckpt.errors import KeyRequiredError, WrongKeyError

    old, new = _key(tmp_path, "old.key"), _key(tmp_path, "new.key")
    url, s3 = s3_bucket_url(), {"endpoint_url": moto_endpoint}
    with casckpt.open(tmp_path / "store", blobs=url, s3=s3, key_file=old) as store:
        store.commit(_state(), run="r", step=1, tags=["t"])
        store.commit(_state(8, 300_000), run="r", step=2)
        store.keys.rotate(new)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(KeyRequiredError):
        casckpt.open(tmp_path / "a", blobs=url, s3=s3, recover=True)
    with pytest.raises(WrongKeyError):
        casckpt.open(tmp_path / "b", blobs=url, s3=s3, recover=True, key_file=old)
    with casckpt.open(tmp_path / "c", blobs=url, s3=s3, recover=True, key_file=new) as store:
        assert store.ops.rebuild_catalog().versions == 2
        assert torch.equal(store.restore("tag:t")["w"], _state()["w"])
        assert torch.equal(store.restore("r@2")["w"], _state(8, 300_000)["w"])
        assert store.ops.check(read_data=True).ok


def test_an_encrypted_store_migrated_to_trees_checks_clean(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions in the manifest format from before trees, migrated (`migrate-trees`): the tree
    is derived with the store's keyed ids, and check and undelete must derive it the same
    way -- not with plain BLAKE3, which names another root and reports the catalog damaged."""
    from casckpt.engine import commit as commit_engine

    key, loc = _key(tmp_path, "k.key"), tmp_path / "loc"
    with casckpt.open(tmp_path / "store", blobs=str(loc), key_file=key) as store:
        monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", False)
        store.commit(_state(), run="r", step=1)
        store.commit(_state(9, 200_000), run="r", step=2)
        monkeypatch.setattr(commit_engine, "TREE_MANIFESTS", True)
        assert store.ops.migrate_trees().versions_migrated == 2
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        store.delete("r@1")
        store.undelete("r@1")
        assert torch.equal(store.restore("r@1")["w"], _state()["w"])


def _catalog_text(db: Path) -> bytes:
    """Every value of every row of a SQLite catalog, compressed manifests and nodes opened."""
    import zstandard

    out = [db.read_bytes()]
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for row in con.execute(f'SELECT * FROM "{table}"'):
                for value in row:
                    if isinstance(value, bytes):
                        try:
                            value = zstandard.ZstdDecompressor().decompress(value, max_output_size=1 << 26)
                        except zstandard.ZstdError:
                            pass
                        out.append(value)
                    elif isinstance(value, str):
                        out.append(value.encode())
    return b"\n".join(out)


def test_a_directory_snapshot_lets_no_one_test_the_catalog_for_a_known_file(tmp_path: Path) -> None:
    """SECURITY.md: chunk ids in the catalog are keyed and let no one test for content. An
    add_dir snapshot records each file's whole-file digest in the manifest and tree nodes,
    which the catalog keeps in the clear: a plain BLAKE3 there lets whoever reads the catalog
    test whether the store holds a file they have (a public config, a leaked weights file).
    Encrypted, the digest is keyed; checkout still verifies every file against it."""
    import blake3

    key, loc = _key(tmp_path, "k.key"), tmp_path / "loc"
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    known = b"a file everyone has, e.g. a public tokenizer config\n" * 500
    big = _pattern(4, (9 << 20) + 17)  # hashed with threads
    (src / "config.json").write_bytes(known)
    (src / "sub" / "weights.bin").write_bytes(big)
    (src / "empty").write_bytes(b"")
    digests = [blake3.blake3(data).hexdigest().encode() for data in (known, big, b"")]
    with casckpt.open(tmp_path / "store", blobs=str(loc), key_file=key) as store:
        store.add_dir(src, run="snap", step=1)
        store.checkout("snap@1", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == known
    assert (tmp_path / "out" / "sub" / "weights.bin").read_bytes() == big
    assert (tmp_path / "out" / "empty").read_bytes() == b""
    catalog = _catalog_text(tmp_path / "store" / "catalog.db")
    for digest in digests:
        assert digest not in catalog
    with casckpt.open(tmp_path / "plain", blobs=str(tmp_path / "plainloc")) as store:  # unchanged
        store.add_dir(src, run="snap", step=1)
        store.checkout("snap@1", tmp_path / "out2")
    assert digests[0] in _catalog_text(tmp_path / "plain" / "catalog.db")


def test_a_gc_that_purged_versions_then_failed_is_in_the_audit_trail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine import gc as gc_engine
    from casckpt.errors import StorageError

    with casckpt.open(tmp_path / "s", blobs=str(tmp_path / "loc")) as store:
        store.commit(_state(1, 100_000), run="r", step=1)
        store.commit(_state(2, 100_000), run="r", step=2)
        gone = store.delete("r@1")

        def broken(*_: object) -> int:
            raise StorageError("a location failed while gc repacked")

        monkeypatch.setattr(gc_engine, "_repack", broken)
        with pytest.raises(StorageError):
            store.gc(grace=0)
        with pytest.raises(casckpt.errors.RefNotFoundError):
            store.undelete(gone.id)  # purged: the catalog row and the manifest are gone
        (row,) = store.ops.audit(action="gc")  # a purge is never unaccounted for
        assert row.detail["versions_purged"] == 1 and "a location failed" in row.detail["failed"]


@pytest.mark.parametrize("loss", ["deleted", "garbage"])
def test_a_rebuild_over_encrypted_objects_without_a_key_record_is_refused(tmp_path: Path, loss: str) -> None:
    """Every location lost its key record (deleted by whoever may delete in the bucket, or
    damaged) and the catalog is gone. A `catalog rebuild` -- without a key, or with it -- must
    refuse, not build a plain catalog over the sealed objects (0 versions, every pack 'lost')
    whose next commit writes plaintext into the encrypted store's bucket."""
    key, loc = _key(tmp_path, "k.key"), tmp_path / "loc"
    with casckpt.open(tmp_path / "store", blobs=str(loc), key_file=key) as store:
        store.commit(_state(), run="r", step=1)
    if loss == "deleted":
        (loc / object_keys.KEYS_RECORD).unlink()
    else:
        (loc / object_keys.KEYS_RECORD).write_text("{not json")
    shutil.rmtree(tmp_path / "store")
    before = {str(p): p.read_bytes() for p in _files(loc)}
    for kw in ({}, {"key_file": key}):
        with pytest.raises(StoreKeyError, match="no location has a readable key record"):
            casckpt.open(tmp_path / "store2", blobs=str(loc), recover=True, **kw).close()
        with pytest.raises(StoreKeyError, match="no location has a readable key record"):
            casckpt.open(tmp_path / "store3", blobs=str(loc), **kw).close()  # a new catalog
    assert {str(p): p.read_bytes() for p in _files(loc) if "/tmp/" not in str(p)} == {
        k: v for k, v in before.items() if "/tmp/" not in k}
