"""Leases: the rows that say a commit (or a migration, repair or drain) is in flight.

What a lease protects: a commit writes chunks and packs before it publishes
the version that references them. Until then nothing in the catalog points at
them, so GC would take them for garbage. Every commit holds a lease from before
its first write until it published or failed (a save of many ranks: the coordinator from
before any rank writes until it published, and each rank around its own writes, so a rank
still writing when the coordinator dies stays covered); GC condemns only chunks created
before the oldest lease started, and deletes unknown objects only if older than
it (:func:`safe_floor`, with a :data:`CLOCK_SKEW_S` margin for object mtimes
written by other clocks).

Tombstones: a commit names the version it is about to publish on its lease
before the manifest object is written. A one-process commit names it when the lease
begins (:func:`begin_lease`, which it calls once its snapshot -- which writes nothing -- has
fixed the version id); a save of many ranks (a group commit, a DCP save) takes its lease
before any rank writes, when the version id is not known yet, and names the version on that
same lease once the coordinator has composed the manifest (:func:`name_version`), still
before the manifest object is written. A lease that
ends without that version published (:func:`end_lease`), or that GC reaps as
crashed, tombstones the version, so its manifest object is known garbage.

Liveness across hosts and pid namespaces: a lease records the process space
it was taken in (host name, boot id and pid namespace, from ``/proc``) and the
pid. Only a lease from our own process space can be judged by its pid: if
that pid is gone, the commit crashed. A lease from another space (another
host, a reboot, another container sharing the host name) is never judged by
pid: it counts as crashed only once older than :data:`LEASE_TTL`, as does any
lease. A pid that exists but is not ours to signal counts as alive.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Collection
from typing import Any

from sqlalchemy import delete, insert, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import insert_ignore
from casckpt.errors import CasckptError, CatalogError

log = logging.getLogger(__name__)


def tombstone(conn: Any, version_ids: Collection[str], reason: str) -> None:
    """Tombstone versions that are not (or no longer) version rows."""
    ids = [i for i in version_ids if i]
    if not ids:
        return
    published = set(conn.execute(select(s.versions.c.id).where(s.versions.c.id.in_(ids))).scalars())
    insert_ignore(conn, s.tombstones, [{"version_id": i, "reason": reason, "created_at": time.time()}
                                       for i in ids if i not in published], "version_id")


LEASE_TTL = 24 * 3600.0  # a lease from another host older than this is a crashed commit


def _process_space() -> str:
    """Names the space our pids live in: host, boot and pid namespace.

    Two containers sharing a host name (host networking) have different pid
    namespaces, so neither takes the other's live commit for a dead one.
    """
    def read(path: str) -> str:
        try:
            if path.startswith("/proc/self/ns"):
                return os.readlink(path)
            with open(path) as f:
                return f.read(256).strip()  # a boot id is 36 characters
        except OSError:
            return "?"

    space = f"{socket.gethostname()}|{read('/proc/sys/kernel/random/boot_id')}|"
    return (space + read("/proc/self/ns/pid"))[:255]


_SAVE = "0" * 8  # the tail of a save's own lease id; its ranks' end in their number (from 1)


def save_lease_id() -> str:
    """A fresh id for the lease of a save of many ranks (:func:`rank_lease_id` derives its ranks')."""
    return uuid.uuid4().hex[:24] + _SAVE


def rank_lease_id(save: str, rank: int) -> str:
    """The id of the lease rank ``rank`` (0-based) of the save whose lease is ``save`` writes
    under: the save's prefix, so ending the save (:func:`end_lease` with ``ranks``) ends it
    too -- a rank killed on another host is never judged by pid, and its lease would hold GC
    back for :data:`LEASE_TTL`."""
    return save[:24] + f"{rank + 1:08x}"


def begin_lease(catalog: Catalog, version_id: str | None = None, lease: str | None = None) -> str:
    """Announce a commit in flight; returns the lease id to pass to :func:`end_lease`.

    ``version_id``: the version the commit will publish, named before its manifest object is
    written, so a commit that ends without publishing leaves a tombstone (its manifest is
    garbage), never an unexplained manifest.

    Raises:
        StoreKeyError: the store's encryption is not the one this process opened it with
            (commits, drains, repairs and migrations begin here, before their first object).
    """
    lease = lease or uuid.uuid4().hex
    with catalog.write() as conn:
        catalog.require_crypto_in(conn)  # before the writer's first object
        conn.execute(insert(s.leases).values(
            id=lease, host=_process_space(), pid=os.getpid(), started_at=time.time(), version_id=version_id,
        ))
    return lease


def name_version(catalog: Catalog, lease: str, version_id: str) -> None:
    """Name on ``lease`` the version its holder is about to publish, before the holder writes
    that version's manifest object: for a save whose lease began before the version id was
    known (:func:`begin_lease` without one). A commit killed after this leaves a manifest GC
    knows as a commit in flight, then, once it reaps the lease, as a tombstone.

    Raises:
        CatalogError: the lease is gone (GC reaped it as crashed: older than
            :data:`LEASE_TTL`); the manifest must not be written.
    """
    with catalog.write() as conn:
        named = conn.execute(update(s.leases).where(s.leases.c.id == lease)
                             .values(version_id=version_id)).rowcount
    if not named:
        raise CatalogError(
            f"the GC lease of this save is gone (gc reaps a lease older than {LEASE_TTL / 3600:.0f} "
            "hours as a crashed commit), so gc may have condemned what it wrote; nothing was "
            "published: save this step again")


def end_lease(catalog: Catalog, lease: str, ranks: bool = False) -> None:
    """The commit holding ``lease`` is over (published or failed). ``ranks``: ``lease`` is a
    save's (:func:`save_lease_id`), and the leases of its ranks end too."""
    which = s.leases.c.id.like(lease[:24] + "%") if ranks else s.leases.c.id == lease
    with catalog.write() as conn:
        versions = conn.execute(delete(s.leases).where(which).returning(s.leases.c.version_id)).scalars()
        tombstone(conn, [v for v in versions if v], "unpublished")


def release_lease(catalog: Catalog, lease: str, what: str, ranks: bool = False) -> None:
    """:func:`end_lease`, again while the catalog is unreachable; if it still cannot, say so
    and go on: whoever held the lease has its outcome (a version published stays published,
    a failure keeps its own error), and a lease left behind only holds GC back, until its
    process exits or the lease expires. Every commit, save and rank ends its lease here."""
    try:
        catalog.retrying(lambda: end_lease(catalog, lease, ranks))
    except CasckptError as exc:
        log.warning("could not end the GC lease of %s (gc keeps what it may still need until "
                    "this process exits): %s", what, exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def oldest_lease(catalog: Catalog, now: float) -> float | None:
    """Start time of the oldest commit in flight (None if none).

    Leases of dead processes in this process space (host, boot, pid
    namespace), and leases older than :data:`LEASE_TTL`, are crashed commits:
    they are removed.
    """
    host = _process_space()
    with catalog.read() as conn:
        rows = conn.execute(select(s.leases.c.id, s.leases.c.host, s.leases.c.pid,
                                   s.leases.c.started_at, s.leases.c.version_id)).all()
    stale = [r.id for r in rows if (r.host == host and not _alive(r.pid))
             or now - r.started_at > LEASE_TTL]
    if stale:
        with catalog.write() as conn:  # the versions of the rows deleted, not of those read:
            # a save may have named its version on a lease since (:func:`name_version`)
            versions = conn.execute(delete(s.leases).where(s.leases.c.id.in_(stale))
                                    .returning(s.leases.c.version_id)).scalars()
            tombstone(conn, [v for v in versions if v], "crashed")
    starts = [r.started_at for r in rows if r.id not in stale]
    return min(starts, default=None)


CLOCK_SKEW_S = 5.0  # object mtimes (S3: whole seconds) and lease times come from different clocks


def safe_floor(catalog: Catalog, cutoff: float) -> float:
    """The newest time before which nothing a commit in flight wrote can lie."""
    lease = oldest_lease(catalog, time.time())
    return cutoff if lease is None else min(cutoff, lease - CLOCK_SKEW_S)
