"""Read-only mode (issue 19): a store opened read-only (asked, or because this process cannot
write it) restores, queries and checks, refuses every write with ReadOnlyStoreError, and
changes nothing anywhere: a root-owned local store read by an unprivileged uid, a catalog
read through a SELECT-only PostgreSQL role, and S3 locations that refuse writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch

import casckpt
from casckpt.errors import CasckptError, ReadOnlyStoreError, ReadOnlyStoreWarning

sys.path.insert(0, str(Path(__file__).parent))
from casckpt.testing.faultproxy import FaultProxy

TESTS = Path(__file__).resolve().parent
WORKTREE = TESTS.parent
NOBODY = 65534
WRITES = ("commit", "commit_async", "tag", "gc", "delete", "set_retention", "add_dir", "repair",
          "dcp_writer")


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 70, generator=gen), "b": torch.full((50,), float(step)),
            "step": step}


def _build(store: casckpt.Store) -> None:
    store.commit(_state(1), run="r", step=1, metrics={"loss": 1.0})
    store.commit(_state(2), run="r", step=2, metrics={"loss": 0.5}, tags=["best"])
    assert store.ops.check(read_data=True).ok


def exercise(store: casckpt.Store) -> dict[str, Any]:
    """Every read a reader does, then every write it must be refused; what it saw (JSON)."""
    out: dict[str, Any] = {"read_only": store.read_only}
    out["restore"] = torch.equal(store.restore("tag:best")["w"], _state(2)["w"])
    out["load_tensor"] = torch.equal(store.load_tensor("r@1", "b"), _state(1)["b"])  # type: ignore[arg-type]
    out["log"] = [v.step for v in store.log("r")]
    out["show"] = store.show("r@2").version.step
    out["diff"] = sorted(c.path for c in store.diff("r@1", "r@2").changed)
    out["history"] = len(store.history("r", "w"))
    out["runs"] = [r.name for r in store.runs()]
    out["check"] = store.ops.check(read_data=True).ok
    calls: dict[str, Callable[[], object]] = {
        "commit": lambda: store.commit(_state(3), run="r", step=3),
        "commit_async": lambda: store.commit(_state(3), run="r", step=3, block=False),
        "tag": lambda: store.tag("r@1", "other"),
        "gc": lambda: store.gc(grace=0),
        "delete": lambda: store.delete("r@1"),
        "set_retention": lambda: store.retention.set("r", keep_last=1),
        "add_dir": lambda: store.add_dir(".", run="d", step=1),
        "repair": lambda: store.ops.repair(),
        "dcp_writer": lambda: store.dcp_writer(run="r", step=3),
    }
    refused: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
        except ReadOnlyStoreError as exc:
            refused[name] = str(exc)
        else:
            refused[name] = None
    out["refused"] = refused
    return out


def _assert_reader(seen: dict[str, Any], because: str) -> None:
    assert seen["read_only"] is not None and because in seen["read_only"]
    assert seen["restore"] and seen["load_tensor"] and seen["check"]
    assert seen["log"] == [2, 1] and seen["show"] == 2 and seen["runs"] == ["r"]
    assert seen["diff"] == ["b", "w"] and seen["history"] == 2
    for name in WRITES:
        message = seen["refused"][name]
        assert message is not None, f"{name} was not refused"
        assert "needs write access to" in message and because in message


def _tree_digest(root: Path) -> dict[str, tuple[int, int, int, int, str]]:
    """Every path under ``root``: mode, owner, size, mtime and content hash."""
    out = {}
    for path in sorted([root, *root.rglob("*")]):
        st = path.lstat()
        data = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, data)
    return out


# -- local: a root-owned store read by an unprivileged uid ---------------------------------

CHILD = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, sys.argv[2])
    import casckpt
    from test_readonly import exercise
    out = {}
    for mode, read_only in (("auto", None), ("asked", True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            store = casckpt.open(sys.argv[1], create=False, read_only=read_only)
        out[mode] = exercise(store)
        store.close()
        out[mode]["warnings"] = [str(w.message) for w in seen
                                 if w.category.__name__ == "ReadOnlyStoreWarning"]
    print(json.dumps(out))
""")


