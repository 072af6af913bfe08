"""The SQL side of fast tiers (see :mod:`casckpt.engine.tiering.tier`): which host has which tier,
which packs wait on one, which versions wait on those packs, and the drain's transactions.

A pack written to a fast tier is a ``packs`` row in state ``fast`` naming its ``tier``, with
no shard rows. Publishing a version records, in the same transaction, every ``fast`` pack
its chunks lie in (:func:`casckpt.catalog.publish.insert_deps`, table ``tier_deps``) and makes the version
``durability = 'fast'``. The drain stores a pack on the locations and then, in one
transaction, records its shards and makes it ``live`` (:func:`mark_drained`); a version
none of whose packs is still ``fast`` is made ``durable`` once its manifest is on the
locations (:func:`finish`). A tier found lost makes its packs and their chunks ``lost`` and
every version needing one of them ``lost`` (:func:`declare_lost`): never restored half.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, exists, func, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.database import batches, insert_ignore
from casckpt.catalog.packs import PackLayout, insert_shards

if TYPE_CHECKING:
    from casckpt.catalog.catalog import Catalog

@dataclass(frozen=True, slots=True)
class TierRow:
    """A host's fast tier as the catalog knows it."""

    id: str
    host: str
    path: str
    state: str  # "active" or "lost"
    created_at: float
    lost_at: float | None


@dataclass(frozen=True, slots=True)
class FastPack:
    """A pack waiting on a fast tier: what its drain needs."""

    id: str
    key: str
    size: int
    scheme: str
    k: int
    m: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Lost:
    """What :func:`declare_lost` found lost with a tier."""

    packs: tuple[str, ...]
    versions: tuple[str, ...]


def register(catalog: Catalog, tier_id: str, host: str, path: str) -> None:
    """Record a new fast tier (idempotent)."""
    with catalog.write() as conn:
        insert_ignore(conn, s.tiers, [{"id": tier_id, "host": host, "path": path, "state": "active",
                                       "created_at": time.time(), "lost_at": None}], "id")


def tiers(catalog: Catalog) -> list[TierRow]:
    """Every tier the catalog knows, oldest first."""
    with catalog.read() as conn:
        return [TierRow(*row) for row in conn.execute(
            select(s.tiers.c.id, s.tiers.c.host, s.tiers.c.path, s.tiers.c.state,
                   s.tiers.c.created_at, s.tiers.c.lost_at).order_by(s.tiers.c.created_at))]


def declare_lost(catalog: Catalog, tier_id: str) -> Lost:
    """The tier is gone (its disk wiped, its host lost): its packs still waiting on it are lost
    (:func:`lose_packs`) and the tier is marked lost, in one transaction."""
    with catalog.write() as conn:
        packs = list(conn.execute(select(s.packs.c.id).where(
            s.packs.c.tier == tier_id, s.packs.c.state == "fast")).scalars())
        versions = _lose(conn, packs)
        conn.execute(update(s.tiers).where(s.tiers.c.id == tier_id)
                     .values(state="lost", lost_at=time.time()))
        catalog.audit_in(conn, "tier.lost", tier_id, {"packs": len(packs), "versions": versions[:100],
                                                      "version_count": len(versions)})
    return Lost(tuple(packs), tuple(versions))


def lose_packs(catalog: Catalog, pack_ids: Sequence[str], tier_id: str) -> Lost:
    """These ``fast`` packs are gone from their tier: in one transaction they and their chunks
    become ``lost`` (a commit holding such a chunk writes it again), and every version needing
    one becomes ``lost``."""
    with catalog.write() as conn:
        packs = list(conn.execute(select(s.packs.c.id).where(
            s.packs.c.id.in_(list(pack_ids)), s.packs.c.state == "fast")).scalars())
        versions = _lose(conn, packs)
        catalog.audit_in(conn, "tier.lost_packs", tier_id, {"packs": packs[:100],
                                                            "versions": versions[:100]})
    return Lost(tuple(packs), tuple(versions))


