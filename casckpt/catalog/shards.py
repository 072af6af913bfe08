"""The SQL side of redundancy: locations, pack layouts, shard health, redundancy policy.

Locations are known by name across hosts (the catalog); a host may reach a
location by another URL (its config file says which). Shard rows are the
durable repair queue: a shard found missing or corrupt is marked so, and
``repair`` rebuilds every shard not ``ok`` or on a location not ``active``.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, case, exists, func, null, or_, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import batches, insert_ignore
from casckpt.catalog.packs import PackLayout, ShardRow
from casckpt.catalog.rows import damaged
from casckpt.errors import CatalogError, InvalidArgumentError, RefNotFoundError

LOCATION_STATES = ("active", "retiring", "failed")
_STATE_ACTIONS = {"active": "location.activate", "retiring": "location.retire", "failed": "location.fail"}
"""The audit action that putting a location in each state records."""
SCHEMES = ("none", "replicate", "ec")


@dataclass(frozen=True, slots=True)
class LocationRow:
    """A blob location as the catalog records it."""

    id: int
    name: str
    url: str | None
    domain: str
    state: str


def _location(row: Any) -> LocationRow:
    return LocationRow(row.id, row.name, row.url, row.domain, row.state)


def locations(catalog: Catalog) -> list[LocationRow]:
    """Every location, by id."""
    with catalog.read() as conn:
        return [_location(r) for r in conn.execute(select(s.locations).order_by(s.locations.c.id))]


def ensure_locations(catalog: Catalog, configured: Sequence[tuple[str, str, str]]) -> list[LocationRow]:
    """Register configured (name, url, domain) locations the catalog does not know yet.

    A location the catalog already knows by name keeps its recorded URL and
    domain (another host may reach it by another URL); one a migration left
    without a URL gets the configured one. Returns every location. Safe for
    openers of a new store at once: a name another transaction registers
    first is kept as that one registered it.
    """
    with catalog.write() as conn:
        known = {r.name: r for r in conn.execute(select(s.locations))}
        insert_ignore(conn, s.locations, [
            {"name": name, "url": url, "domain": domain, "state": "active", "created_at": time.time()}
            for name, url, domain in configured if name not in known], "name")
        for name, url, _domain in configured:
            row = known.get(name)
            if row is not None and row.url is None:
                conn.execute(update(s.locations).where(s.locations.c.id == row.id).values(url=url))
        return [_location(r) for r in conn.execute(select(s.locations).order_by(s.locations.c.id))]


def add_location(catalog: Catalog, name: str, url: str, domain: str) -> LocationRow:
    """Register a new active location.

    Raises:
        InvalidArgumentError: the name or URL is taken.
    """
    with catalog.write() as conn:
        for row in conn.execute(select(s.locations)):
            if row.name == name or row.url == url:
                raise InvalidArgumentError(
                    f"location {row.name!r} already uses that {'name' if row.name == name else 'URL'}; "
                    "choose another name, or see `casckpt location list`"
                )
        conn.execute(s.locations.insert().values(
            name=name, url=url, domain=domain, state="active", created_at=time.time()))
        catalog.audit_in(conn, "location.add", f"location:{name}", {"url": url, "domain": domain})
        return _location(conn.execute(select(s.locations).where(s.locations.c.name == name)).one())


def set_location_state(catalog: Catalog, name: str, state: str) -> LocationRow:
    """Mark a location ``active``, ``retiring`` (no new shards; repair moves them off)
    or ``failed`` (never read; repair re-creates its shards elsewhere).

    Raises:
        RefNotFoundError: no such location.
    """
    if state not in LOCATION_STATES:
        raise InvalidArgumentError(f"location state must be one of {', '.join(LOCATION_STATES)}")
    with catalog.write() as conn:
        row = conn.execute(select(s.locations).where(s.locations.c.name == name)).first()
        if row is None:
            names = list(conn.execute(select(s.locations.c.name)).scalars())
            raise RefNotFoundError(name, "there is no location with that name (see `casckpt location "
                                   "list`)", difflib.get_close_matches(name, names, n=3))
        conn.execute(update(s.locations).where(s.locations.c.id == row.id).values(state=state))
        if row.state != state:
            catalog.audit_in(conn, _STATE_ACTIONS[state], f"location:{name}", {"from": row.state})
        return LocationRow(row.id, row.name, row.url, row.domain, state)


def keys_on_location(catalog: Catalog, location: str, keys: Sequence[str]) -> set[str]:
    """Which of these object names the catalog records as shards on the named location."""
    with catalog.read() as conn:
        return set(conn.execute(
            select(s.shards.c.key).join(s.locations, s.locations.c.id == s.shards.c.location_id)
            .where(s.locations.c.name == location, s.shards.c.key.in_(list(keys)))).scalars())


def location_usage(catalog: Catalog) -> dict[int, tuple[int, int, int]]:
    """Per location id: (shards, bytes, shards not ok)."""
    sh = s.shards
    damaged = func.sum(case((sh.c.state != "ok", 1), else_=0))
    with catalog.read() as conn:
        rows = conn.execute(select(sh.c.location_id, func.count(), func.coalesce(func.sum(sh.c.size), 0),
                                   func.coalesce(damaged, 0)).group_by(sh.c.location_id))
        return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}


_MAX_SHARDS = 256  # far above any scheme casckpt writes (ec:K+M with K+M <= 32)


def _damaged(pack_id: object, what: str) -> CatalogError:
    return damaged(f"its record of pack {pack_id!r} holds a bad {what}, and nothing was read through it")


def _count(value: object, what: str, pack_id: object, low: int = 0, high: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _damaged(pack_id, f"{what} = {value!r}")
    return value


def _optional_count(value: object, what: str, pack_id: object, low: int = 0) -> int | None:
    return None if value is None else _count(value, what, pack_id, low)


def _layout(row: Any, shards: Sequence[ShardRow]) -> PackLayout:
    """A pack row and its shard rows as a PackLayout, every field checked (a damaged catalog row
    must not reach a reader, an allocation or the erasure code as a wrong type or range)."""
    pack_id = row.id
    if not isinstance(pack_id, str) or not isinstance(row.key, str) or row.scheme not in SCHEMES:
        raise _damaged(pack_id, "id, key or scheme")
    k = _count(row.k, "k", pack_id, 1, _MAX_SHARDS)
    m = _count(row.m, "m", pack_id, 0, _MAX_SHARDS)
    for sh in shards:
        if not 0 <= sh.index < (k + m if row.scheme == "ec" else _MAX_SHARDS):
            raise _damaged(pack_id, f"shard index {sh.index}")
    if row.algorithm is not None and not isinstance(row.algorithm, str):
        raise _damaged(pack_id, "algorithm")
    tier = row.tier if row.state != "live" else None
    if tier is not None and not isinstance(tier, str):
        raise _damaged(pack_id, "tier")
    if row.scheme == "ec" and tier is None and (row.stripe is None or row.data_offset is None):
        raise _damaged(pack_id, "stripe and data offset (an ec pack has both)")
    return PackLayout(pack_id, row.key, _count(row.size, "size", pack_id), row.scheme, k, m, row.algorithm,
                      _optional_count(row.stripe, "stripe", pack_id, 1),
                      _optional_count(row.data_offset, "data_offset", pack_id),
                      tuple(sorted(shards, key=lambda x: x.index)), tier)


def _shard(r: Any) -> ShardRow:
    if not isinstance(r.key, str) or (r.checksum is not None and not isinstance(r.checksum, str)):
        raise _damaged(r.pack_id, "shard key or checksum")
    return ShardRow(_count(r.idx, "shard index", r.pack_id, 0, _MAX_SHARDS), r.location_id, r.key,
                    _count(r.size, "shard size", r.pack_id), r.checksum, r.state, r.verified_at)


def layouts(catalog: Catalog, pack_ids: Iterable[str]) -> dict[str, PackLayout]:
    """The layout (scheme and shards) of each pack among ``pack_ids`` the catalog knows."""
    with catalog.read() as conn:
        return layouts_in(conn, pack_ids)


def layouts_in(conn: Connection, pack_ids: Iterable[str]) -> dict[str, PackLayout]:
    """:func:`layouts`, within ``conn``'s transaction."""
    out: dict[str, PackLayout] = {}
    for batch in batches(list(dict.fromkeys(pack_ids))):
        shards: dict[str, list[ShardRow]] = {}
        for r in conn.execute(select(s.shards).where(s.shards.c.pack_id.in_(batch))):
            shards.setdefault(r.pack_id, []).append(_shard(r))
        for row in conn.execute(select(s.packs).where(s.packs.c.id.in_(batch))):
            out[row.id] = _layout(row, shards.get(row.id, ()))
    return out


