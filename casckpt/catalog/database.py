"""Connections to the catalog database: engines, transactions, outages and retries.

SQLAlchemy errors are mapped here, once, into ``CatalogUnavailableError``
(the database cannot be reached: refused, gone mid-transaction, restarting,
out of connection slots -- worth retrying) or ``CatalogError`` (anything
else: a constraint, a bad query, SQLite's "database is locked" after its
busy timeout -- not retried).

Retries: :meth:`Database.retrying` runs an idempotent operation again, with
exponential backoff and jitter, until it succeeds or ``retry_s`` seconds
have passed. Every transaction's first step (checking a connection out of
the pool; pre-ping replaces a pooled connection the server dropped) is
retried so; whole operations are retried only where the caller says they
are idempotent. Once an operation has given up, the catalog counts as
unreachable and later operations try once, without waiting, until one
connects again: a training loop committing during a long outage fails fast
instead of waiting out the budget at every step.

On PostgreSQL over TCP, libpq's connect timeout, keepalives and TCP user
timeout bound how long an unreachable host or a half-open connection can
hold a caller (each applies unless the URL sets it).

Thread-safety: a :class:`Database` may be shared by threads.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.dialects import sqlite  # the default catalog's; PostgreSQL's loads in upsert()
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from casckpt.catalog.rows import damaged
from casckpt.errors import CatalogError, CatalogUnavailableError, InvalidArgumentError

T = TypeVar("T")

BATCH = 500
"""Ids per ``IN (...)`` clause."""

CONNECT_TIMEOUT_S = 5
_LIBPQ_DEFAULTS = {  # a dead host fails a connect in 5 s and a held connection in ~30-60 s
    "connect_timeout": CONNECT_TIMEOUT_S,
    "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # ms that sent data may stay unacknowledged
}
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.05, 1.0
# SQLSTATEs of a server that is going away or not ready: connection exceptions (class 08),
# admin / crash shutdown, "the database system is starting up", too many connections
_UNAVAILABLE_STATES = ("08", "57P01", "57P02", "57P03", "53300")


def _wal(cursor: Any) -> None:
    """Switch to WAL. Switching needs the database to itself, and SQLite answers "database is
    locked" at once, without waiting, when a process creating the same new catalog holds it:
    wait for it here, as the busy timeout would."""
    deadline = time.monotonic() + 120
    delay = _BACKOFF_FIRST_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, _BACKOFF_MAX_S)


def _json_loads(text: str | bytes) -> Any:
    """A JSON column's value; text that is not JSON (a damaged SQLite row) is a CatalogError."""
    try:
        return json.loads(text)
    except (ValueError, TypeError) as exc:
        raise damaged(f"a JSON column holds {str(text)[:60]!r}, which is not JSON ({exc})") from exc


def check_url(url: str, where: str) -> None:
    """Refuse a catalog URL that names no database SQLAlchemy can open (``where``: the URL as
    messages show it, credentials redacted).

    Raises:
        InvalidArgumentError: not a URL, or a database no installed dialect serves.
    """
    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise InvalidArgumentError(
            f"catalog {where!r} is not a database URL casckpt can open ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}): write sqlite:////absolute/path/catalog.db or "
            "postgresql+psycopg://user@host/dbname") from None