def _lose(conn: Connection, packs: list[str]) -> list[str]:
    p, d, v = s.packs, s.tier_deps, s.versions
    c, readable = s.chunks, s.chunks.c.state.in_(("live", "condemned"))
    lost: set[str] = set()
    frontier: list[str] = []
    for batch in batches(packs):
        conn.execute(update(p).where(p.c.id.in_(batch)).values(state="lost"))
        frontier += conn.execute(select(c.c.id).where(c.c.pack_id.in_(batch), readable)).scalars()
    while frontier:  # a chunk delta-coded against a lost one is unreadable too, wherever it lies:
        found: list[str] = []  # lost, so a commit holding it writes it again rather than reuse it
        for batch in batches(frontier):
            conn.execute(update(c).where(c.c.id.in_(batch), readable).values(state="lost"))
            found += conn.execute(select(c.c.id).where(c.c.base_id.in_(batch), readable)).scalars()
        frontier = found
    for batch in batches(packs):  # after the chunk updates: on PostgreSQL they wait
        # for a commit publishing against these chunks, whose dependencies this then sees
        lost.update(conn.execute(select(d.c.version_id).where(d.c.pack_id.in_(batch))).scalars())
    ids = sorted(lost)
    for batch in batches(ids):
        conn.execute(update(v).where(v.c.id.in_(batch), v.c.durability != "durable")
                     .values(durability="lost"))
    return ids


def newest_versions(catalog: Catalog, n: int) -> list[str]:
    """The ``n`` visible versions committed last."""
    v = s.versions
    with catalog.read() as conn:
        return list(conn.execute(select(v.c.id).where(v.c.state == "visible")
                                 .order_by(v.c.committed_at.desc()).limit(n)).scalars())


def fast_packs(catalog: Catalog, tier_id: str) -> list[FastPack]:
    """The packs waiting on ``tier_id``, oldest first (the order the drain takes them in)."""
    p = s.packs
    with catalog.read() as conn:
        return [FastPack(*row) for row in conn.execute(
            select(p.c.id, p.c.key, p.c.size, p.c.scheme, p.c.k, p.c.m, p.c.created_at)
            .where(p.c.tier == tier_id, p.c.state == "fast").order_by(p.c.created_at, p.c.id))]


def pack_states(catalog: Catalog, pack_ids: Iterable[str]) -> dict[str, tuple[str, str | None]]:
    """pack id -> (state, tier) for those the catalog knows."""
    out: dict[str, tuple[str, str | None]] = {}
    with catalog.read() as conn:
        for batch in batches(list(dict.fromkeys(pack_ids))):
            for row in conn.execute(select(s.packs.c.id, s.packs.c.state, s.packs.c.tier)
                                    .where(s.packs.c.id.in_(batch))):
                out[row[0]] = (row[1], row[2])
    return out


def mark_drained(catalog: Catalog, layout: PackLayout) -> bool:
    """The drain stored a fast pack on the locations: in one transaction record its shards and
    make it ``live``. False (nothing changed) when it is no longer a ``fast`` pack: another
    process drained it first, or its tier was declared lost meanwhile."""
    p = s.packs
    with catalog.write() as conn:
        state = conn.execute(select(p.c.state).where(p.c.id == layout.id).with_for_update()).scalar()
        if state != "fast":
            return False
        conn.execute(update(p).where(p.c.id == layout.id).values(
            state="live", tier=None, scheme=layout.scheme, k=layout.k, m=layout.m,
            algorithm=layout.algorithm, stripe=layout.stripe, data_offset=layout.data_offset))
        insert_shards(conn, layout)
    return True


def _waiting() -> Any:
    """Versions one of whose packs is not on the locations: still on a fast tier, or lost
    with one (such a version is never finished as durable, however it got the dependency)."""
    d, p = s.tier_deps, s.packs
    return exists().where(d.c.version_id == s.versions.c.id, p.c.id == d.c.pack_id, p.c.state != "live")


def finishable(catalog: Catalog, limit: int = 1000) -> list[str]:
    """Versions still ``fast`` none of whose packs waits on a tier any more (oldest first):
    once their manifest is on the locations, :func:`finish` makes them durable."""
    v = s.versions
    with catalog.read() as conn:
        return list(conn.execute(select(v.c.id).where(v.c.durability == "fast", ~_waiting())
                                 .order_by(v.c.committed_at).limit(limit)).scalars())


