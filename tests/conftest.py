"""Shared fixtures: real services on loopback, and the backend matrix.

- ``isolated_home`` (autouse, session): HOME and XDG_CACHE_HOME point into
  pytest's temp dir for the whole session, so no store cache (a store with a
  remote catalog keeps one in ``~/.cache/casckpt/<store id>``), nor anything
  else a library caches per user, lands in the real home of whoever runs the
  tests. Subprocesses the tests start inherit the environment.
- ``pg_url``: a fresh database on a real PostgreSQL server (pgserver, started
  once per session, reached over a Unix socket in a temp dir).
- ``store_config``: each of {local dir, S3} x {SQLite, PostgreSQL}; tests that
  take it run once per combination. S3 is a moto server on 127.0.0.1 with a
  bucket per test (fixtures in tests/s3_fixtures.py).
- ``forked_python``: ``python`` command lines run in children forked from one
  warm interpreter (torch and casckpt imported once per worker, not once per
  child; tests/helpers/forkserver.py). Each child is a separate process; tests
  about a fresh interpreter's imports or options start ``sys.executable``.
- Hypothesis profiles: ``ci`` (the default) runs at most 40 examples of a property
  test, or a quarter of its own count where that is more; ``deep``
  (``HYPOTHESIS_PROFILE=deep``, the slow tier's run of every property test) runs
  each test's own count, or hypothesis's 100 where it names none.
- ``fresh_sqlite_catalogs`` (autouse): a new SQLite catalog gets the schema the
  migrations built once per worker, replayed, instead of running every Alembic
  migration again (about a fifth of the suite's CPU time went there). Tests
  marked ``real_migrations`` run the migrations on each new catalog.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from doubles import ForkedPython
from hypothesis import settings

import casckpt
from casckpt.testing import s3 as s3_testing
from casckpt.testing.internals import internals
from casckpt.testing.s3 import fake_aws_environment, moto_server

# -- hypothesis: fewer examples in the default tier, every one in the deep run ------------

CI_EXAMPLES = 40  # the default tier's cap; a test asking for more keeps a quarter of its count
settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("deep", max_examples=100)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def ci_examples(count: int) -> int:
    """How many of a property test's ``count`` examples the ``ci`` profile runs."""
    return count if count <= CI_EXAMPLES else max(CI_EXAMPLES, count // 4)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip where torch sees no CUDA device (CI). Under ``ci``, cap the
    examples of property tests that name their own count (a profile only sets the count of
    tests that do not); ``deep`` leaves every count as written."""
    _skip_gpu_tests_without_cuda(items)
    if PROFILE != "ci":
        return
    for item in items:
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        if not getattr(test, "is_hypothesis_test", False) or getattr(test, "_ci_examples", False):
            continue
        own: settings | None = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is None:  # a state machine's test: its class's settings hold its count
            continue
        # read by @given at call time (hypothesis core.py)
        test._hypothesis_internal_use_settings = settings(own, max_examples=ci_examples(own.max_examples))
        test._ci_examples = True


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = pytest.mark.skip(reason="no CUDA: torch.cuda.is_available() is False (tests/device/run.sh runs "
                                  "the gpu tests on a lent GPU machine)")
    for item in gpu:
        item.add_marker(why)


@dataclass(frozen=True)
class Homes:
    """The session's temporary home, and the real one it stands in for."""

    temp: Path
    real: Path


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Homes]:
    """HOME and XDG_CACHE_HOME inside the session's temp dir (set before any test runs).

    Configuration is still read from the real place (XDG_CONFIG_HOME keeps
    pointing at it), so pip's index settings reach the wheel build; nothing
    reads or writes a cache there.
    """
    real = Path.home()
    temp = tmp_path_factory.mktemp("home")
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CONFIG_HOME", os.environ.get("XDG_CONFIG_HOME") or str(real / ".config"))
    patch.setenv("HOME", str(temp))
    patch.setenv("XDG_CACHE_HOME", str(temp / ".cache"))
    try:
        yield Homes(temp, real)
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def forked_python(isolated_home: Homes, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkedPython]:
    """A warm fork server for the worker's session (started when a test first asks)."""
    runner = ForkedPython(tmp_path_factory.mktemp("forked"))
    try:
        yield runner
    finally:
        runner.close()


@dataclass(frozen=True)
class CatalogSchema:
    """What the migrations leave in a new SQLite catalog: its DDL in creation order, the rows
    every new catalog gets alike, and the ``store_info`` keys each gets its own value of."""

    ddl: tuple[str, ...]
    rows: tuple[tuple[str, tuple[tuple[Any, ...], ...]], ...]
    own: tuple[str, ...]


# store_info values the migrations make anew for each catalog (0002 and 0006), made the same way
OWN_VALUES: dict[str, Callable[[], str]] = {"store_id": lambda: uuid.uuid4().hex,
                                            "created_at": lambda: repr(time.time())}


