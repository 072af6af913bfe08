"""The audit trail: every change leaves exactly its row, written in the change's own transaction;
the rows answer filters, ``casckpt audit`` shows them, and old catalogs gain the table."""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
import time
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from doubles import ForkedPython
from sqlalchemy import create_engine, text
from test_migrations import _migrate, _revision, _tables
from typer.testing import CliRunner

import casckpt
from casckpt.catalog import audit
from casckpt.catalog.migrate import head_revision
from casckpt.cli.main import app
from casckpt.types import AuditEntry


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step}


def _new(store: casckpt.Store, seen: int) -> list[AuditEntry]:
    """The rows added since the trail held ``seen``."""
    return store.ops.audit()[seen:]


def _is_this_process(entry: AuditEntry) -> None:
    assert (entry.os_user, entry.host, entry.pid) == (getpass.getuser(), socket.gethostname(), os.getpid())
    assert entry.casckpt_version == casckpt.__version__
    assert abs(entry.at.timestamp() - time.time()) < 60 and entry.at.tzinfo is not None


def _one(store: casckpt.Store, seen: int, action: str, target: str | None) -> AuditEntry:
    rows = _new(store, seen)
    assert [(r.action, r.target) for r in rows] == [(action, target)]
    _is_this_process(rows[0])
    return rows[0]