def finish(catalog: Catalog, version_ids: Sequence[str]) -> list[str]:
    """Make these versions ``durable`` (those still ``fast`` with nothing waiting); returns them."""
    v = s.versions
    done: list[str] = []
    with catalog.write() as conn:
        for batch in batches(version_ids):
            ready = list(conn.execute(select(v.c.id).where(
                v.c.id.in_(batch), v.c.durability == "fast", ~_waiting())).scalars())
            if ready:
                conn.execute(update(v).where(v.c.id.in_(ready)).values(durability="durable"))
                done += ready
    return done


def durability(catalog: Catalog, version_ids: Sequence[str]) -> dict[str, str]:
    """version id -> its durability, for those the catalog knows."""
    v = s.versions
    out: dict[str, str] = {}
    with catalog.read() as conn:
        for batch in batches(version_ids):
            out.update((row[0], row[1]) for row in conn.execute(
                select(v.c.id, v.c.durability).where(v.c.id.in_(batch))))
    return out


def waiting_on(catalog: Catalog, version_id: str) -> dict[str, int]:
    """tier id -> how many of the version's packs still wait on it."""
    d, p = s.tier_deps, s.packs
    with catalog.read() as conn:
        return {row[0]: int(row[1]) for row in conn.execute(
            select(p.c.tier, func.count()).join(p, p.c.id == d.c.pack_id)
            .where(d.c.version_id == version_id, p.c.state == "fast").group_by(p.c.tier))}


def not_durable(catalog: Catalog, *, tier_id: str | None = None) -> list[tuple[str, str]]:
    """(version id, durability) of visible versions not durable; with ``tier_id``, the ``fast``
    ones only of those waiting on that tier (or on no tier: their manifest is what is left)."""
    v, d, p = s.versions, s.tier_deps, s.packs
    query = select(v.c.id, v.c.durability).where(v.c.durability != "durable", v.c.state == "visible")
    if tier_id is not None:
        other = exists().where(d.c.version_id == v.c.id, p.c.id == d.c.pack_id, p.c.state == "fast",
                               p.c.tier != tier_id)
        query = query.where(v.c.durability == "fast", ~other)
    with catalog.read() as conn:
        return [(row[0], row[1]) for row in conn.execute(query.order_by(v.c.committed_at))]


def undrained_bytes(catalog: Catalog, tier_id: str) -> tuple[int, int]:
    """(packs, bytes) waiting on ``tier_id``."""
    p = s.packs
    with catalog.read() as conn:
        count, size = conn.execute(select(func.count(), func.coalesce(func.sum(p.c.size), 0)).where(
            p.c.tier == tier_id, p.c.state == "fast")).one()
    return int(count), int(size)


def forget_deps(conn: Connection, version_ids: Sequence[str]) -> None:
    """Within gc's purge: drop the dependency rows of purged versions."""
    conn.execute(s.tier_deps.delete().where(s.tier_deps.c.version_id.in_(list(version_ids))))


def pending_summary(catalog: Catalog) -> dict[str, dict[str, int]]:
    """tier id -> {"packs", "bytes"} of packs waiting on it, and versions per durability
    under the key ``""``."""
    p, v = s.packs, s.versions
    out: dict[str, dict[str, int]] = {}
    with catalog.read() as conn:
        for tier, count, size in conn.execute(select(p.c.tier, func.count(), func.coalesce(
                func.sum(p.c.size), 0)).where(p.c.state == "fast").group_by(p.c.tier)):
            out[str(tier)] = {"packs": int(count), "bytes": int(size)}
        out[""] = {str(state): int(n) for state, n in conn.execute(
            select(v.c.durability, func.count()).where(v.c.state == "visible").group_by(v.c.durability))}
    return out


def durable_bytes(catalog: Catalog) -> int:
    """Bytes of the packs on the locations (``live``), before redundancy."""
    with catalog.read() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(s.packs.c.size), 0))
                                .where(s.packs.c.state == "live")).scalar_one())


def tier_state(catalog: Catalog, tier_id: str) -> str | None:
    """``active``, ``lost``, or None for a tier the catalog does not know."""
    with catalog.read() as conn:
        state: str | None = conn.execute(select(s.tiers.c.state).where(s.tiers.c.id == tier_id)).scalar()
    return state