def _migrated(path: Path) -> tuple[tuple[str, ...], dict[str, list[tuple[Any, ...]]]]:
    """Run the real migrations on a new SQLite database at ``path``; its DDL and rows."""
    from sqlalchemy import create_engine

    from casckpt.catalog import migrate

    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn)
            conn.commit()
    finally:
        engine.dispose()
    db = sqlite3.connect(path)
    try:
        own = "name NOT LIKE 'sqlite_%'"  # not SQLite's internal tables
        ddl = tuple(sql for (sql,) in db.execute(
            f"SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND {own} ORDER BY rowid"))
        tables = [name for (name,) in db.execute(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND {own} ORDER BY rowid")]
        return ddl, {t: db.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables}
    finally:
        db.close()


@pytest.fixture(scope="session")
def _migrated_catalog_schema(tmp_path_factory: pytest.TempPathFactory) -> CatalogSchema:
    """Migrate two empty SQLite databases for real; what differs between them must be a value
    in ``OWN_VALUES`` (else this fails and says so)."""
    top = tmp_path_factory.mktemp("catalog-schema")
    (ddl, rows), (ddl2, rows2) = _migrated(top / "a.db"), _migrated(top / "b.db")
    assert ddl == ddl2, "the migrations made two different schemas"
    own = tuple(sorted(str(key) for key, _ in set(rows["store_info"]) - set(rows2["store_info"])))
    alike = {t: r for t, r in rows.items() if t != "store_info"}
    assert alike == {t: r for t, r in rows2.items() if t != "store_info"} and set(own) <= set(OWN_VALUES), (
        f"a migration writes a value of its own to each new catalog ({own}): teach tests/conftest.py "
        "OWN_VALUES to make it, or mark the tests real_migrations")
    alike["store_info"] = [row for row in rows["store_info"] if row[0] not in own]
    return CatalogSchema(ddl, tuple((t, tuple(r)) for t, r in alike.items()), own)


@pytest.fixture(autouse=True)
def fresh_sqlite_catalogs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """New SQLite catalogs in this test's process get the migrated schema replayed (see above)."""
    if request.node.get_closest_marker("real_migrations"):
        return
    from sqlalchemy import Connection, inspect

    from casckpt.catalog import migrate

    schema: CatalogSchema = request.getfixturevalue("_migrated_catalog_schema")
    real = migrate.upgrade

    def upgrade(connection: Connection) -> str | None:
        if connection.dialect.name != "sqlite" or inspect(connection).get_table_names():
            return real(connection)  # PostgreSQL, or an existing catalog: the migrations decide
        if not connection.in_transaction():
            connection.begin()
        for statement in schema.ddl:
            connection.exec_driver_sql(statement)
        own = [(key, OWN_VALUES[key]()) for key in schema.own]
        for table, rows in (*schema.rows, ("store_info", tuple(own))):
            for row in rows:
                marks = ", ".join("?" * len(row))
                connection.exec_driver_sql(f'INSERT INTO "{table}" VALUES ({marks})', tuple(row))
        return None  # created, not upgraded

    monkeypatch.setattr(migrate, "upgrade", upgrade)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A PostgreSQL server for the whole session (pgserver ships the binaries)."""
    pgserver = pytest.importorskip("pgserver")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def new_pg_url(pg_server: Any) -> Callable[[], str]:
    """Factory: create a new, empty database on the session's server, return its SQLAlchemy URL."""
    def make() -> str:
        name = f"casckpt_{uuid.uuid4().hex[:12]}"
        pg_server.psql(f"CREATE DATABASE {name};")
        base = pg_server.get_uri()  # postgresql://postgres:@/postgres?host=/tmp/...
        url = base.replace("postgresql://", "postgresql+psycopg://", 1)
        return url.replace("/postgres?", f"/{name}?", 1)

    return make


@pytest.fixture
def pg_url(new_pg_url: Callable[[], str]) -> str:
    """A SQLAlchemy URL of a new, empty database on the session's server."""
    return new_pg_url()


@dataclass(frozen=True)
class StoreConfig:
    """How to open one store of the backend matrix."""

    name: str
    root: Path
    blobs: str | None
    catalog: str | None
    s3: dict[str, Any] | None

    def open(self, **kwargs: Any) -> Any:
        import casckpt

        return casckpt.open(self.root, blobs=self.blobs, catalog=self.catalog, s3=self.s3, **kwargs)


BACKENDS = ["local-sqlite", "local-postgres", "s3-sqlite", "s3-postgres"]


def verified(store: casckpt.Store, root: Path) -> bool:
    """Every byte of the store read back and verified (``check(read_data=True)``), through a
    fresh handle when the test closed its own."""
    if not internals(store).closed:
        return store.ops.check(read_data=True).ok
    with casckpt.open(root, create=False) as again:
        return again.ops.check(read_data=True).ok


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    """A local store (SQLite, one directory) whose every byte is read back and verified
    (``check(read_data=True)``) after the test. Test files that need another store define
    their own ``store``."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with casckpt.open(tmp_path / "store") as s:
        yield s
        assert verified(s, tmp_path / "store")


@pytest.fixture(params=BACKENDS)
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> StoreConfig:
    """One store location per backend combination (opened by ``store_config.open()``)."""
    blobs_kind, catalog_kind = request.param.split("-")
    blobs = catalog = s3 = None
    if blobs_kind == "s3":
        make_bucket: Callable[[], str] = request.getfixturevalue("s3_bucket_url")
        blobs = make_bucket()
        s3 = {"endpoint_url": request.getfixturevalue("moto_endpoint")}
    if catalog_kind == "postgres":
        catalog = request.getfixturevalue("pg_url")
    return StoreConfig(request.param, tmp_path / "store", blobs, catalog, s3)


# -- S3: a moto server on loopback, fake isolated credentials -----------------------------

@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1, shared by the session (buckets are per test)."""
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def _session_aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with fake_aws_environment(tmp_path_factory.mktemp("aws")):
        yield


@pytest.fixture
def aws_env(_session_aws_env: None) -> None:
    """A fake, isolated AWS environment (inherited by subprocesses the test starts)."""


@pytest.fixture
def s3_bucket_url(aws_env: None, moto_endpoint: str) -> Callable[[], str]:
    """Factory: create a new bucket on the moto server, return ``s3://bucket/prefix``."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name=s3_testing.REGION)

    def make() -> str:
        bucket = f"casckpt-{uuid.uuid4().hex[:16]}"
        client.create_bucket(Bucket=bucket)
        return f"s3://{bucket}/ckpt"

    return make
