"""Catalog schema versions: older catalogs are upgraded on open, newer ones refused untouched."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
import torch
from alembic import command
from sqlalchemy import create_engine, inspect

import casckpt
from casckpt import config as cfg
from casckpt.catalog.migrate import _config, current_revision, head_revision, migrations_dir
from casckpt.errors import CasckptError, CatalogError, SchemaTooNewError
from casckpt.format.identity import IDENTITY_NAME

# what these tests pin is what the migrations do to every new catalog (tests/conftest.py replays
# their result elsewhere)
pytestmark = pytest.mark.real_migrations

FUTURE = "9999_future"
sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
from make_legacy import delta_weights, legacy  # noqa: E402
from make_legacy import migration_state as _state  # noqa: E402


@contextmanager
def _db(root: Path) -> Iterator[sqlite3.Connection]:
    with closing(sqlite3.connect(root / cfg.CATALOG_FILE)) as conn, conn:
        yield conn


def _dump(root: Path) -> list[str]:
    with _db(root) as conn:
        return list(conn.iterdump())


def _revision(root: Path) -> str | None:
    engine = create_engine(f"sqlite:///{root / cfg.CATALOG_FILE}")
    try:
        with engine.connect() as conn:
            return current_revision(conn)
    finally:
        engine.dispose()


def _tables(root: Path) -> set[str]:
    engine = create_engine(f"sqlite:///{root / cfg.CATALOG_FILE}")
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _migrate(root: Path, revision: str, *, down: bool = False) -> None:
    """Run Alembic the way casckpt does (programmatically, on an open connection)."""
    engine = create_engine(f"sqlite:///{root / cfg.CATALOG_FILE}")
    try:
        with engine.connect() as conn:
            (command.downgrade if down else command.upgrade)(_config(conn), revision)
            conn.commit()
    finally:
        engine.dispose()


def _assert_restores(store: casckpt.Store, step: int) -> None:
    got, want = store.restore(f"r@{step}"), _state(step)
    assert torch.equal(got["w"], want["w"]) and got["step"] == step


def test_migrations_are_found_and_head_is_the_newest_script() -> None:
    scripts = sorted(p.name for p in (migrations_dir() / "versions").glob("[0-9]*.py"))
    assert (migrations_dir() / "env.py").is_file() and scripts
    assert head_revision() == scripts[-1].split("_", 1)[0]


def test_newer_catalog_is_refused_untouched(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit(_state(1), run="r", step=1)
    with _db(root) as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (FUTURE,))
    before = _dump(root)

    with pytest.raises(SchemaTooNewError) as info:
        casckpt.open(root)
    err = info.value
    assert isinstance(err, CasckptError) and isinstance(err, RuntimeError)
    message = str(err)
    assert repr(FUTURE) in message and head_revision() in message
    assert "Upgrade casckpt" in message and "nothing was changed" in message
    assert str(root) in message

    assert _dump(root) == before, "opening a newer catalog modified it"
    assert _revision(root) == FUTURE
    with pytest.raises(SchemaTooNewError):
        casckpt.open(root, create=False)
    assert _dump(root) == before


def test_catalog_at_first_revision_is_upgraded(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / cfg.CONFIG_FILE).write_text(f"[store]\nformat = {cfg.STORE_FORMAT}\n")
    _migrate(root, "0001")
    assert _revision(root) == "0001" and "store_info" not in _tables(root)

    with casckpt.open(root) as store:
        assert _revision(root) == head_revision()
        assert "store_info" in _tables(root)
        store.commit(_state(1), run="r", step=1)
        _assert_restores(store, 1)
        assert store.ops.check(read_data=True).ok
    with _db(root) as conn:
        (store_id,) = conn.execute("SELECT value FROM store_info WHERE key = 'store_id'").fetchone()
    assert len(store_id) == 32


def test_upgrade_keeps_existing_versions(tmp_path: Path) -> None:
    """A store of format-1 versions (the golden ``migrations``) taken back to 0001, then
    opened: its versions survive."""
    root = legacy("migrations", tmp_path / "store")
    _migrate(root, "0001", down=True)
    assert _revision(root) == "0001" and "store_info" not in _tables(root)
    (root / IDENTITY_NAME).unlink()  # a casckpt of 0001's time wrote no identity record

    with casckpt.open(root, chunk_size=4096) as store:
        assert _revision(root) == head_revision()
        assert (root / IDENTITY_NAME).is_file()  # adopted: the catalog knows the store's manifests
        assert [v.step for v in store.log("r")] == [3, 2, 1]
        assert store.resolve("tag:t1").step == 1
        for step in (1, 2, 3):
            _assert_restores(store, step)
        store.commit(_state(4), run="r", step=4)
        _assert_restores(store, 4)
        assert store.ops.check(read_data=True).ok


def test_reopening_at_head_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit(_state(1), run="r", step=1)
    before = _dump(root)
    casckpt.open(root).close()
    assert _dump(root) == before



def test_creating_and_upgrading_a_store_logs_no_alembic_lines_at_info(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / cfg.CONFIG_FILE).write_text(f"[store]\nformat = {cfg.STORE_FORMAT}\n")
    _migrate(root, "0001")
    with caplog.at_level(logging.INFO):  # the root logger at INFO, as a training job sets it
        casckpt.open(tmp_path / "new").close()
        casckpt.open(root).close()  # an upgrade: 0001 -> head
    assert not [r for r in caplog.records if r.name.startswith("alembic")], caplog.text
    assert logging.getLogger("alembic").level == logging.NOTSET  # left as it was found


def test_an_alembic_logger_the_application_configured_keeps_its_level(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="alembic"):
        casckpt.open(tmp_path / "new").close()
    assert any(r.name.startswith("alembic.runtime.migration") for r in caplog.records)


OPENER = """
import sys, time
from pathlib import Path
import casckpt
root, cache, go, run = sys.argv[1:5]
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.005)
with casckpt.open(root, cache=cache) as store:
    store.commit({"run": run}, run=run, step=0)
