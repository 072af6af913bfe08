"""Catalog schema versions: older catalogs are upgraded on open, newer ones refused untouched."""

from __future__ import annotations

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
from casckpt.errors import CasckptError, SchemaTooNewError

FUTURE = "9999_future"


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


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(3000, dtype=torch.float32) * step, "step": step}


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
        assert store.check(read_data=True).ok
    with _db(root) as conn:
        (store_id,) = conn.execute("SELECT value FROM store_info WHERE key = 'store_id'").fetchone()
    assert len(store_id) == 32


def test_upgrade_keeps_existing_versions(tmp_path: Path) -> None:
    """A store written at head, taken back to 0001, then opened: its versions survive."""
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=4096) as store:
        for step in (1, 2):
            store.commit(_state(step), run="r", step=step, tags=[f"t{step}"])
    _migrate(root, "0001", down=True)
    assert _revision(root) == "0001" and "store_info" not in _tables(root)

    with casckpt.open(root, chunk_size=4096) as store:
        assert _revision(root) == head_revision()
        assert [v.step for v in store.log("r")] == [2, 1]
        assert store.resolve("tag:t1").step == 1
        for step in (1, 2):
            _assert_restores(store, step)
        store.commit(_state(3), run="r", step=3)
        _assert_restores(store, 3)
        assert store.check(read_data=True).ok


def test_reopening_at_head_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit(_state(1), run="r", step=1)
    before = _dump(root)
    casckpt.open(root).close()
    assert _dump(root) == before



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
        assert conn.execute("SELECT COUNT(*) FROM store_info").fetchone() == (1,)
    with casckpt.open(root) as store:
        assert sorted(r.name for r in store.runs()) == ["rank0", "rank1"]
        assert store.check().ok


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
