"""``Store.copy``: versions copied into another store, the facade's side.

What the facade checks before the engine (:mod:`casckpt.engine.copying`) plans anything: the
destination is another, writable store; both stores key their chunk ids alike (the same
manifest bytes then name the same chunks, so a version keeps its id); the refs name
versions. The engine plans, sends and publishes; this module turns its outcome into a
:class:`~casckpt.types.CopyReport`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from casckpt.catalog import history as history_sql
from casckpt.catalog.rows import VersionRow
from casckpt.engine.versions.logfilter import make_filter
from casckpt.errors import CopyTargetError, CopyUnsupportedError, RefNotFoundError
from casckpt.store_core import Ref, StoreCore
from casckpt.types import CopiedVersion, CopyReport, ProgressCallback, Version


def copy_versions(source: StoreCore, dest: StoreCore, refs: Sequence[Ref], *, dry_run: bool,
                  progress: ProgressCallback | None) -> CopyReport:
    """Copy the versions ``refs`` name from ``source`` to ``dest`` (see ``Store.copy``)."""
    from casckpt.engine.copying import copy as copy_engine
    from casckpt.engine.copying import copyplan
    from casckpt.engine.read.trees import store_nodes

    started = time.monotonic()
    _refuse(source, dest, dry_run)
    rows = _rows(source, refs)
    plan = copyplan.plan(source.catalog, dest.catalog, rows, store_nodes(source.ctx))
    if dry_run:
        versions = tuple(CopiedVersion(v.row.id, v.row.id, v.row.run, v.row.step, v.asked, not v.present,
                                       len(v.send), v.send_bytes) for v in plan.versions)
        return CopyReport(versions, plan.send_chunks, plan.send_bytes, dry_run=True,
                          seconds=time.monotonic() - started)
    out = copy_engine.execute(source.ctx, dest.ctx, plan, progress, source_lease=source.read_only is None)
    return CopyReport(tuple(out.versions), out.sent.chunks, sum(v.bytes for v in out.versions),
                      out.sent.stored_bytes, tuple(out.tags), seconds=time.monotonic() - started)


def _refuse(source: StoreCore, dest: StoreCore, dry_run: bool) -> None:
    """What no copy may do: into itself, into a read-only store, across chunk-id keys.

    Raises:
        CopyTargetError, ReadOnlyStoreError, CopyUnsupportedError: see ``Store.copy``.
    """
    if source is dest or source.catalog.store_id == dest.catalog.store_id:
        raise CopyTargetError(
            "a store cannot be copied into itself (both sides are store "
            f"{source.catalog.store_id}); name another store as the destination")
    if not dry_run:
        dest.refuse_write("copy into this store")
    dest.refuse_while_recovering("copy into this store")
    if source.crypto.state != dest.crypto.state:
        sides = {False: "not encrypted", True: "encrypted"}
        which = (f"the source is {sides[source.crypto.encrypted]} and the destination "
                 f"{sides[dest.crypto.encrypted]}" if source.crypto.encrypted != dest.crypto.encrypted
                 else "the two stores are encrypted with different data keys")
        raise CopyUnsupportedError(
            f"cannot copy between these stores: {which}, so their chunk ids are keyed differently "
            "and a version cannot keep its id. Copy into a store with the same keying (a store whose "
            "catalog shares the data key, or both plain), or move the version through files: "
            "`casckpt export REF --to DIR` on the source, then `casckpt import DIR --run RUN --step N` "
            "on the destination (its history, tags and lineage are not carried over then)")


def _rows(source: StoreCore, refs: Sequence[Ref]) -> list[VersionRow]:
    """The versions ``refs`` name, in order: a ref as ``resolve`` takes it, or a run's name
    for every visible version of the run (by step).

    Raises:
        RefNotFoundError, AmbiguousRefError: a ref names nothing (near names suggested).
    """
    out: dict[str, VersionRow] = {}
    for ref in refs:
        for row in _named(source, ref):
            out.setdefault(row.id, row)
    return list(out.values())


def _named(source: StoreCore, ref: Ref) -> Iterable[VersionRow]:
    try:
        return [source.row(ref)]
    except RefNotFoundError:
        if isinstance(ref, Version) or ref not in source.catalog.run_names():
            raise
    query = make_filter(ref, limit=None, since=None, until=None, min_step=None, max_step=None,
                        tag=None, where=None, order="asc")
    return [source.row(v.id) for v in history_sql.log(source.catalog, query)]