def mark_shards(catalog: Catalog, pack_id: str, states: Mapping[int, tuple[str, int, str]]) -> None:
    """Record shard health: index -> (state, location id, key) where it was found so.

    ``missing`` / ``corrupt`` queue a shard for repair. A row that meanwhile
    points elsewhere (another process moved the shard) is left alone.
    """
    if catalog.read_only:  # health notes are hints for repair and scrubs: a reader keeps none
        return
    with catalog.write() as conn:
        for index, (state, location_id, key) in states.items():
            conn.execute(update(s.shards).where(
                s.shards.c.pack_id == pack_id, s.shards.c.idx == index,
                s.shards.c.location_id == location_id, s.shards.c.key == key).values(state=state))


def mark_pack_lost(catalog: Catalog, pack_id: str) -> None:
    """A pack cannot be read back: its chunks stop counting for dedup (state ``lost``), so
    the next commit holding one writes it again (publishing treats lost chunks as missing)."""
    if catalog.read_only:  # health notes are hints for repair and scrubs: a reader keeps none
        return
    with catalog.write() as conn:
        conn.execute(update(s.chunks).where(s.chunks.c.pack_id == pack_id, s.chunks.c.state == "live")
                     .values(state="lost"))


def mark_pack_found(catalog: Catalog, pack_id: str) -> None:
    """A pack was read back intact (repaired, or a location returned): its lost chunks are live."""
    if catalog.read_only:  # health notes are hints for repair and scrubs: a reader keeps none
        return
    with catalog.write() as conn:
        conn.execute(update(s.chunks).where(s.chunks.c.pack_id == pack_id, s.chunks.c.state == "lost")
                     .values(state="live"))


