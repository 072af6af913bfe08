"""The store-wide GC lock: at most one garbage collection runs on a store at a time (and
each mirror's run lock, :func:`mirror_lock`, the same way).

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
import zlib
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


_MIRROR_LOCKS = 0x6D697272  # "mirr": the class of PostgreSQL advisory locks a mirror run holds


@contextmanager
def mirror_lock(catalog: Catalog, name: str) -> Iterator[None]:
    """Hold the run lock of mirror ``name``, waiting for a run of it that holds it (in this
    process or another, on any host): two runs of one mirror never interleave their copies
    and records; the second then finds the work done. Dies with the process, as
    :func:`gc_lock`. SQLite: an flock on ``<catalog file>.mirror-<name>.lock``; PostgreSQL:
    a session advisory lock keyed by the name, on a dedicated connection; other catalogs:
    none."""
    url = catalog.engine.url
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        path = f"{url.database}.mirror-{name}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CatalogError(f"cannot create the lock file {path} of mirror {name!r}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: a thread of this process waits too
            yield
        finally:
            os.close(fd)
    elif url.get_backend_name() == "postgresql":
        keys = {"c": _MIRROR_LOCKS - (1 << 31), "k": zlib.crc32(name.encode()) - (1 << 31)}  # int4s
        try:
            conn = catalog.engine.connect()
            conn.execute(text("SELECT pg_advisory_lock(:c, :k)"), keys)
            conn.commit()
        except SQLAlchemyError as exc:
            raise CatalogError(
                f"cannot take the run lock of mirror {name!r} at {catalog.where}: {exc}") from exc
        try:
            yield
        finally:
            try:  # the pool keeps the session: unlock, or drop the connection (and its session)
                conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"), keys)
                conn.commit()
            except SQLAlchemyError:
                conn.invalidate()
            conn.close()
    else:
        yield
