"""``store.tier.status``: bytes per tier, versions not durable yet, this host's fast tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from casckpt.catalog import Catalog
from casckpt.catalog import tiers as sql
from casckpt.types import TierInfo, TierStatus

if TYPE_CHECKING:
    from casckpt.engine.tiering.tier import FastTier


def tier_status(catalog: Catalog, tier: FastTier | None) -> TierStatus:
    """See :class:`casckpt.TierStatus`."""
    summary = sql.pending_summary(catalog)
    versions = summary.pop("", {})
    infos = tuple(
        TierInfo(t.id, t.host, t.path, t.state, t.created_at, t.lost_at,
                 summary.get(t.id, {}).get("packs", 0), summary.get(t.id, {}).get("bytes", 0),
                 tier is not None and t.id == tier.id)
        for t in sql.tiers(catalog))
    waiting = tuple(v for v, state in sql.not_durable(catalog) if state == "fast")
    status = TierStatus(durable_bytes=sql.durable_bytes(catalog), versions=versions,
                        not_durable=waiting[:100], tiers=infos)
    if tier is None:
        return status
    held = tier.dir.resident()
    drained, seconds = tier.dir.drain_totals()
    disk = tier.dir.disk()
    return TierStatus(status.durable_bytes, status.versions, status.not_durable, status.tiers,
                      local_path=str(tier.dir.root), budget=tier.budget,
                      held_bytes=sum(r.size for r in held), held_packs=len(held),
                      drained_bytes=drained, drain_seconds=seconds,
                      disk_bytes=disk.total if disk is not None else None,
                      disk_free=disk.free if disk is not None else None,
                      warnings=tuple(tier.disk_problems()))
