"""The store-wide GC lock: at most one garbage collection runs on a store at a time.

What it excludes: a second ``gc`` (or anything else that takes :func:`gc_lock`)
on the same catalog, from any process on any host. It does not exclude commits,
restores or migrations: those run beside a GC and are protected by their
leases (:mod:`casckpt.catalog.leases`) and by the publishing transaction.

How it is held: on SQLite, an ``flock`` on ``<catalog file>.gc-lock`` (the
catalog file is on one host, so a host-local lock covers every writer); on
PostgreSQL, a session advisory lock on a connection kept open for the run.
Both die with the process, so a GC killed with SIGKILL never leaves the store
locked. Taking the lock never waits: a held lock is ``GCRunningError``.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from casckpt.catalog.catalog import Catalog
from casckpt.errors import CatalogError, GCRunningError

_GC_LOCK = 0x63676331  # "cgc1": PostgreSQL advisory lock key held while a GC runs


@contextmanager
def gc_lock(catalog: Catalog) -> Iterator[None]:
    """Hold the store-wide GC lock; raise GCRunningError if another GC holds it.

    SQLite: an flock on ``<catalog file>.gc-lock``; PostgreSQL: a session
    advisory lock on a dedicated connection. Both vanish with the process, so
    a GC killed with SIGKILL never leaves the store locked.
    """
    url = catalog.engine.url
    if url.get_backend_name() == "sqlite":
        with _file_lock(f"{url.database}.gc-lock"):
            yield
    elif url.get_backend_name() == "postgresql":
        with _advisory_lock(catalog):
            yield
    else:
        raise CatalogError(f"gc does not support {url.get_backend_name()} catalogs")


@contextmanager
def _advisory_lock(catalog: Catalog) -> Iterator[None]:
    try:
        conn = catalog.engine.connect()
        held = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _GC_LOCK}).scalar()
        conn.commit()
    except SQLAlchemyError as exc:
        raise CatalogError(f"cannot take the gc lock at {catalog.where}: {exc}") from exc
    try:
        if not held:
            raise GCRunningError("another casckpt gc is running on this store; try again later")
        yield
    finally:
        try:
            if held:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _GC_LOCK})
                conn.commit()
        except SQLAlchemyError:
            pass  # closing the session below releases the lock anyway
        conn.close()


@contextmanager
def _file_lock(path: str) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CatalogError(f"cannot create the gc lock file {path}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GCRunningError(
                "another casckpt gc is running on this store; try again later"
            ) from None
        yield
    finally:
        os.close(fd)
