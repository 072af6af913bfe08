"""``store.tier.forget``: declare another host's fast tier lost by hand (its host or disk is
gone for good, so no open on that host will ever find it wiped and declare it lost itself)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from casckpt.catalog import Catalog
from casckpt.catalog import tiers as sql
from casckpt.errors import AmbiguousRefError, InvalidArgumentError, TierNotFoundError
from casckpt.storage.fasttier import IDENTITY
from casckpt.types import TierLoss

if TYPE_CHECKING:
    from casckpt.engine.tiering.tier import FastTier


def find_tier(catalog: Catalog, tier_id: str) -> sql.TierRow:
    """The tier whose id is ``tier_id`` or starts with it.

    Raises:
        TierNotFoundError: none does.
        AmbiguousRefError: several do.
    """
    rows = sql.tiers(catalog)
    found = [t for t in rows if t.id == tier_id] or [t for t in rows if tier_id and t.id.startswith(tier_id)]
    if not found:
        raise TierNotFoundError(tier_id, "no fast tier of this store has this id (`casckpt tier "
                                "status` lists them)", [t.id[:12] for t in rows][:5])
    if len(found) > 1:
        raise AmbiguousRefError(f"{tier_id!r} is the start of {len(found)} fast tier ids "
                                f"({', '.join(t.id[:12] for t in found)}); give more of it")
    return found[0]


def whole_here(row: sql.TierRow) -> bool:
    """Whether the tier is on this host, its directory still holding its identity record."""
    if row.host != socket.gethostname():
        return False
    try:
        record = json.loads((Path(row.path) / IDENTITY).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("tier") == row.id


def forget(catalog: Catalog, own: FastTier | None, tier_id: str) -> TierLoss:
    """See ``store.tier.forget``: declare the tier ``tier_id`` names lost, unless it is
    ``own`` (the handle's tier) or still whole on this host."""
    from casckpt.engine.tiering.tier import declare_lost

    row = find_tier(catalog, tier_id)
    if own is not None and own.id == row.id:
        raise InvalidArgumentError(
            f"fast tier {row.id} ({row.path}) is the one this store was opened with: it is not "
            "lost. Drain it instead (`casckpt drain`)")
    if row.state == "lost":
        return TierLoss(row.id, row.host, row.path, (), ())
    if whole_here(row):
        raise InvalidArgumentError(
            f"fast tier {row.id} is on this host ({row.path}) and whole: it is not lost. Drain it "
            f"instead (`casckpt --fast-tier {Path(row.path).parent} drain`); forget only a tier "
            "whose host or disk is gone for good")
    lost = declare_lost(catalog, row.id, "declared lost by hand")
    return TierLoss(row.id, row.host, row.path, lost.packs, lost.versions)