"""


def test_processes_opening_an_old_catalog_at_once_upgrade_it_once(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / cfg.CONFIG_FILE).write_text(f"[store]\nformat = {cfg.STORE_FORMAT}\n")
    _migrate(root, "0001")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", OPENER, str(root), str(tmp_path / f"cache{i}"),
                          str(go), f"rank{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path)
        for i in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go.touch()
        results = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    assert _revision(root) == head_revision()
    with _db(root) as conn:
        assert conn.execute("SELECT COUNT(*) FROM store_info WHERE key = 'store_id'").fetchone() == (1,)
    with casckpt.open(root) as store:
        assert sorted(r.name for r in store.runs()) == ["rank0", "rank1"]
        assert store.ops.check().ok


def test_threads_opening_stores_at_once(tmp_path: Path) -> None:
    roots = [tmp_path / f"store{i}" for i in range(4)]
    for root in roots:
        casckpt.open(root).close()

    def open_it(root: Path, barrier: threading.Barrier, errors: list[BaseException]) -> None:
        barrier.wait()
        try:
            casckpt.open(root, create=False).close()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    for _ in range(10):
        barrier = threading.Barrier(len(roots))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=open_it, args=(root, barrier, errors)) for root in roots]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, f"concurrent opens failed: {errors!r}"


# -- 0004: blob locations and shards ------------------------------------------------------


def _migrate_url(url: str, revision: str, *, down: bool = False) -> None:
    """:func:`_migrate` for any catalog URL."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            (command.downgrade if down else command.upgrade)(_config(conn), revision)
            conn.commit()
    finally:
        engine.dispose()