def replace_shards(catalog: Catalog, pack_id: str, rows: Sequence[ShardRow]) -> bool:
    """Record freshly written shards (new location, key, checksum), healthy and just verified.

    Returns False when the pack is gone (GC swept it meanwhile): the shards
    just written are then orphans, which the next GC removes.
    """
    now = time.time()
    with catalog.write() as conn:
        updated = 0
        for sh in rows:
            updated += conn.execute(update(s.shards).where(
                s.shards.c.pack_id == pack_id, s.shards.c.idx == sh.index).values(
                location_id=sh.location_id, key=sh.key, size=sh.size, checksum=sh.checksum,
                state="ok", verified_at=now)).rowcount
        return updated > 0


def mark_verified(catalog: Catalog, pack_id: str, indexes: Iterable[int], whole_pack: bool) -> None:
    """Record that these shards (and, if ``whole_pack``, the pack) were read and verified now."""
    now = time.time()
    if catalog.read_only:  # health notes are hints for repair and scrubs: a reader keeps none
        return
    with catalog.write() as conn:
        conn.execute(update(s.shards).where(s.shards.c.pack_id == pack_id,
                                            s.shards.c.idx.in_(list(indexes))).values(verified_at=now))
        if whole_pack:
            conn.execute(update(s.packs).where(s.packs.c.id == pack_id).values(verified_at=now))


