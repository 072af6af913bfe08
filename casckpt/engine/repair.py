"""Repair: bring every pack back to full redundancy.

Works through the catalog's queue -- shards marked missing or corrupt (by
restores that healed around them, by ``check``) and shards on locations
marked ``failed`` or ``draining`` -- rebuilding each pack from its healthy
shards, verifying it against its id, and writing the shards it lacks: back
to their own location when it is active, else to an active location in a
failure domain the pack does not use yet. A moved shard's old object is
left for GC to delete as an orphan after the grace period, so other
processes still reading through the old layout are not cut off.

Repair holds a commit lease, so a concurrent GC never takes the shards it
has just written for orphans.
"""

from __future__ import annotations

import time

from casckpt.catalog import shards as shard_sql
from casckpt.catalog.gc import begin_lease, end_lease
from casckpt.engine.context import EngineContext
from casckpt.errors import BlobNotFoundError
from casckpt.types import ProgressCallback, RepairReport


def repair(ctx: EngineContext, progress: ProgressCallback | None = None) -> RepairReport:
    """Repair every pack in the queue; see the module docstring."""
    started = time.monotonic()
    queue = shard_sql.packs_to_repair(ctx.catalog)
    rewritten = moved = worked = 0
    unrepaired: list[str] = []
    lease = begin_lease(ctx.catalog)
    try:
        for done, pack_id in enumerate(queue, 1):
            try:
                outcome = ctx.packs.repair(pack_id)
            except BlobNotFoundError:  # GC removed the pack meanwhile: nothing to repair
                continue
            if outcome.rewritten or outcome.unplaced or outcome.error:
                worked += 1  # else: doubled-up shards with no free failure domain to go to yet
            rewritten += len(outcome.rewritten)
            moved += sum(1 for _, old, new in outcome.rewritten if old != new)
            if outcome.error or outcome.unplaced:
                reason = outcome.error or (
                    f"shards {list(outcome.unplaced)} found no active location in a failure domain "
                    "the pack does not already use; add a location (`casckpt location add`)")
                unrepaired.append(f"{pack_id}: {reason}")
            if progress is not None:
                progress("repair", done, len(queue))
    finally:
        end_lease(ctx.catalog, lease)
    return RepairReport(packs=worked, shards_rewritten=rewritten, shards_moved=moved,
                        unrepaired=tuple(unrepaired), duration_s=time.monotonic() - started)
