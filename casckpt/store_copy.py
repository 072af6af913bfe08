"""``Store.copy``: versions copied into another store, the facade's side.

What the facade checks before the engine (:mod:`casckpt.engine.copying`) plans anything: the
destination is another, writable store, and the refs name versions. Stores that key their
chunk ids alike copy manifests as they are (a version keeps its id: ``copyplan``, ``copy``);
others commit each version again (``rekey``). This module picks the way and turns the
engine's outcome into a :class:`~casckpt.types.CopyReport`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from casckpt.catalog import history as history_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.rows import VersionRow
from casckpt.engine.versions.logfilter import make_filter
from casckpt.errors import CopyTargetError, NotAStoreError, RefNotFoundError
from casckpt.store_core import Ref, StoreCore
from casckpt.types import CopiedVersion, CopyReport, ProgressCallback, Version


def copy_versions(source: StoreCore, dest: StoreCore, refs: Sequence[Ref], *, dry_run: bool,
                  progress: ProgressCallback | None, lineage: bool = True) -> CopyReport:
    """Copy the versions ``refs`` name from ``source`` to ``dest`` (see ``Store.copy``)."""
    from casckpt.engine.copying import copy as copy_engine
    from casckpt.engine.copying import copyplan
    from casckpt.engine.read.trees import store_nodes

    started = time.monotonic()
    _refuse(source, dest, dry_run)
    rows = _rows(source, refs, dest)
    if source.crypto.state != dest.crypto.state:
        return _rekeyed(source, dest, rows, dry_run, progress, started, lineage)
    plan = copyplan.plan(source.catalog, dest.catalog, rows, store_nodes(source.ctx), lineage=lineage)
    if dry_run:
        versions = tuple(CopiedVersion(v.row.id, v.row.id, v.row.run, v.row.step, v.asked, not v.present,
                                       len(v.send), v.send_bytes) for v in plan.versions)
        return CopyReport(versions, plan.send_chunks, plan.send_bytes, tags_kept=_kept(plan.versions),
                          dry_run=True, seconds=time.monotonic() - started)
    out = copy_engine.execute(source.ctx, dest.ctx, plan, progress, source_lease=source.read_only is None)
    return CopyReport(tuple(out.versions), out.sent.chunks, sum(v.bytes for v in out.versions),
                      out.sent.stored_bytes, tuple(out.tags), _kept(plan.versions),
                      seconds=time.monotonic() - started, degraded_packs=len(out.sent.degraded))


def _kept(versions: Iterable[Any]) -> tuple[str, ...]:
    """The tags a copy left on the destination's own versions (``copyplan.movable_tags``)."""
    return tuple(sorted({name for v in versions for name in v.kept_tags}))


def _rekeyed(source: StoreCore, dest: StoreCore, rows: Sequence[VersionRow], dry_run: bool,
             progress: ProgressCallback | None, started: float, lineage: bool) -> CopyReport:
    """A copy between stores whose chunk ids are keyed differently: each version committed
    again at the destination (:mod:`casckpt.engine.copying.rekey`). A dry run cannot know
    what the destination lacks without reading every byte: it lists the versions, with the
    logical bytes each would read."""
    from casckpt.engine.copying import rekey

    versions = rekey.plan(source.catalog, dest.catalog, rows, lineage=lineage)
    if dry_run:
        listed = tuple(CopiedVersion(v.row.id, v.held or "", v.row.run, v.row.step, v.asked, v.held is None,
                                     0, v.row.logical_bytes if v.held is None else 0) for v in versions)
        return CopyReport(listed, 0, sum(v.bytes for v in listed), tags_kept=_kept(versions),
                          dry_run=True, seconds=time.monotonic() - started)
    out = rekey.execute(source.ctx, dest.ctx, versions, progress, source_lease=source.read_only is None)
    return CopyReport(tuple(out.versions), out.sent.chunks, out.sent.raw_bytes, out.sent.stored_bytes,
                      tuple(out.tags), _kept(versions), seconds=time.monotonic() - started,
                      degraded_packs=len(out.sent.degraded))


@contextlib.contextmanager
def opened_destination(opener: Callable[[str, str | None, bool], Any], where: str, key_file: str | None,
                       dry_run: bool) -> Iterator[Any]:
    """The store at ``where``, opened for a copy by ``opener`` (the one way copies and mirrors
    open a destination: its key is ``key_file`` alone). A dry run writes nothing there, not even
    a new store: where there is none yet, it plans against an empty one in a temporary
    directory (every version and chunk would be sent)."""
    try:
        store = opener(where, key_file, not dry_run)
    except NotAStoreError:
        if not dry_run:
            raise
        with tempfile.TemporaryDirectory(prefix="casckpt-copy-plan-") as empty:
            with opener(os.path.join(empty, "store"), key_file, True) as store:
                yield store
        return
    with store:
        yield store


def _refuse(source: StoreCore, dest: StoreCore, dry_run: bool) -> None:
    """What no copy may do: into itself, into a read-only or recovering store.

    Raises:
        CopyTargetError, ReadOnlyStoreError, StoreIdentityError: see ``Store.copy``.
    """
    if source is dest or source.catalog.store_id == dest.catalog.store_id:
        raise CopyTargetError(
            "a store cannot be copied into itself (both sides are store "
            f"{source.catalog.store_id}); name another store as the destination")
    if not dry_run:
        dest.refuse_write("copy into this store")
    dest.refuse_while_recovering("copy into this store")


def _rows(source: StoreCore, refs: Sequence[Ref], dest: StoreCore) -> list[VersionRow]:
    """The versions ``refs`` name, in order: a ref as ``resolve`` takes it, or a run's name
    for every visible version of the run (by step) but those the destination holds deleted
    (its retention's choice: a copy of the run does not undo it, nor fail on it).

    Raises:
        RefNotFoundError, AmbiguousRefError: a ref names nothing (near names suggested).
    """
    out: dict[str, VersionRow] = {}
    for ref in refs:
        for row in _named(source, ref, dest):
            out.setdefault(row.id, row)
    return list(out.values())


def _named(source: StoreCore, ref: Ref, dest: StoreCore) -> Iterable[VersionRow]:
    try:
        return [source.row(ref)]
    except RefNotFoundError:
        if isinstance(ref, Version) or ref not in source.catalog.run_names():
            raise
    query = make_filter(ref, limit=None, since=None, until=None, min_step=None, max_step=None,
                        tag=None, where=None, order="asc")
    rows = [source.row(v.id) for v in history_sql.log(source.catalog, query)]
    deleted = {(r.run, r.step) for r in retention_sql.find_deleted(dest.catalog, run=ref, limit=None)}
    return [row for row in rows if (row.run, row.step) not in deleted]