def sqlite_path(url: str) -> Path | None:
    """The database file of an SQLite URL (None: another database, or an in-memory one)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def sqlite_write_denied(url: str) -> str | None:
    """Why this process cannot write the SQLite catalog at ``url`` (None: it can, or it is not
    SQLite). Writing needs the file and its directory (SQLite makes its journal files there)."""
    path = sqlite_path(url)
    if path is None or not path.exists():
        return None
    for what, where in (("file", path), ("directory", path.parent)):
        if not os.access(where, os.W_OK):
            return f"the catalog {what} {where} is not writable by this process (uid {os.geteuid()})"
    return None


def _read_only_sqlite_url(url: str) -> str:
    """``url`` opened read-only and making no file: ``mode=ro`` when writers have the catalog
    open (their ``-shm`` index exists: the reader coordinates with them through it), else
    ``immutable=1`` (``mode=ro`` would create ``-wal`` and ``-shm`` files owned by this
    process, which can lock another user's writers out). docs/guides/read-only.md says what
    an immutable reader does not see."""
    path = sqlite_path(url)
    if path is None:
        return url
    flag = "mode=ro" if path.with_name(path.name + "-shm").exists() else "immutable=1"
    return f"sqlite:///file:{quote(str(path))}?{flag}&uri=true"


def _sqlite_engine(url: str, read_only: bool = False) -> Engine:
    if read_only:
        url = _read_only_sqlite_url(url)
    engine = create_engine(url, connect_args={"timeout": 120, "check_same_thread": False},
                           json_deserializer=_json_loads)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA busy_timeout=120000")
        if not read_only:  # the journal mode is the writers' to set
            _wal(cursor)
            cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("casckpt_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _server_engine(url: str, read_only: bool = False) -> Engine:
    parsed = make_url(url)
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
        connect_args = {k: v for k, v in _LIBPQ_DEFAULTS.items() if k not in parsed.query}
        if read_only:  # the server itself refuses a write that slipped through
            connect_args["options"] = "-c default_transaction_read_only=on"
    return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8,
                         json_deserializer=_json_loads,
                         connect_args=connect_args)


def is_unavailable(exc: SQLAlchemyError) -> bool:
    """True when ``exc`` says the database server cannot be reached (not a SQL problem).

    SQLite's errors never count: its file is local and "database is locked"
    has already waited out the busy timeout.
    """
    if not isinstance(exc, DBAPIError) or not type(exc.orig).__module__.startswith("psycopg"):
        return False
    if exc.connection_invalidated:  # SQLAlchemy saw the connection drop
        return True
    state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if state is None:  # raised by libpq itself: refused, no socket, closed, timed out
        return any(c.__name__ in ("OperationalError", "InterfaceError") for c in type(exc.orig).__mro__)
    return str(state).startswith(_UNAVAILABLE_STATES)


def _reason(exc: SQLAlchemyError) -> str:
    """The driver's own first line, without SQLAlchemy's SQL and links."""
    text = str(exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class Database:
    """An engine with its pool, typed errors and bounded retries (see the module docstring)."""

    def __init__(self, url: str, *, where: str, retry_s: float, read_only: bool = False) -> None:
        self.where, self.retry_s, self.read_only = where, retry_s, read_only
        check_url(url, where)
        self.engine = (_sqlite_engine(url, read_only) if url.startswith("sqlite")
                       else _server_engine(url, read_only))
        self._unreachable_since: float | None = None  # set once an operation gave up
        self._local = threading.local()  # the deadline of this thread's outermost retrying()

    def close(self) -> None:
        """Dispose of pooled connections."""
        self.engine.dispose()

    def error(self, exc: SQLAlchemyError, doing: str) -> CatalogError:
        """``exc`` as the typed error to raise: unreachable, or ``"<doing> failed at ..."``."""
        if is_unavailable(exc):
            return CatalogUnavailableError(
                f"the catalog database at {self.where} is unreachable ({_reason(exc)}): {doing} "
                "failed. Check that it is up and reachable at that URL; a commit that failed so is "
                "not visible: commit again once the database is back (each catalog step is retried "
                f"for up to {self.retry_s:g} s; CASCKPT_CATALOG_RETRY_S sets how long)"
            )
        return CatalogError(f"{doing} failed at {self.where}: {exc}")

    def connect(self, *, write: bool) -> Connection:
        """A pooled connection (checked by pre-ping), retried while the database is unreachable."""
        return self.retrying(lambda: self._connect(write))

    def _connect(self, write: bool) -> Connection:
        try:
            conn = self.engine.connect()
        except SQLAlchemyError as exc:
            raise self.error(exc, "connecting") from exc
        self._unreachable_since = None
        return conn.execution_options(casckpt_write=True) if write else conn

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[Connection]:
        """A connection in a transaction, committed on exit; SQL errors become typed errors.

        Only the checkout is retried: the body runs once (wrap the whole
        operation in :meth:`retrying` when it is idempotent).
        """
        conn = self.connect(write=write)
        committing = False
        try:
            with conn, conn.begin():
                yield conn
                committing = True
        except SQLAlchemyError as exc:
            error = self.error(exc, "catalog update" if write else "catalog query")
            # lost while COMMIT was on its way: the server may have committed it
            if committing and write and isinstance(error, CatalogUnavailableError):
                error.in_doubt = True
            raise error from exc

    def retrying(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` until it does not raise CatalogUnavailableError, for at most
        ``retry_s`` seconds (one try while the catalog is known to be unreachable).

        ``operation`` must be idempotent: it may have taken effect before it
        failed. Nested calls share the outermost call's deadline and leave the
        retrying to it.
        """
        if getattr(self._local, "deadline", None) is not None:
            return operation()
        budget = 0.0 if self._unreachable_since is not None else self.retry_s
        self._local.deadline = deadline = time.monotonic() + budget
        delay = _BACKOFF_FIRST_S
        try:
            while True:
                try:
                    return operation()
                except CatalogUnavailableError:
                    now = time.monotonic()
                    if now >= deadline:
                        if self._unreachable_since is None:
                            self._unreachable_since = now
                        raise
                    time.sleep(min(deadline - now, random.uniform(delay / 2, delay)))
                    delay = min(2 * delay, _BACKOFF_MAX_S)
        finally:
            self._local.deadline = None


def batches(items: Sequence[T], size: int = BATCH) -> Iterator[list[T]]:
    """``items`` in lists of at most ``size``, in order (one ``IN (...)`` clause each)."""
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def upsert(conn: Connection, table: Any) -> Any:
    """An INSERT into ``table`` that takes ON CONFLICT clauses, for the connection's database
    (PostgreSQL or SQLite). The dialect is imported here, on first use: PostgreSQL's costs
    ~0.1 s to import, which no command on a SQLite store should pay."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    return sqlite.insert(table)


def insert_ignore(conn: Connection, table: Any, rows: list[dict[str, Any]], key: str) -> None:
    """INSERT rows, skipping those whose ``key`` exists (another writer got there first)."""
    if not rows:
        return
    conn.execute(upsert(conn, table).on_conflict_do_nothing(index_elements=[key]), rows)