def packs_to_repair(catalog: Catalog) -> list[str]:
    """Packs with a shard not ``ok``, on a location that is not ``active``, or sharing a
    failure domain with another of the pack's shards (placed so while a domain was down)."""
    sh, loc = s.shards, s.locations
    with catalog.read() as conn:
        damaged = set(conn.execute(
            select(sh.c.pack_id).join(loc, loc.c.id == sh.c.location_id)
            .where(or_(sh.c.state != "ok", loc.c.state != "active")).distinct()
        ).scalars())
        doubled = set(conn.execute(
            select(sh.c.pack_id).join(loc, loc.c.id == sh.c.location_id)
            .group_by(sh.c.pack_id, loc.c.domain).having(func.count() > 1)
        ).scalars())
    return sorted(damaged | doubled)


def degraded_candidates(catalog: Catalog, unreadable: Sequence[int]) -> list[str]:
    """Every pack that may be degraded (see :mod:`casckpt.engine.read.degraded`), and maybe some
    that are not: :func:`packs_to_repair`, packs with fewer shard rows than their scheme has,
    and packs with a shard on the locations ``unreadable`` (ids). Empty: none is degraded."""
    sh, p = s.shards, s.packs
    found = set(packs_to_repair(catalog))
    with catalog.read() as conn:
        found.update(conn.execute(
            select(p.c.id).outerjoin(sh, sh.c.pack_id == p.c.id).where(p.c.state == "live")
            .group_by(p.c.id, p.c.k, p.c.m)
            .having(func.count(sh.c.idx) < p.c.k + p.c.m)).scalars())
        if unreadable:
            found.update(conn.execute(
                select(sh.c.pack_id).where(sh.c.location_id.in_(list(unreadable))).distinct()).scalars())
    return sorted(found)


def scrub_order(catalog: Catalog) -> list[tuple[str, int]]:
    """Every pack on the locations (id, size), least recently verified first (never verified
    before all); packs still on a fast tier are not on the locations yet."""
    p = s.packs
    with catalog.read() as conn:
        return [(r[0], int(r[1])) for r in conn.execute(
            select(p.c.id, p.c.size).where(p.c.state == "live")
            .order_by(p.c.verified_at.is_not(None), p.c.verified_at, p.c.id))]


def set_pack_chunks(catalog: Catalog, pack_id: str, chunks: int) -> None:
    """Record how many chunk entries a pack holds (catalog rebuild learns it after the pack row)."""
    with catalog.write() as conn:
        conn.execute(update(s.packs).where(s.packs.c.id == pack_id).values(chunks=chunks))


def is_empty(catalog: Catalog) -> bool:
    """Whether the catalog holds no version and no pack (a rebuild's precondition)."""
    with catalog.read() as conn:  # EXISTS, not a count: a store of many versions answers at once
        held = exists(select(s.versions.c.id)) | exists(select(s.packs.c.id))
        return not conn.execute(select(held)).scalar_one()


def restore_location(catalog: Catalog, name: str, url: str | None, domain: str, state: str) -> None:
    """Register or update a location from a rebuild record (its failure domain and state)."""
    if state not in LOCATION_STATES:
        raise InvalidArgumentError(f"location state must be one of {', '.join(LOCATION_STATES)}")
    with catalog.write() as conn:
        row = conn.execute(select(s.locations).where(s.locations.c.name == name)).first()
        if row is None:
            conn.execute(s.locations.insert().values(name=name, url=url, domain=domain, state=state,
                                                     created_at=time.time()))
        else:
            conn.execute(update(s.locations).where(s.locations.c.id == row.id)
                         .values(domain=domain, state=state))


def restore_run(catalog: Catalog, name: str, created_at: float, parent_version: str | None,
                retention: Any, redundancy: str | None) -> None:
    """Create or update a run from a rebuild record."""
    with catalog.write() as conn:
        run_id = catalog.run_id(conn, name, create=True, audit=False)  # the rebuild records itself
        conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(
            created_at=created_at, parent_version=parent_version,
            retention=null() if retention is None else retention, redundancy=redundancy))


def date_runs_from_versions(catalog: Catalog) -> None:
    """Give each run the creation time of its first version (a rebuild, before run records)."""
    first = (select(func.min(s.versions.c.created_at)).where(s.versions.c.run_id == s.runs.c.id)
             .scalar_subquery())
    with catalog.write() as conn:
        conn.execute(update(s.runs).where(first.is_not(None)).values(created_at=first))