def _query(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


SHARDS_WITH_LOCATIONS = (
    "SELECT p.id, p.key, p.size, p.scheme, p.k, p.m, s.idx, s.key, s.size, s.state, "
    "l.id, l.name, l.url, l.domain, l.state FROM packs p "
    "JOIN shards s ON s.pack_id = p.id JOIN locations l ON l.id = s.location_id ORDER BY p.id"
)


def _write_at_0003(root: Path, catalog: str | None = None, blobs: Path | None = None) -> tuple[str, str]:
    """A store of format-1 versions (the golden ``migrations``: steps 1-3, in several packs),
    taken back to the 0003 schema.

    Returns (catalog URL, the blob location's URL as recorded at head).
    """
    legacy("migrations", root, catalog=catalog, blobs=blobs)
    url = catalog or f"sqlite:///{root / cfg.CATALOG_FILE}"
    ((blob_url,),) = _query(url, "SELECT url FROM locations")
    _migrate_url(url, "0003", down=True)
    assert _query(url, "SELECT version_num FROM alembic_version") == [("0003",)]
    tables = _tables_url(url)
    assert "shards" not in tables and "locations" not in tables
    assert "scheme" not in _columns(url, "packs") and "redundancy" not in _columns(url, "runs")
    return url, str(blob_url)


def _tables_url(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _assert_single_copies_on_loc0(url: str, blob_url: str) -> None:
    packs = _query(url, "SELECT id FROM packs")
    rows = _query(url, SHARDS_WITH_LOCATIONS)
    assert len(packs) >= 2, "the store should span several packs"
    assert sorted(str(r[0]) for r in rows) == sorted(str(p[0]) for p in packs), "a pack has no shard row"
    for (_, pkey, psize, scheme, k, m, idx, skey, ssize, sstate, lid, lname, lurl, ldomain, lstate) in rows:
        assert (scheme, k, m, idx) == ("none", 1, 0, 0)
        assert (skey, ssize, sstate) == (pkey, psize, "ok")
        assert (lid, lname, lurl, ldomain, lstate) == (1, "loc0", blob_url, "loc0", "active")
    assert _query(url, "SELECT COUNT(*) FROM locations") == [(1,)]


def _assert_all_restore(store: casckpt.Store, steps: tuple[int, ...]) -> None:
    for step in steps:
        _assert_restores(store, step)
        assert store.resolve(f"tag:t{step}").step == step
    assert store.ops.check(read_data=True).ok


@pytest.mark.parametrize("separate_blobs", [False, True], ids=["self-contained", "blobs-elsewhere"])
def test_store_at_0003_gets_its_packs_on_loc0(tmp_path: Path, separate_blobs: bool) -> None:
    root = tmp_path / "store"
    blobs = tmp_path / "blobs" if separate_blobs else None
    url, blob_url = _write_at_0003(root, blobs=blobs)
    assert blob_url == (blobs or root).as_uri()

    with casckpt.open(root, chunk_size=4096, cache=tmp_path / "cache") as store:
        assert _revision(root) == head_revision()
        _assert_single_copies_on_loc0(url, blob_url)
        assert [(loc.name, loc.url, loc.state, loc.shards) for loc in store.locations.list()] == [
            ("loc0", blob_url, "active", len(_query(url, "SELECT id FROM packs")))]
        assert store.locations.redundancy() == "none"
        _assert_all_restore(store, (1, 2, 3))
        store.commit(_state(4), run="r", step=4, tags=["t4"])
        _assert_all_restore(store, (1, 2, 3, 4))
    _assert_single_copies_on_loc0(url, blob_url)  # the new packs too, still one location


def test_store_at_0003_then_gains_a_location_and_redundancy(tmp_path: Path) -> None:
    root = tmp_path / "store"
    url, blob_url = _write_at_0003(root)
    with casckpt.open(root, chunk_size=4096, cache=tmp_path / "cache") as store:
        added = store.locations.add(str(tmp_path / "second"), domain="other")
        assert (added.name, added.domain) == ("loc1", "other")
        assert _query(url, "SELECT id, name FROM locations ORDER BY id") == [(1, "loc0"), (2, "loc1")]
        store.locations.set_redundancy("replicate:2")
        store.commit(_state(4), run="r", step=4, tags=["t4"])
        _assert_all_restore(store, (1, 2, 3, 4))
        assert {loc.name: loc.shards > 0 for loc in store.locations.list()} == {"loc0": True, "loc1": True}


def test_empty_store_at_0003_registers_its_configured_location(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / cfg.CONFIG_FILE).write_text(f"[store]\nformat = {cfg.STORE_FORMAT}\n")
    _migrate(root, "0003")
    url = f"sqlite:///{root / cfg.CATALOG_FILE}"
    with casckpt.open(root) as store:
        assert _query(url, "SELECT id, name, url, domain, state FROM locations") == [
            (1, "loc0", root.as_uri(), "loc0", "active")]
        store.commit(_state(1), run="r", step=1, tags=["t1"])
        _assert_all_restore(store, (1,))


def test_0004_downgrades_to_0003_and_back(tmp_path: Path) -> None:
    root = tmp_path / "store"
    url, blob_url = _write_at_0003(root)
    _migrate(root, "0004")
    assert _revision(root) == "0004"
    # the migration cannot know the URL: the store fills it in from its config when opened
    assert _query(url, "SELECT id, name, url, domain FROM locations") == [(1, "loc0", None, "loc0")]
    assert _query(url, "SELECT COUNT(*) FROM shards") == _query(url, "SELECT COUNT(*) FROM packs")
    assert {"scheme", "k", "m", "algorithm", "stripe", "data_offset"} <= _columns(url, "packs")
    assert "redundancy" in _columns(url, "runs")

    _migrate(root, "0003", down=True)
    assert _revision(root) == "0003"
    assert not {"shards", "locations"} & _tables(root)
    assert not {"scheme", "k", "m", "algorithm", "stripe", "data_offset"} & _columns(url, "packs")
    _migrate(root, "0004")
    _migrate(root, "0003", down=True)
    _migrate(root, "0004")

    with casckpt.open(root, chunk_size=4096, cache=tmp_path / "cache") as store:
        _assert_single_copies_on_loc0(url, blob_url)
        _assert_all_restore(store, (1, 2, 3))


def test_postgres_store_at_0003_is_upgraded(tmp_path: Path, pg_url: str) -> None:
    """The migration's PostgreSQL branch: location ids go on from 1 after the backfill."""
    root = tmp_path / "store"
    url, blob_url = _write_at_0003(root, catalog=pg_url)
    with casckpt.open(root, chunk_size=4096, cache=tmp_path / "cache") as store:
        _assert_single_copies_on_loc0(url, blob_url)
        _assert_all_restore(store, (1, 2, 3))
        store.locations.add(str(tmp_path / "second"), domain="other")  # id 2, not a clash with 1
        assert _query(url, "SELECT id, name FROM locations ORDER BY id") == [(1, "loc0"), (2, "loc1")]
        store.locations.set_redundancy("replicate:2")
        store.commit(_state(4), run="r", step=4, tags=["t4"])
        _assert_all_restore(store, (1, 2, 3, 4))
    _migrate_url(url, "0003", down=True)
    _migrate_url(url, "0004")
    assert _query(url, "SELECT version_num FROM alembic_version") == [("0004",)]


# -- 0005: delta chain policies -----------------------------------------------------------


def test_0005_adds_run_delta_chains_and_downgrades(tmp_path: Path) -> None:
    root = legacy("deltas", tmp_path / "store")  # format 1: 2 and 3 delta-coded against 1
    with casckpt.open(root, chunk_size=4096) as store:
        store.ops.set_delta_chain(2, run="r")
        deltas = store.ops.stats().delta_chunks
        assert deltas > 0
    url = f"sqlite:///{root / cfg.CATALOG_FILE}"
    _migrate(root, "0004", down=True)
    assert "delta_chain" not in _columns(url, "runs")
    _migrate(root, "0005")
    assert _revision(root) == "0005" and "delta_chain" in _columns(url, "runs")
    with casckpt.open(root, chunk_size=4096) as store:
        assert store.ops.delta_chain("r") == store.ops.delta_chain()  # the run's own policy went with 0004
        assert store.ops.stats().delta_chunks == deltas  # chunks keep their bases either way
        for step in (1, 2, 3):
            assert torch.equal(store.restore(f"r@{step}")["w"], delta_weights(step))
        assert store.ops.check(read_data=True).ok


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
    _tamper(db, "INSERT INTO alembic_version VALUES ('0008')")
    with pytest.raises(CatalogError, match="2 schema revisions"):
        casckpt.open(tmp_path / "s")
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    assert sorted(rows) == [("0008",), (head_revision(),)]
    conn.close()


@pytest.mark.parametrize("revision", ["zzzz", "0099", "0009 "])
def test_unknown_revision_is_refused(tmp_path: Path, revision: str) -> None:
    db = _store(tmp_path / "s")
    _tamper(db, f"UPDATE alembic_version SET version_num='{revision}'")
    with pytest.raises(SchemaTooNewError):
        casckpt.open(tmp_path / "s")


@pytest.mark.parametrize("sql", ["DELETE FROM alembic_version", "DROP TABLE alembic_version"])
def test_missing_revision_is_a_typed_error_and_changes_nothing(tmp_path: Path, sql: str) -> None:
    db = _store(tmp_path / "s")
    _tamper(db, sql)
    with pytest.raises(CatalogError, match="records no schema revision"):
        casckpt.open(tmp_path / "s")
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM versions").fetchone() == (1,)
    conn.close()


# -- 0012: a location being emptied is retiring ----------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new catalog of either database."""
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path / 'catalog.db'}"


def _location_rows(url: str) -> list[tuple[object, ...]]:
    return _query(url, "SELECT name, state FROM locations ORDER BY id")


def _location_audit(url: str) -> list[tuple[object, ...]]:
    rows = _query(url, "SELECT action, target, detail FROM audit_log WHERE target LIKE 'location:%%' "
                       "AND action <> 'location.add' ORDER BY id")  # %% passes psycopg's placeholders
    return [(a, t, d if isinstance(d, dict) else json.loads(str(d))) for a, t, d in rows]


def test_0012_renames_the_state_and_the_audit_trail_and_downgrades(tmp_path: Path, catalog_url: str) -> None:
    dirs = [str(tmp_path / f"d{i}") for i in range(3)]
    with casckpt.open(tmp_path / "store", catalog=catalog_url, blobs=dirs) as store:
        store.locations.retire("loc1")
        store.locations.fail("loc1")  # audited as a change from retiring
        store.locations.retire("loc2")
    now = [("loc0", "active"), ("loc1", "failed"), ("loc2", "retiring")]
    trail = [("location.retire", "location:loc1", {"from": "active"}),
             ("location.fail", "location:loc1", {"from": "retiring"}),
             ("location.retire", "location:loc2", {"from": "active"})]
    assert _location_rows(catalog_url) == now and _location_audit(catalog_url) == trail

    _migrate_url(catalog_url, "0011", down=True)  # as casckpt wrote them before the rename
    assert _location_rows(catalog_url) == [("loc0", "active"), ("loc1", "failed"),
                                           ("loc2", "draining")]  # pre-0012
    assert _location_audit(catalog_url) == [
        ("location.drain", "location:loc1", {"from": "active"}),  # pre-0012
        ("location.fail", "location:loc1", {"from": "draining"}),  # pre-0012
        ("location.drain", "location:loc2", {"from": "active"})]  # pre-0012
    _migrate_url(catalog_url, "0012")
    assert _location_rows(catalog_url) == now and _location_audit(catalog_url) == trail

    _migrate_url(catalog_url, "0011", down=True)
    with casckpt.open(tmp_path / "store", catalog=catalog_url, blobs=dirs) as store:  # upgraded on open
        assert [(loc.name, loc.state) for loc in store.locations.list()] == now
        assert [e.action for e in store.ops.audit(action="location.retire")] == ["location.retire"] * 2
        assert store.locations.activate("loc2").state == "active"
        assert [(e.action, e.detail) for e in store.ops.audit(action="location.activate")] == [
            ("location.activate", {"from": "retiring"})]


from make_draining import copy as copy_draining  # noqa: E402
from make_draining import state as draining_state  # noqa: E402


def _restores_draining(store: casckpt.Store) -> None:
    for step in (1, 2):
        got, want = store.restore(f"tag:t{step}"), draining_state(step)
        assert torch.equal(got["w"], want["w"]) and got["step"] == step


def test_a_store_written_while_a_location_was_draining_opens_checks_and_retires(tmp_path: Path) -> None:
    """The golden store-draining, written by casckpt before schema 0012 (loc1's state as it
    spelt it, in the catalog and in the ``refs/locations`` records; its shards not moved yet)."""
    root = copy_draining(tmp_path / "store")
    assert _revision(root) == "0011"
    with casckpt.open(root) as store:
        assert _revision(root) == head_revision()
        assert [(loc.name, loc.state) for loc in store.locations.list()] == [("loc0", "active"),
                                                                            ("loc1", "retiring")]
        assert [(e.action, e.detail) for e in store.ops.audit(action="location.retire")] == [
            ("location.retire", {"from": "active"})]
        record = json.loads((root / "refs" / "locations").read_bytes())  # the newest record
        assert record["locations"][1]["state"] == "draining"  # pre-0012: still the old name ...
        assert store.ops.check(read_data=True).ok  # ... and are read as retiring: they agree
        _restores_draining(store)
        repaired = store.ops.repair()  # nowhere to move them yet; the old record is not rewritten
        assert repaired.unrepaired and repaired.shards_moved == 0 and repaired.records_written == 0
        assert {loc.name: loc.shards for loc in store.locations.list()} == {"loc0": 2, "loc1": 2}
        store.locations.add(str(tmp_path / "third"), domain="third")  # somewhere to move them
        assert store.ops.repair().shards_moved == 2
        assert {loc.name: loc.shards for loc in store.locations.list()} == {"loc0": 2, "loc1": 0,
                                                                           "loc2": 2}
        assert store.ops.check(read_data=True).ok
        _restores_draining(store)


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_a_catalog_rebuilt_from_a_store_written_while_a_location_was_draining(
        tmp_path: Path, database: str, request: pytest.FixtureRequest) -> None:
    """``catalog rebuild`` from the golden store-draining's objects alone: the newest
    ``refs/locations`` record's ``draining`` comes back as ``retiring`` (pre-0012 spelling)."""
    root = copy_draining(tmp_path / "store")
    (root / cfg.CATALOG_FILE).unlink()
    catalog = request.getfixturevalue("pg_url") if database == "postgres" else None
    with casckpt.open(root, catalog=catalog, recover=True) as store:
        store.ops.rebuild_catalog()
    with casckpt.open(root, catalog=catalog) as store:
        assert [(loc.name, loc.state) for loc in store.locations.list()] == [("loc0", "active"),
                                                                            ("loc1", "retiring")]
        # a retiring location's copies are not registered again (they may be stale): loc0's are
        assert {loc.name: loc.shards for loc in store.locations.list()} == {"loc0": 2, "loc1": 0}
        assert store.ops.check(read_data=True).ok
        _restores_draining(store)


# -- 0016: mirrors ----------------------------------------------------------------------------


def test_0016_adds_the_mirror_tables_and_downgrades(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit({"w": torch.arange(64.0)}, run="r", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_last=1)
        assert [v.status for v in store.mirrors.push("m").versions] == ["sent"]
    assert {"mirrors", "mirror_versions"} <= _tables(root) and _revision(root) == head_revision()
    _migrate(root, "0015", down=True)
    assert _revision(root) == "0015" and not {"mirrors", "mirror_versions"} & _tables(root)
    _migrate(root, "0016")
    assert {"mirrors", "mirror_versions"} <= _tables(root)
    _migrate(root, "0015", down=True)
    with casckpt.open(root) as store:  # upgraded on open, with no mirror (they went with 0015)
        assert _revision(root) == head_revision() and store.mirrors.list() == []
        assert torch.equal(store.restore("r@1")["w"], torch.arange(64.0))


# -- 0017: a mirror's destination identity, and its versions' slots -------------------------


def test_0017_adds_the_mirror_identity_columns_keeps_the_rows_and_downgrades(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit({"w": torch.arange(64.0)}, run="r", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_last=1)
    _migrate(root, "0016", down=True)
    url = f"sqlite:///{root / cfg.CATALOG_FILE}"
    assert "dest_store_id" not in _columns(url, "mirrors")
    assert not {"created_at", "metrics"} & _columns(url, "mirror_versions")
    with casckpt.open(root) as store:  # upgraded on open: the mirror kept, and it runs
        assert _revision(root) == head_revision() and [m.name for m in store.mirrors.list()] == ["m"]
        assert [v.status for v in store.mirrors.push("m").versions] == ["sent"]
    assert "dest_store_id" in _columns(url, "mirrors")
    assert {"created_at", "metrics"} <= _columns(url, "mirror_versions")


# -- 0018: the re-key map of copies across chunk-id keys ----------------------------------------


def test_0018_adds_the_rekey_map_and_downgrades(tmp_path: Path) -> None:
    key = tmp_path / "k"
    casckpt.generate_key_file(key)
    root = tmp_path / "enc"
    with casckpt.open(tmp_path / "src") as src, casckpt.open(root, key_file=key) as enc:
        for step in (1, 2):
            src.commit({"w": torch.arange(4096.0), "s": torch.full((4096,), float(step))}, run="r", step=step)
        src.copy("r@1", to=enc)
    assert "rekey_map" in _tables(root) and _revision(root) == head_revision()
    _migrate(root, "0017", down=True)
    assert _revision(root) == "0017" and "rekey_map" not in _tables(root)
    with casckpt.open(tmp_path / "src") as src, casckpt.open(root, key_file=key, create=False) as enc:
        assert _revision(root) == head_revision()  # upgraded on open, the map empty: r@2 read whole
        assert [v.step for v in src.copy("r@2", to=enc).versions] == [2]
        assert torch.equal(enc.restore("r@2")["s"], torch.full((4096,), 2.0))
    assert "rekey_map" in _tables(root)


# -- 0019: what a mirror sent stays its own through a failure; the tags it carried -------------


def test_0019_marks_what_mirrors_sent_their_own_adds_the_carried_tags_and_downgrades(tmp_path: Path) -> None:
    from casckpt.catalog import mirrors as mirror_sql

    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit({"w": torch.arange(64.0)}, run="r", step=1, tags=["best"])
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_last=1)
        store.mirrors.push("m")
    _migrate(root, "0018", down=True)
    url = f"sqlite:///{root / cfg.CATALOG_FILE}"
    assert "owned" not in _columns(url, "mirror_versions") and "mirror_tags" not in _tables(root)
    with casckpt.open(root) as store:  # upgraded on open: the sent row is the mirror's own
        assert _revision(root) == head_revision()
        assert [(o.state, o.owned) for o in mirror_sql.outcomes(store._core.catalog, "m")] == [("sent", True)]
        assert mirror_sql.carried(store._core.catalog, "m") == {}
        assert store.mirrors.push("m").nothing_sent
    assert "mirror_tags" in _tables(root)