def _as_nobody(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": str(home), "PYTHONPATH": str(WORKTREE),
           "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run([*drop, sys.executable, *args], env=env, cwd=home, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture
def root_owned_store() -> Iterator[tuple[Path, Path]]:
    """A store built by root, readable by everyone, writable by root only; and a home the
    unprivileged uid owns."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv: builds a root-owned store and reads it as uid 65534")
    # pytest's tmp dirs sit under a 0700 pytest-of-<user> that every pytest session starting
    # meanwhile resets to 0700, so the uid gets a temporary directory of its own beside them
    with tempfile.TemporaryDirectory(prefix="casckpt-readonly-") as tmp:
        top = Path(tmp)
        os.chmod(top, 0o755)
        root = top / "store"
        with casckpt.open(root) as store:
            _build(store)
        for path in [root, *root.rglob("*")]:
            os.chown(path, 0, 0)
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        home = top / "nobody"
        home.mkdir()
        os.chown(home, NOBODY, NOBODY)
        probe = _as_nobody(["-c", "import casckpt, torch"], home)
        if probe.returncode != 0:
            pytest.skip(f"uid {NOBODY} cannot run this Python and casckpt: {probe.stderr.strip()[-300:]}")
        yield root, home


def test_unprivileged_uid_reads_a_root_owned_store(root_owned_store: tuple[Path, Path]) -> None:
    root, home = root_owned_store
    before = _tree_digest(root)
    done = _as_nobody(["-c", CHILD, str(root), str(TESTS)], home)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_reader(seen["auto"], "not writable by this process (uid 65534)")
    assert len(seen["auto"]["warnings"]) == 1 and "read-only" in seen["auto"]["warnings"][0]
    _assert_reader(seen["asked"], "it was asked to be")
    assert seen["asked"]["warnings"] == []
    assert _tree_digest(root) == before


def test_cli_as_unprivileged_uid(root_owned_store: tuple[Path, Path]) -> None:
    root, home = root_owned_store
    before = _tree_digest(root)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _as_nobody(["-m", "casckpt.cli.main", "--store", str(root), *args], home)

    for args in (["log"], ["show", "r@2"], ["check", "--read-data"], ["runs"], ["diff", "r@1", "r@2"]):
        done = cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert done.stderr.count("opening the store read-only") == 1, (args, done.stderr)
    quiet = _as_nobody(["-m", "casckpt.cli.main", "--read-only", "--store", str(root), "log"], home)
    assert quiet.returncode == 0 and "read-only" not in quiet.stderr, quiet.stderr
    for args in (["tag", "r@1", "x"], ["gc", "--grace", "0"], ["delete", "r@1"]):
        done = cli(*args)
        assert done.returncode == 8, (args, done.stdout, done.stderr)
        assert "needs write access" in done.stderr, (args, done.stderr)
    assert _tree_digest(root) == before


def test_a_store_behind_a_directory_the_uid_cannot_search_is_denied(
        root_owned_store: tuple[Path, Path]) -> None:
    root, home = root_owned_store
    os.chmod(root.parent, 0o700)  # the uid may no longer look inside the store's parent
    done = _as_nobody(["-m", "casckpt.cli.main", "--store", str(root), "log"], home)
    assert done.returncode == 8, (done.stdout, done.stderr)  # denied, not an internal error
    assert "cannot reach the store" in done.stderr and "Traceback" not in done.stderr, done.stderr


# -- explicit read_only on a writable store; migrations ------------------------------------

def test_read_only_store_writes_nothing_even_where_it_could(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        _build(store)
    before = _tree_digest(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReadOnlyStoreWarning)  # asked: no warning
        with casckpt.open(root, read_only=True) as store:
            _assert_reader(exercise(store), "it was asked to be")
    assert _tree_digest(root) == before


def test_gc_dry_run_on_a_read_only_store_plans_retention_and_writes_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    root = tmp_path / "store"
    with casckpt.open(root) as store:
        _build(store)
        store.commit(_state(3), run="r", step=3)
        store.delete("r@1")
        store.retention.set("r", keep_last=1)  # r@2 (tagged best) stays; nothing else would
        writable = store.gc(dry_run=True, grace=0)
    before = _tree_digest(root)
    with casckpt.open(root, read_only=True) as store:
        report = store.gc(dry_run=True, grace=0)
        assert not report.space_counted and report.bytes_freed == 0
        assert (report.versions_deleted, report.versions_purged) == (
            writable.versions_deleted, writable.versions_purged) == (0, 1)
        assert [len(p.deleted) for p in report.retention] == [len(p.deleted) for p in writable.retention]
        with pytest.raises(ReadOnlyStoreError):
            store.gc(grace=0)
    done = CliRunner().invoke(app, ["--read-only", "--store", str(root), "gc", "--dry-run", "--grace", "0s"])
    assert done.exit_code == 0 and "not counted" in done.output, done.output
    as_json = CliRunner().invoke(app, ["--read-only", "--store", str(root), "gc", "--dry-run", "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["space_counted"] is False
    assert _tree_digest(root) == before


def test_dcp_load_checkout_and_export_read_only(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root, files = tmp_path / "store", tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    (files / "sub" / "a.txt").write_bytes(b"hello read-only")
    with casckpt.open(root) as store:
        _build(store)
        dcp.save({"w": _state(5)["w"]}, storage_writer=store.dcp_writer(run="d", step=1))
        store.add_dir(files, run="dirs", step=1)
    before = _tree_digest(root)
    with casckpt.open(root, read_only=True) as store:
        target = {"w": torch.zeros(300, 70)}
        dcp.load(target, storage_reader=store.dcp_reader("d@1"))
        assert torch.equal(target["w"], _state(5)["w"])
        out = store.checkout("dirs@1", tmp_path / "out")
        assert (out / "sub" / "a.txt").read_bytes() == b"hello read-only"
        store.export("r@2", tmp_path / "export", format="pt")
        assert (tmp_path / "export" / "checkpoint.pt").is_file()
        with pytest.raises(ReadOnlyStoreError, match="rebuild_catalog needs"):
            store.ops.rebuild_catalog()
    assert _tree_digest(root) == before


def test_a_reader_does_not_heal_what_it_reconstructs(tmp_path: Path) -> None:
    root, dirs = tmp_path / "store", [tmp_path / "d0", tmp_path / "d1"]
    with casckpt.open(root, blobs=[str(d) for d in dirs], redundancy="replicate:2") as store:
        _build(store)
    db = sqlite3.connect(root / "catalog.db")
    first = [Path(unquote(urlsplit(url).path)) / key for url, key in db.execute(
        "SELECT l.url, s.key FROM shards s JOIN locations l ON l.id = s.location_id WHERE s.idx = 0")]
    db.close()
    assert first and all(p.is_file() for p in first)
    intact = {p: p.read_bytes() for p in first}
    for path in first:  # damage the copy each read tries first: it must reconstruct
        data = bytearray(intact[path])
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    damaged, catalog = _tree_digest(tmp_path), (root / "catalog.db").read_bytes()
    with casckpt.open(root, read_only=True) as store:
        assert torch.equal(store.restore("r@2")["w"], _state(2)["w"])
        assert torch.equal(store.restore("r@1")["w"], _state(1)["w"])
        assert not store.ops.check(read_data=True).ok  # reported, not repaired
    assert _tree_digest(tmp_path) == damaged and (root / "catalog.db").read_bytes() == catalog
    with casckpt.open(root) as store:  # a writer reading the same way heals: the test can fail
        store.restore("r@2")
        store.restore("r@1")
    assert any(p.read_bytes() == intact[p] for p in first)


def test_reader_sees_a_live_writers_commits(tmp_path: Path) -> None:
    """With a writer holding the SQLite catalog open (its -shm exists) a reader opens it
    ``mode=ro`` and sees commits as they land (an ``immutable`` one would not)."""
    root = tmp_path / "store"
    with casckpt.open(root) as writer:
        _build(writer)
        writer.log()  # the writer's pooled connection keeps the WAL index
        assert (root / "catalog.db-shm").exists()
        with casckpt.open(root, read_only=True) as reader:
            assert [v.step for v in reader.log("r")] == [2, 1]
            writer.commit(_state(3), run="r", step=3)
            assert [v.step for v in reader.log("r")] == [3, 2, 1]
            assert torch.equal(reader.restore("r@3")["w"], _state(3)["w"])
            with pytest.raises(ReadOnlyStoreError):
                reader.commit(_state(4), run="r", step=4)
        assert writer.ops.check(read_data=True).ok


def test_env_var_opens_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        _build(store)
    monkeypatch.setenv("CASCKPT_READ_ONLY", "1")
    with casckpt.open(root) as store, pytest.raises(ReadOnlyStoreError, match="tag needs"):
        store.tag("r@1", "x")
    with casckpt.open(root, read_only=False) as store:  # the argument wins over the variable
        assert store.read_only is None
        store.tag("r@1", "x")


def test_read_only_never_creates_a_store(tmp_path: Path) -> None:
    with pytest.raises(ReadOnlyStoreError, match="creating a store needs write access"):
        casckpt.open(tmp_path / "new", read_only=True)
    assert not (tmp_path / "new").exists()


def test_older_catalog_is_not_migrated_read_only(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        _build(store)
    db = sqlite3.connect(root / "catalog.db")  # pretend an older casckpt wrote it
    (head,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
    db.execute("UPDATE alembic_version SET version_num = ?", (f"{int(head) - 1:04d}",))
    db.commit()
    db.close()
    before = _tree_digest(root)
    with pytest.raises(ReadOnlyStoreError, match="casckpt migrate") as caught:
        casckpt.open(root, read_only=True)
    assert caught.value.right == "catalog:migrate"
    assert _tree_digest(root) == before


# -- PostgreSQL: a role with SELECT only -------------------------------------------------------

def _pg_dump(conninfo: str) -> dict[str, list[tuple[Any, ...]]]:
    import psycopg

    with psycopg.connect(conninfo) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]
        return {t: sorted(map(repr, conn.execute(f'SELECT * FROM "{t}"'))) for t in tables}  # type: ignore[misc]


def test_select_only_postgres_role(tmp_path: Path, pg_url: str) -> None:
    blobs = tmp_path / "blobs"
    with casckpt.open(None, blobs=str(blobs), catalog=pg_url) as store:
        _build(store)
    admin = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    database = pg_url.split("?")[0].rsplit("/", 1)[1]
    role = f"reader_{database[-8:]}"
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    reader = pg_url.replace("postgres:@", f"{role}:@", 1)
    assert reader != pg_url
    rows, files = _pg_dump(admin), _tree_digest(blobs)
    with pytest.warns(ReadOnlyStoreWarning, match=f"PostgreSQL role '{role}' may not INSERT"):
        store = casckpt.open(None, blobs=str(blobs), catalog=reader)
    with store:
        _assert_reader(exercise(store), f"role '{role}'")
    with casckpt.open(None, blobs=str(blobs), catalog=reader, read_only=True) as store:
        _assert_reader(exercise(store), "it was asked to be")
    assert _pg_dump(admin) == rows
    assert _tree_digest(blobs) == files


def test_a_writer_granted_before_an_upgrade_added_tables_is_told_to_grant_again(tmp_path: Path,
                                                                                  pg_url: str) -> None:
    # a writer role granted what an older casckpt printed lacks the tables a later migration added
    # (0015's tree_*): it opens read-only, saying how to grant them, and commits once they are granted
    from casckpt.catalog.grants import grant_statements

    blobs = tmp_path / "blobs"
    with casckpt.open(None, blobs=str(blobs), catalog=pg_url) as store:
        _build(store)
    admin = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    database = pg_url.split("?")[0].rsplit("/", 1)[1]
    role = f"writer_{database[-8:]}"
    statements = [line for line in grant_statements("writer", role) if not line.startswith("--")]
    older = [line for line in statements if '"tree_' not in line]
    assert len(older) < len(statements)
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
        for line in older:
            conn.execute(line)
    writer = pg_url.replace("postgres:@", f"{role}:@", 1)
    with pytest.warns(ReadOnlyStoreWarning, match="--print-grants writer` again"):
        store = casckpt.open(None, blobs=str(blobs), catalog=writer)
    with store, pytest.raises(ReadOnlyStoreError):
        store.commit(_state(9), run="late", step=0)
    with psycopg.connect(admin, autocommit=True) as conn:
        for line in statements:
            conn.execute(line)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReadOnlyStoreWarning)
        with casckpt.open(None, blobs=str(blobs), catalog=writer) as store:
            store.commit(_state(9), run="late", step=0)
            assert [e.version.step for e in store.history("late", "w")] == [0]


# -- S3: a bucket that refuses writes --------------------------------------------------------

@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint) as running:
        yield running


def _objects(moto_endpoint: str, url: str) -> dict[str, tuple[str, int]]:
    import boto3

    bucket = url.removeprefix("s3://").split("/", 1)[0]
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = (obj["ETag"], obj["Size"])
    return out


def test_s3_refusing_writes(tmp_path: Path, proxy: FaultProxy, moto_endpoint: str,
                            s3_bucket_url: Callable[[], str]) -> None:
    url, root = s3_bucket_url(), tmp_path / "store"
    with casckpt.open(root, blobs=url, s3={"endpoint_url": moto_endpoint}) as store:
        _build(store)
    objects = _objects(moto_endpoint, url)
    assert objects
    proxy.refuse_writes()
    through = {"endpoint_url": proxy.endpoint_url, "sdk_attempts": 1, "retry_attempts": 1}
    with casckpt.open(root, s3=through, read_only=True) as store:
        _assert_reader(exercise(store), "it was asked to be")
    methods = proxy.requests_by_method()
    assert methods["GET"] > 0
    assert not {"PUT", "POST", "DELETE"} & set(methods), methods  # nothing even attempted
    with casckpt.open(root, s3=through) as store:  # not asked: the bucket itself refuses
        assert store.read_only is None
        with pytest.raises(CasckptError) as caught:
            store.commit(_state(3), run="r", step=3)
        assert not isinstance(caught.value, ReadOnlyStoreError)
        assert torch.equal(store.restore("r@2")["w"], _state(2)["w"])
    assert proxy.faults_fired()
    assert _objects(moto_endpoint, url) == objects


def test_cli_read_only_flag_in_process(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    root = tmp_path / "store"
    with casckpt.open(root) as store:
        _build(store)
    before = _tree_digest(root)

    def cli(*args: str) -> Any:
        return CliRunner().invoke(app, ["--read-only", *args])

    shown = cli("--store", str(root), "show", "r@2")
    assert shown.exit_code == 0 and "warning" not in shown.output, shown.output
    for args in (["tag", "r@1", "x"], ["retention", "set", "r", "--keep-last", "1"], ["repair"]):
        done = cli("--store", str(root), *args)
        assert done.exit_code == 8 and "needs write access" in done.output, (args, done.output)
    migrated = cli("--store", str(root), "migrate")
    assert migrated.exit_code == 0 and "nothing to upgrade" in migrated.output
    created = cli("init", str(tmp_path / "new"))
    assert created.exit_code == 8 and "creating one needs write access" in created.output
    assert not (tmp_path / "new").exists()
    assert _tree_digest(root) == before
