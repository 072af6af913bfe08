"""Restore drills: read versions back the way a restart would, and record what happened.

A drill picks versions (:func:`pick`: the latest of each run asked, plus random older visible
ones up to ``count`` in all), restores each one into memory through the same verified path
``Store.restore`` takes (the catalog's manifest, checked against its id; every chunk read
from the packs and checked against its id; the state rebuilt on the CPU), times it, and
drops it. Nothing is written to disk, and nothing in the store is repaired: reads pass
``heal=False``, so a damaged shard found on the way is left for ``casckpt repair`` (marked
for it, as ``check`` marks it), and a drill reports what a restore would have met.

A drill asks whether the store's locations bring a version back, as a restart on any host
would: it reads from the locations only, never from this host's fast tier, and picks durable
versions (one still waiting for its drain is not drilled yet). A run whose versions are all
lost with a fast tier is drilled on its newest lost one, which fails
(:class:`~casckpt.errors.VersionLostError`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

from casckpt.catalog import drills as sql
from casckpt.catalog.rows import VersionRow
from casckpt.engine.context import EngineContext
from casckpt.engine.versions.durability import check_readable
from casckpt.engine.versions.refs import load_manifest
from casckpt.errors import CasckptError, InvalidArgumentError, VersionNotDurableError
from casckpt.types import DrillResult, ProgressCallback


def pick(versions: Sequence[VersionRow], count: int, rng: random.Random) -> list[VersionRow]:
    """The versions to drill: the newest durable version (highest step) of each run among
    ``versions``, then random older durable ones up to ``count`` in all (never fewer than
    one per run), by run and step. Versions still on a fast tier are not drilled yet (their
    drain is not done); a run with no durable version but lost ones is drilled on its newest
    lost one, which fails: that run cannot restart."""
    durable = [row for row in versions if row.durability == "durable"]
    runs = {row.run for row in durable}
    latest: dict[str, VersionRow] = {}
    for row in [*durable, *(r for r in versions if r.durability == "lost" and r.run not in runs)]:
        if row.run not in latest or row.step > latest[row.run].step:
            latest[row.run] = row
    chosen = {row.id for row in latest.values()}
    older = sorted((row for row in durable if row.id not in chosen), key=lambda r: (r.run, r.step))
    extra = rng.sample(older, min(len(older), max(0, count - len(latest))))
    return sorted([*latest.values(), *extra], key=lambda r: (r.run, r.step))


def check_count(count: object) -> int:
    """``count`` if it is a positive int (else InvalidArgumentError)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"count must be a positive int (versions to drill), got {count!r}")
    return count


def reader(ctx: EngineContext, progress: ProgressCallback | None = None) -> Callable[[VersionRow], None]:
    """A function restoring a version into memory, every byte verified, and dropping it.

    The restore engine (and torch) is imported here, so the first version timed does not pay
    for the import. The function raises:

    - VersionLostError, VersionNotDurableError: the version is not durable (nothing read);
    - IntegrityError (CorruptChunkError, MissingDataError, ...), StorageError: what a
      restore would have raised.
    """
    from casckpt.engine.read.restore import materialize

    located = _locations_only(ctx)

    def read_back(row: VersionRow) -> None:
        if row.durability != "durable":
            check_readable(ctx.catalog, row.id, row.durability)  # lost, or on another host's tier
            raise VersionNotDurableError(
                f"version {row.id[:12]} ({row.run}@{row.step}) is on this host's fast tier and not "
                "drained to the store's locations yet, so losing this host would lose it. Run "
                "`casckpt drain --wait` (or store.tier.wait_durable()) and drill again")
        materialize(located, load_manifest(ctx.catalog, row), map_location="cpu", progress=progress,
                    heal=False)
    return read_back


def _locations_only(ctx: EngineContext) -> EngineContext:
    """``ctx`` reading from the store's locations only, never from this host's fast tier: a
    drill asks whether a restart anywhere brings the version back, not whether this host's
    disk still holds a copy."""
    return replace(ctx, packs=ctx.packs.on_locations())


def drill(ctx: EngineContext, rows: Sequence[VersionRow], *, record: bool,
          progress: ProgressCallback | None = None) -> tuple[str, tuple[DrillResult, ...]]:
    """Read back every version of ``rows`` in turn (:func:`reader`), timing each; returns the
    drill's id and its results, in the order of ``rows``. A
    :class:`~casckpt.errors.CasckptError` makes that version's result failed, with its
    message. ``record``: write the results (one transaction, with the ``drill`` audit row).

    ``progress`` gets ``("drill", versions done, versions)`` after each version, and the
    ``read`` phase of each restore.

    Raises:
        CatalogError, CatalogUnavailableError: recording failed (the drill ran).
    """
    drill_id = uuid.uuid4().hex
    read_back = reader(ctx, progress)
    results: list[DrillResult] = []
    for done, row in enumerate(rows, 1):
        at, started, error = time.time(), time.monotonic(), None
        try:
            read_back(row)
        except CasckptError as exc:
            error = str(exc) or type(exc).__name__
        results.append(DrillResult(drill_id, at, row.id, row.run, row.step, row.logical_bytes,
                                   time.monotonic() - started, error is None, error))
        if progress is not None:
            progress("drill", done, len(rows))
    if record:
        sql.add(ctx.catalog, results)
    return drill_id, tuple(results)
