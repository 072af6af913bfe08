"""Degraded packs and versions: stored with less redundancy than their scheme promises.

A pack is degraded when the catalog's shard rows show any of: a shard not
``ok`` (``missing``: never written or found gone, ``corrupt``), a shard on
a failed location, two shards in one failure domain (one failure there
costs both), or fewer shards than the scheme has. Its data may well be
intact -- ``repair`` restores the redundancy -- but it survives fewer
failures than the policy asked for.

A version is degraded when a pack holding one of its chunks (or a delta
base those chunks are decoded against) is. That is judged from the shard
rows as they are now, so it turns false once ``repair`` has done its work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from casckpt.catalog import PackLayout
from casckpt.catalog import shards as shard_sql
from casckpt.engine.context import StoreView
from casckpt.storage.locations import LocationSet

_DELTA_DEPTH = 1000  # base chains are at most 64 deep; this only stops a cycle a damaged catalog might hold


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why one pack is degraded: its ``problems``, one short phrase each (``shard 2 missing on
    loc1``), and the names of the locations ``refused``, which should hold a shard of it and do
    not (a write they refused, or a shard found gone there)."""

    pack_id: str
    problems: tuple[str, ...]
    refused: tuple[str, ...]

    def describe(self) -> str:
        """``pack <12 hex>: <problems>`` for messages."""
        return f"pack {self.pack_id[:12]}: {', '.join(self.problems)}"


def shortfall(ctx: StoreView, layout: PackLayout) -> Shortfall | None:
    """What keeps ``layout`` below its scheme's redundancy (None: nothing). Locations this
    process does not know yet (added meanwhile by another) are given the benefit of the doubt.
    A pack still on a fast tier has no shards yet: it is waiting for its drain, not degraded."""
    if layout.tier is not None:
        return None
    problems: list[str] = []
    refused: list[str] = []
    for sh in layout.shards:
        loc = ctx.locations.get(sh.location_id)
        name = loc.name if loc is not None else f"location #{sh.location_id}"
        if sh.state != "ok":
            problems.append(f"shard {sh.index} {sh.state} on {name}")
            refused.append(name)
        elif loc is not None and not loc.readable:
            problems.append(f"shard {sh.index} on failed location {name}")
    for domain, indexes in doubled_domains(ctx.locations, layout).items():
        problems.append(f"shards {indexes} share failure domain {domain!r}")
    if len(layout.shards) < layout.k + layout.m:
        problems.append(f"{len(layout.shards)} of {layout.k + layout.m} shards recorded")
    if not problems:
        return None
    return Shortfall(layout.id, tuple(problems), tuple(dict.fromkeys(refused)))


def doubled_domains(locations: LocationSet, layout: PackLayout) -> dict[str, list[int]]:
    """Failure domains holding more than one of a redundant pack's shards (on readable
    locations): domain -> shard indexes."""
    if layout.scheme == "none":
        return {}
    by_domain: dict[str, list[int]] = {}
    for sh in layout.shards:
        loc = locations.get(sh.location_id)
        if loc is not None and loc.readable:
            by_domain.setdefault(loc.domain, []).append(sh.index)
    return {domain: indexes for domain, indexes in sorted(by_domain.items()) if len(indexes) > 1}


def shortfalls(ctx: StoreView, layouts: Iterable[PackLayout]) -> list[Shortfall]:
    """:func:`shortfall` of each layout that has one."""
    return [found for layout in layouts if (found := shortfall(ctx, layout)) is not None]


def of_chunks(ctx: StoreView, chunk_ids: Sequence[str]) -> list[Shortfall]:
    """The degraded packs among those holding ``chunk_ids`` (hex) and the delta bases they are
    decoded against, from the catalog's shard rows as they are now."""
    packs: set[str] = set()
    seen: set[str] = set()
    wanted = list(dict.fromkeys(chunk_ids))
    for _ in range(_DELTA_DEPTH):
        if not wanted:
            break
        seen.update(wanted)
        found = ctx.catalog.find_chunks(wanted, live_only=False)
        packs.update(where.pack_id for where in found.values())
        wanted = [b for where in found.values() if (b := where.base_id) is not None and b not in seen]
    layouts = shard_sql.layouts(ctx.catalog, sorted(packs))
    return shortfalls(ctx, (layouts[p] for p in sorted(layouts)))


def anywhere(ctx: StoreView) -> bool:
    """Whether any pack of the store is degraded now (a version cannot be, when none is)."""
    unreadable = [loc.id for loc in ctx.locations.all if not loc.readable]
    suspects = shard_sql.degraded_candidates(ctx.catalog, unreadable)
    return bool(shortfalls(ctx, shard_sql.layouts(ctx.catalog, suspects).values())) if suspects else False


def summary(found: Sequence[Shortfall], limit: int = 3) -> str:
    """The first few packs' problems, and how many more, for a log line or a report."""
    shown = "; ".join(s.describe() for s in found[:limit])
    return shown + (f"; and {len(found) - limit} more pack(s)" if len(found) > limit else "")