def test_each_action_leaves_exactly_its_row(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s", cache=tmp_path / "cache") as store:
        assert store.ops.audit() == []
        v1 = store.commit(_state(1), run="r", step=1, tags=["first"])
        rows = store.ops.audit()
        assert [(r.action, r.target) for r in rows] == [("run.create", "run:r"), ("commit", v1.id)]
        for row in rows:
            _is_this_process(row)
            assert row.db_user is None  # SQLite has no roles
        assert rows[1].detail == {"run": "r", "step": 1, "new_bytes": v1.new_bytes,
                                  "stored_bytes": v1.stored_bytes,
                                  "logical_bytes": v1.logical_bytes, "tags": ["first"]}
        v2 = store.commit(_state(2), run="r", step=2)
        assert _one(store, 2, "commit", v2.id).detail["step"] == 2  # the run exists: no run.create

        seen = len(store.ops.audit())
        store.tag(v1.id, "best")
        assert _one(store, seen, "tag", "tag:best").detail == {"version": v1.id, "moved_from": None}
        store.tag(v2.id, "best")  # a move names where the tag was
        assert _one(store, seen + 1, "tag", "tag:best").detail == {"version": v2.id, "moved_from": v1.id}
        store.tag(v2.id, "best")  # already there: nothing changed, nothing recorded
        assert _new(store, seen + 2) == []

        seen = len(store.ops.audit())
        store.delete(v1.id, reason="bad data")
        assert _one(store, seen, "delete", v1.id).detail == {"run": "r", "step": 1, "reason": "bad data"}
        store.undelete(v1.id)
        assert _one(store, seen + 1, "undelete", v1.id).detail == {"run": "r", "step": 1}

        seen = len(store.ops.audit())
        store.fork(v1.id, "ft")
        assert _one(store, seen, "run.fork", "run:ft").detail == {"from": v1.id}
        store.retention.set("r", keep_last=1)
        assert _one(store, seen + 1, "retention.set", "run:r").detail == {
            "policy": {"keep_last": 1, "keep_tagged": True}}
        store.retention.clear("r")
        _one(store, seen + 2, "retention.clear", "run:r")
        store.retention.set("new-run", keep_last=2)  # creates the run, then sets its policy
        assert [r.action for r in _new(store, seen + 3)] == ["run.create", "retention.set"]

        seen = len(store.ops.audit())
        added = store.locations.add(str(tmp_path / "second"), domain="other")
        target = f"location:{added.name}"
        assert _one(store, seen, "location.add", target).detail == {
            "url": (tmp_path / "second").as_uri(), "domain": "other"}
        store.locations.retire(added.name)
        assert _one(store, seen + 1, "location.retire", target).detail == {"from": "active"}
        store.locations.fail(added.name)
        assert _one(store, seen + 2, "location.fail", target).detail == {"from": "retiring"}
        store.locations.activate(added.name)
        assert _one(store, seen + 3, "location.activate", target).detail == {"from": "failed"}

        seen = len(store.ops.audit())
        store.ops.repair()
        assert _one(store, seen, "repair", None).detail["unrepaired"] == 0

        seen = len(store.ops.audit())
        store.delete(v2.id)
        store.gc(dry_run=True, grace=0)  # a plan changes nothing: not recorded
        assert [r.action for r in _new(store, seen)] == ["delete"]
        report = store.gc(grace=0)
        gc_row = _one(store, seen + 1, "gc", None)
        assert report.versions_purged == 1 and report.bytes_freed > 0
        assert gc_row.detail["versions_purged"] == 1
        assert gc_row.detail["bytes_freed"] == report.bytes_freed
        assert gc_row.detail["chunks_swept"] == report.chunks_swept and gc_row.detail["dry_run"] is False
        assert [r.id for r in store.ops.audit()] == list(range(1, seen + 3)), "gc removed audit rows"
        assert store.ops.check(read_data=True).ok


def test_storage_policy_changes_are_recorded_once(store: casckpt.Store) -> None:
    store.ops.set_delta_chain(4)
    store.ops.set_delta_chain(4)  # unchanged: nothing recorded
    store.ops.set_delta_chain(2, run="r")  # creates the run
    store.locations.set_redundancy("none", run="r")
    store.locations.set_redundancy("none", run="r")
    assert [(r.action, r.target, dict(r.detail)) for r in store.ops.audit()] == [
        ("delta_chain.set", None, {"delta_chain": 4, "from": None}),
        ("run.create", "run:r", {}),
        ("delta_chain.set", "run:r", {"delta_chain": 2, "from": None}),
        ("redundancy.set", "run:r", {"redundancy": "none", "from": None}),
    ]


def test_other_components_record_through_the_catalog(store: casckpt.Store) -> None:
    """The hook the encryption work (``key.*``) and a read-only open (switched off) use."""
    catalog = store._core.ctx.catalog
    catalog.record_audit("key.rotate", "key:k2", {"previous": "k1"})
    (row,) = store.ops.audit()
    assert (row.action, row.target, dict(row.detail)) == ("key.rotate", "key:k2", {"previous": "k1"})
    _is_this_process(row)
    assert [r.action for r in store.ops.audit(action="key")] == ["key.rotate"]
    with pytest.raises(ValueError, match="audit action"):
        catalog.record_audit("")
    catalog.audit_enabled = False
    try:
        catalog.record_audit("key.add", "key:k3")
        store.commit(_state(1), run="r", step=1)
        assert [r.action for r in store.ops.audit()] == ["key.rotate"]
    finally:
        catalog.audit_enabled = True


def test_audit_row_rolls_back_with_a_publish_that_fails(store: casckpt.Store,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's row is written inside the publishing transaction: a publish that fails
    after it (here: on the statement right after) leaves neither the version nor the row."""
    real = audit.add

    def then_fail(conn: object, action: str, *args: object) -> None:
        real(conn, action, *args)  # type: ignore[arg-type]
        if action == "commit":
            raise RuntimeError("crashed between the audit row and COMMIT")

    monkeypatch.setattr(audit, "add", then_fail)
    with pytest.raises(RuntimeError, match="crashed between"):
        store.commit(_state(1), run="r", step=1)
    monkeypatch.undo()
    assert store.log() == []
    assert [r.action for r in store.ops.audit()] == []  # not even the run it would have created
    v = store.commit(_state(1), run="r", step=1)
    assert [(r.action, r.target) for r in store.ops.audit()] == [("run.create", "run:r"), ("commit", v.id)]


KILLED = """
import os, sys, torch, casckpt
from casckpt.catalog import audit
real = audit.add
def record_then_die(conn, action, *args):
    real(conn, action, *args)
    if action == "commit":
        os._exit(9)  # killed with the row written, before the transaction commits
audit.add = record_then_die
with casckpt.open(sys.argv[1]) as store:
    store.commit({"w": torch.ones(100)}, run="r", step=2)
"""


def test_a_killed_commit_leaves_no_audit_row(tmp_path: Path, forked_python: ForkedPython) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        v1 = store.commit(_state(1), run="r", step=1)
    done = forked_python.run(["-c", KILLED, str(root)], timeout=120, cwd=tmp_path)
    assert done.returncode == 9, done.stderr
    with casckpt.open(root) as store:
        assert [v.step for v in store.log("r")] == [1]
        assert [(r.action, r.target) for r in store.ops.audit(action="commit")] == [("commit", v1.id)]
        visible = {v.id for v in store.log()}
        assert {r.target for r in store.ops.audit(action="commit")} == visible
        assert store.ops.check().ok


def test_filters(store: casckpt.Store) -> None:
    a = store.commit(_state(1), run="r", step=1)
    time.sleep(0.05)
    middle = time.time()
    time.sleep(0.05)
    b = store.commit(_state(2), run="r", step=2)
    store.tag(b.id, "best")
    all_rows = store.ops.audit()
    assert [r.action for r in all_rows] == ["run.create", "commit", "commit", "tag"]
    assert [r.id for r in all_rows] == sorted(r.id for r in all_rows)

    assert [r.target for r in store.ops.audit(since=middle)] == [b.id, "tag:best"]
    assert [r.target for r in store.ops.audit(until=middle)] == ["run:r", a.id]
    aware = datetime.fromtimestamp(middle, timezone.utc)
    assert [r.target for r in store.ops.audit(since=aware)] == [b.id, "tag:best"]
    assert [r.target for r in store.ops.audit(action="commit")] == [a.id, b.id]
    assert [r.target for r in store.ops.audit(action="run")] == ["run:r"]  # a family: run.*
    assert store.ops.audit(action="com") == []  # not a prefix match within a word
    assert [r.action for r in store.ops.audit(target=b.id[:10])] == ["commit"]
    assert [r.action for r in store.ops.audit(target="tag:best")] == ["tag"]
    assert [r.action for r in store.ops.audit(limit=2)] == ["commit", "tag"]  # the newest, oldest first
    assert store.ops.audit(limit=0) == []
    assert store.ops.audit(since=time.time() + 60) == []
    for bad in ({"limit": -1}, {"since": "yesterday"}, {"action": ""}):
        with pytest.raises(casckpt.errors.InvalidArgumentError):
            store.ops.audit(**bad)  # type: ignore[arg-type]


def test_cli_table_and_json(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        v = store.commit(_state(1), run="r", step=1)
        store.tag(v.id, "best")
    runner = CliRunner()
    table = runner.invoke(app, ["--store", str(root), "audit"])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["AT", "ACTION", "TARGET", "WHO", "DETAIL"]
    who = f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"
    assert lines[3].split()[2:] == ["commit", v.short_id, who, "r@1", "new", "16.0", "KiB"]
    assert lines[4].split()[2:5] == ["tag", "tag:best", who]
    assert v.short_id in lines[4] and v.id not in lines[4]

    as_json = runner.invoke(app, ["--store", str(root), "audit", "--json", "--action", "commit"])
    assert as_json.exit_code == 0, as_json.output
    (row,) = json.loads(as_json.stdout)
    assert (row["action"], row["target"], row["pid"], row["db_user"]) == ("commit", v.id, os.getpid(), None)
    assert datetime.fromisoformat(row["at"]).tzinfo is not None and row["detail"]["step"] == 1

    limited = runner.invoke(app, ["--store", str(root), "audit", "--since", "1h", "-n", "1", "--json"])
    assert [r["action"] for r in json.loads(limited.stdout)] == ["tag"]
    none = runner.invoke(app, ["--store", str(root), "audit", "--until", "2000-01-01"])
    assert none.exit_code == 0 and "no audit entries match" in none.output
    bad = runner.invoke(app, ["--store", str(root), "audit", "--since", "soon"])
    assert bad.exit_code == 2 and "cannot read time" in bad.output


def test_postgres_records_the_database_role(tmp_path: Path, pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            role = conn.execute(text("SELECT current_user")).scalar_one()
    finally:
        engine.dispose()
    with casckpt.open(tmp_path / "s", catalog=pg_url, cache=tmp_path / "cache") as store:
        v = store.commit(_state(1), run="r", step=1)
        store.delete(v.id)
        rows = store.ops.audit()
        assert [(r.action, r.target) for r in rows] == [
            ("run.create", "run:r"), ("commit", v.id), ("delete", v.id)]
        for row in rows:
            _is_this_process(row)
            assert row.db_user == role
        assert [r.action for r in store.ops.audit(target=v.id[:8], limit=1)] == ["delete"]


def test_upgrade_from_0008_keeps_data_and_records_the_migration(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        v = store.commit(_state(1), run="r", step=1, tags=["t"])
    _migrate(root, "0008", down=True)
    assert _revision(root) == "0008" and "audit_log" not in _tables(root)

    with casckpt.open(root) as store:
        assert _revision(root) == head_revision() >= "0009"
        assert store.resolve("tag:t").id == v.id
        (row,) = store.ops.audit()
        assert (row.action, row.target, dict(row.detail)) == (
            "catalog.migrate", None, {"from": "0008", "to": head_revision()})
        _is_this_process(row)
        assert torch.equal(store.restore("r@1")["w"], _state(1)["w"])  # type: ignore[index]
        v2 = store.commit(_state(2), run="r", step=2)
        assert [r.target for r in store.ops.audit(action="commit")] == [v2.id]
    casckpt.open(root).close()  # at head: nothing to migrate, nothing recorded
    with closing_db(root) as conn:
        migrations = "SELECT COUNT(*) FROM audit_log WHERE action = 'catalog.migrate'"
        assert conn.execute(migrations).fetchone() == (1,)
    _migrate(root, "0008", down=True)
    _migrate(root, "0009")
    with closing_db(root) as conn:
        assert conn.execute("SELECT COUNT(*) FROM audit_log").fetchone() == (0,)  # a new, empty table
        assert conn.execute("SELECT COUNT(*) FROM versions").fetchone() == (2,)


def closing_db(root: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(root / "catalog.db"))


def test_a_rebuilt_catalog_records_the_rebuild_not_each_version(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        for step in (1, 2):
            store.commit(_state(step), run="r", step=step)
    os.replace(root / "catalog.db", tmp_path / "old.db")
    for suffix in ("-wal", "-shm"):
        (root / f"catalog.db{suffix}").unlink(missing_ok=True)
    with casckpt.open(root, recover=True) as store:
        report = store.ops.rebuild_catalog()
        (row,) = store.ops.audit()
        assert (row.action, row.target) == ("catalog.rebuild", None)
        assert row.detail["versions"] == report.versions == 2 and row.detail["skipped"] == 0
        _is_this_process(row)


@pytest.mark.skipif(not hasattr(os, "fork") or os.geteuid() != 0, reason="needs root to change uid")
def test_who_without_a_passwd_entry_names_the_uid() -> None:
    """A container running as an arbitrary uid: no passwd entry, no USER variable."""
    import pwd

    uid = 54321
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
                os.environ.pop(name, None)
            os.setuid(uid)
            me = audit.who()
            os.write(write, f"{me.os_user} {me.pid}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    os.waitpid(child, 0)
    assert said == f"uid:{uid} {child}"
