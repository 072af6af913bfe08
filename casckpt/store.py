"""The Store facade: wires catalog, index cache, blob store and engine together.

This is the only module that builds components; everything below it receives
what it needs. A ``Store`` is thread-safe: concurrent commits and restores from
several threads share its pools (the catalog serialises what must be serial).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

import numpy as np
import torch

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog, MissingChunksError
from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog import history as history_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.rows import VersionRow
from casckpt.catalog.rows import version as version_of
from casckpt.catalog.treemigrate import tree_root
from casckpt.engine import commit as commit_engine
from casckpt.engine import degraded, records, trees, treeviews
from casckpt.engine import gc as gc_engine
from casckpt.engine import history as history_engine
from casckpt.engine import restore as restore_engine
from casckpt.engine import retention as retention_engine
from casckpt.engine.background import BackgroundCommitter, CommitHandle
from casckpt.engine.context import EngineContext
from casckpt.engine.deltabase import BaseCache
from casckpt.engine.leftovers import reclaim_leftovers
from casckpt.engine.packs import Packs
from casckpt.engine.probe import LocationProber
from casckpt.engine.refs import bind, check_run, load_manifest, resolve, run_not_found
from casckpt.engine.staging import StagingBuffers
from casckpt.engine.validate import check_name
from casckpt.errors import (
    CasckptError,
    CommitTimeoutError,
    InvalidArgumentError,
    RefNotFoundError,
    VersionSweptError,
)
from casckpt.format import keys
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, TreeHead, decode_manifest, sharding
from casckpt.format.tree import iter_values, rank_path
from casckpt.format.treemanifest import head_values
from casckpt.run import Run, save_rule, set_policy
from casckpt.storage import redact_url
from casckpt.storage.locations import CurrentLocations, LocationSet
from casckpt.storage.scratch import ScratchDir
from casckpt.store_admin import StoreAdmin
from casckpt.store_distributed import StoreDistributed
from casckpt.types import (
    GCReport,
    ProgressCallback,
    RetentionPlan,
    RetentionPolicy,
    RunInfo,
    RunNode,
    TensorHistoryEntry,
    TensorInfo,
    Version,
    VersionDetail,
    VersionDiff,
    group_tensors,
    natural_key,
    sorted_groups,
)

Ref = str | Version
log = logging.getLogger(__name__)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


class Store(StoreAdmin, StoreDistributed):
    """A casckpt store: commit, restore and query checkpoint versions.

    Build one with :func:`casckpt.open`. Use it as a context manager, or call
    :meth:`close` when done.
    """

    def __init__(self, *, root: Path | None, catalog: Catalog, cache: IndexCache,
                 locations: LocationSet, staging: Path, settings: cfg.Settings,
                 write_quorum: int | None = None, s3: Mapping[str, Any] | None = None,
                 config_file: Path | None = None, recovering: bool = False) -> None:
        self.path = root
        self._recovering = recovering  # opened with recover=True over data the catalog lacks
        self._locations_loaded = time.monotonic()
        self._s3 = dict(s3 or {})
        self._config_file = config_file
        reclaim_leftovers(staging, locations)  # staging and tmp files of dead commits
        self._staging = ScratchDir(staging)
        self._io = ThreadPoolExecutor(max(4, len(locations.all)), thread_name_prefix="casckpt-shard")
        current = CurrentLocations(locations)
        self._ctx = EngineContext(
            catalog=catalog, cache=cache, current_locations=current,
            packs=Packs(catalog, current, self._io, write_quorum),
            staging=self._staging, config=settings, device_buffers=StagingBuffers(settings.staging_memory),
            bases=BaseCache(settings.delta_memory),
            pool=ThreadPoolExecutor(settings.workers, thread_name_prefix="casckpt"),
            uploads=ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="casckpt-upload"),
        )
        self._prober = LocationProber()
        self._committer = BackgroundCommitter(
            self._ctx, max_pending=settings.max_pending_commits, memory=settings.commit_memory,
            backpressure=settings.backpressure)
        self._closed = False
        self._dcp_writers = weakref.WeakSet()  # DCP saves through this store

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Finish pending background commits, then release threads, the cache, pooled
        connections and clients. Idempotent.

        Raises:
            BackgroundCommitError: a background commit failed and nobody waited on its
                handle (everything is released all the same).
            InvalidArgumentError: a ``dcp.async_save`` is still writing through the store
                (nothing is closed; wait for its future, then close).
        """
        if self._closed:
            return
        self._refuse_close_while_saving()
        self._closed = True
        try:
            self._committer.close()
        finally:
            self._release()

    def _release(self) -> None:
        self._release_dcp_writers()
        self._ctx.pool.shutdown(wait=True)
        self._ctx.uploads.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._ctx.cache.close()
        self._ctx.catalog.close()
        self._ctx.locations.close()
        self._staging.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:  # an error is on its way out already: report a background failure, do not mask it
            self.close()
        except CasckptError as failure:
            log.error("while closing the store after %s: %s", exc_type.__name__ if exc_type else "?", failure)

    def __repr__(self) -> str:
        return f"<casckpt.Store {redact_url(self._ctx.locations.all[0].blobs.url)}>"

    # -- commit and restore -------------------------------------------------

    @overload
    def commit(self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
               metrics: Mapping[str, float] | None = None, message: str | None = None,
               tags: Iterable[str] = (), progress: ProgressCallback | None = None,
               block: Literal[True] = True, group: Any = None) -> Version: ...

    @overload
    def commit(self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
               metrics: Mapping[str, float] | None = None, message: str | None = None,
               tags: Iterable[str] = (), progress: ProgressCallback | None = None,
               block: Literal[False], group: None = None) -> CommitHandle: ...

    def commit(
        self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None, message: str | None = None,
        tags: Iterable[str] = (), progress: ProgressCallback | None = None, block: bool = True,
        group: Any = None,
    ) -> Version | CommitHandle:
        """Store ``state`` as version ``run@step``.

        Only chunks the store has never held are written. With ``block=True``
        (default) this returns the version once it is visible; the state is
        read, not modified, and must not be mutated until ``commit`` returns.

        With ``block=False`` it returns a :class:`CommitHandle` as soon as the
        state is snapshotted: every chunk hashed in place, and only the chunks
        the store does not hold copied (so the pause and the memory scale with
        what changed). From then on the caller may mutate its tensors; the
        rest runs in the background, in commit order. ``handle.wait()``
        returns the version or raises why it failed; a failure nobody waited
        for is raised by the next commit or by :meth:`close`. Bounds and
        backpressure: ``max_pending_commits``, ``commit_memory`` and
        ``backpressure`` of :func:`casckpt.open` (see
        :mod:`casckpt.engine.background`).

        Raises:
            UnsupportedStateError: the tree holds an unsupported object (nothing written).
            InvalidNameError, InvalidArgumentError: bad run/tag name, step, metadata or metrics.
            VersionExistsError: ``run`` already has a version at ``step``.
            StorageError, CatalogError: the blob store or catalog failed; the
                version is not visible and the store stays consistent.
            GroupCommitError: with ``group``, some rank failed (raised on every rank).
        """
        req = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        self._refuse_while_recovering("commit")
        if group is not None:
            if not block:
                raise InvalidArgumentError(
                    "group commits block; for a background save of many ranks use "
                    "dcp.async_save(state, storage_writer=store.dcp_writer(run=..., step=...))"
                )
            def preflight() -> None:  # on every rank, inside the first collective step
                self._refresh_locations()
                self._committer.raise_unreported()  # a background failure nobody saw yet
                self._committer.drain()  # versions of a run appear in commit order

            return self._group_commit(state, req, group, progress, preflight)
        self._refresh_locations()
        if not block:
            return self._committer.commit(state, req, progress)
        return self._committer.foreground(lambda: commit_engine.commit(self._ctx, state, req, progress))

    def pending_commits(self) -> list[CommitHandle]:
        """Background commits not finished yet, oldest first."""
        return self._committer.pending()

    def wait_commits(self, timeout: float | None = None) -> None:
        """Wait for every background commit; raise the first failure nobody waited on.

        Raises:
            CommitTimeoutError: ``timeout`` seconds passed with commits still running.
            BackgroundCommitError: a background commit failed unseen.
        """
        if not self._committer.drain(timeout):
            raise CommitTimeoutError(f"background commits still running after {timeout} s")
        self._committer.raise_unreported()

    def restore(self, ref: Ref, into: object = None, *, map_location: Any = None,
                progress: ProgressCallback | None = None, group: Any = None,
                rank: int | None = None) -> Any:
        """Bring back the state tree of ``ref``, every byte verified.

        Args:
            ref: a ref string (``run@step``, ``run@latest``, ``run@~N``,
                ``tag:NAME``, id prefix) or a :class:`Version`.
            into: None to get a new tree; or a tree / ``nn.Module`` / optimizer /
                anything with ``state_dict``/``load_state_dict`` to restore in
                place (existing CPU tensors of matching dtype and shape are
                filled directly, without a second copy).
            map_location: device for new tensors (e.g. ``"cuda:0"``).
            group: for a version a process group committed rank by rank
                (``commit(..., group=)``): each rank of ``group`` gets its own
                state. A version saved with ``dcp.save`` restores whole here
                (every shard assembled).
            rank: for such a version, whose state to get.

        Returns:
            The new tree, or ``into`` updated.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            RestoreTargetError: ``into`` does not match the stored state, or a version
                saved rank by rank without ``group``/``rank`` (or with another group size).
            CorruptChunkError, MissingDataError: stored data is damaged or gone.
        """
        manifest = self._rank_manifest(self._manifest(ref), group, rank)
        if into is None:
            return restore_engine.materialize(self._ctx, manifest, map_location=map_location,
                                              progress=progress)
        return restore_engine.restore_into(self._ctx, manifest, into, map_location=map_location,
                                           progress=progress)

    def load_tensor(self, ref: Ref, path: str, *, map_location: Any = None) -> torch.Tensor | np.ndarray:
        """Read one tensor (dotted path, e.g. ``model.layers.0.weight``), fetching only its chunks.

        A tensor sharded across ranks comes back whole; in a version saved rank
        by rank, ``rank1/model.weight`` names rank 1's tensor.

        Raises:
            TensorNotFoundError: no tensor at ``path`` (near matches listed).
        """
        row = self._row(ref)
        head = bind(row, decode_manifest(self._ctx.catalog.manifest(row.id), row.id))
        if head.tree is not None:  # only the nodes on the way to the tensor are read
            found = treeviews.Trees(self._ctx.catalog).entry(head, path)  # validated
            if found is not None:
                entry, blobs = found
                one = replace(head, root={"t": "tensor", "i": 0}, tensors=(entry,), blobs=tuple(blobs))
                return restore_engine.load_tensor(self._ctx, one, entry.path, map_location)
        manifest, path = self._tensor_manifest(load_manifest(self._ctx.catalog, row), path)
        return restore_engine.load_tensor(self._ctx, manifest, path, map_location)

    # -- queries ------------------------------------------------------------

    def resolve(self, ref: Ref) -> Version:
        """The version a ref names."""
        return self._version(self._row(ref))

    def log(
        self, run: str | None = None, *, limit: int | None = None,
        since: datetime | float | None = None, until: datetime | float | None = None,
        min_step: int | None = None, max_step: int | None = None, tag: str | None = None,
        where: str | Iterable[str] | None = None, order: str = "desc",
    ) -> list[Version]:
        """Versions of ``run`` (all runs if None) that pass every filter given, newest first.

        Served by one SQL query (plus one for tags), however many versions match.

        Args:
            run: only this run; versions are then ordered by step, else by creation time.
            limit: at most this many versions (after ordering).
            since: creation time lower bound, inclusive (datetime, naive = local
                time, or epoch seconds).
            until: creation time upper bound, inclusive (as ``since``).
            min_step: lowest step, inclusive.
            max_step: highest step, inclusive.
            tag: only the version this tag points at.
            where: predicates that must all hold, ``NAME OP VALUE`` with OP one of
                ``< <= > >= == !=``; NAME a metric (``"loss<2.1"``) or
                ``metadata.KEY`` / ``meta.KEY`` (``"metadata.optimizer==adamw"``).
                Numbers compare numerically, other values as strings; versions
                lacking NAME never match.
            order: ``"desc"`` (newest / highest step first) or ``"asc"``.

        Raises:
            RefNotFoundError: no such run or tag (near names suggested).
            InvalidArgumentError: a bad limit, bound, order or predicate (the
                message gives the predicate grammar).
        """
        if run is not None:
            check_run(self._ctx.catalog, check_name(run, "run"))
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(f"limit must be a non-negative int, got {limit!r}")
        query = history_engine.make_filter(
            run, limit=limit, since=since, until=until, min_step=min_step, max_step=max_step,
            tag=check_name(tag, "tag") if tag is not None else None, where=where, order=order,
        )
        if tag is not None:
            history_engine.check_tag(self._ctx.catalog, tag)
        return history_sql.log(self._ctx.catalog, query)

    def show(self, ref: Ref, *, tensors: bool = True) -> VersionDetail:
        """A version with its tensors (in natural order: ``layers.2`` before ``layers.10``),
        plain values (from its manifest), and whether it is degraded now (see
        :class:`~casckpt.types.VersionDetail`).

        ``tensors=False`` leaves the per-tensor list out (``tensors`` is empty) and fills
        only the summary (``tensor_count``, ``tensor_bytes``, ``tensor_groups``): what
        ``casckpt show`` prints by default, without a row per tensor of a 100,000-tensor state.
        """
        row = self._row(ref)
        manifest = bind(row, decode_manifest(self._ctx.catalog.manifest(row.id), row.id))  # a tree's head
        if manifest.tree is not None:
            quick = None if tensors else self._summary(row, manifest.tree)
            if quick is not None:
                return quick
            manifest = load_manifest(self._ctx.catalog, row)
        else:  # a version of format 1 migrated to a tree reads as one (its tensor rows are gone)
            manifest = trees.adopted(manifest, tree_root(self._ctx.catalog, row.id))
        pieces = sharding(manifest)
        if tensors:
            found = self._ctx.catalog.tensors_of(row.id) if manifest.tree is None else \
                treeviews.Trees(self._ctx.catalog).tensor_rows(manifest)[0]
            listed = tuple(sorted((
                TensorInfo(t.path, t.dtype, tuple(t.shape), t.nbytes, t.chunks, t.digest,
                           *pieces.get(t.path, (1, ())))
                for t in found), key=lambda t: natural_key(t.path)))
            groups = group_tensors((t.path, t.nbytes) for t in listed)
        else:
            listed = ()
            groups = group_tensors(_tensor_sizes(manifest))
        world = manifest.world
        ids = list(dict.fromkeys(c.hex() for c in manifest.chunk_ids()))
        delta_chunks, longest = deltas_sql.version_deltas(self._ctx.catalog, ids)
        below = degraded.of_chunks(self._ctx, ids)
        return VersionDetail(self._version(row), listed, dict(iter_values(manifest.root)),
                             world.size if world else None, world.api if world else None,
                             delta_chunks, longest, degraded=bool(below), degraded_packs=len(below),
                             degraded_detail=degraded.summary(below) if below else None,
                             tensor_count=sum(g.tensors for g in groups),
                             tensor_bytes=sum(g.nbytes for g in groups), tensor_groups=groups)

    def _summary(self, row: VersionRow, tree: TreeHead) -> VersionDetail | None:
        """``show(tensors=False)`` of a tree version from its document alone (None: the document
        keeps no summary, or the store has degraded packs or delta chunks: read the tree)."""
        values = head_values(tree)
        if tree.groups is None or values is None or \
                deltas_sql.any_deltas(self._ctx.catalog) or degraded.anywhere(self._ctx):
            return None
        return VersionDetail(self._version(row), (), values, None, None, 0, 0, degraded=False,
                             tensor_count=tree.tensors, tensor_bytes=tree.nbytes,
                             tensor_groups=sorted_groups(tree.groups))

    def run(self, name: str, *, retention: RetentionPolicy | Mapping[str, Any] | None = None,
            redundancy: str | None = None, delta_chain: int | None = None,
            save_every: int | timedelta | tuple[int, timedelta] | None = None) -> Run:
        """A handle on run ``name``: ``save``, ``restore``, ``should_save`` and the rest without
        repeating ``run=`` (see :class:`casckpt.run.Run`). The policies given are stored for
        the run now (as ``set_retention``, ``set_redundancy``, ``set_delta_chain``: creating
        the run); ``save_every`` (steps, a timedelta, or both) is what ``should_save`` asks.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: a bad ``save_every`` or policy, naming it.
        """
        check_name(name, "run")
        handle = Run(self, name, save_rule(save_every))
        if retention is not None:
            set_policy(self, name, retention)
        if redundancy is not None:
            self.set_redundancy(redundancy, run=name)
        if delta_chain is not None:
            self.set_delta_chain(delta_chain, run=name)
        return handle

    def runs(self) -> list[RunInfo]:
        """Every run with a summary of its versions."""
        return [
            RunInfo(r[0], _utc(r[1]), r[2], r[3], r[4], int(r[5])) for r in self._ctx.catalog.runs()
        ]

    def tag(self, ref: Ref, name: str) -> Version:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        check_name(name, "tag")
        row = self._row(ref)
        self._ctx.catalog.set_tag(name, row.id)
        records.record_tag(self._ctx.locations, self._ctx.catalog, name, row.id)
        return self._version(row)

    def gc(self, *, dry_run: bool = False, grace: float | timedelta | None = None,
           force: bool = False, progress: ProgressCallback | None = None) -> GCReport:
        """Apply every run's retention policy, then reclaim space no version needs.

        Safe while other processes commit and restore (see
        :mod:`casckpt.engine.gc`). Only one GC runs at a time.

        Args:
            dry_run: report what would happen; delete nothing.
            grace: how long deleted versions stay undeletable and unreferenced
                data stays in place (seconds or timedelta; default 6 hours).
                ``0`` reclaims at once (tests, or when no reader is active).
            force: delete even when the locations hold manifests the catalog does
                not know, or many objects of unknown packs (the circuit breakers of
                :mod:`casckpt.engine.gcguard`); never without the store's identity.

        GC deletes an object only with positive proof that it is garbage (see
        :mod:`casckpt.engine.gcguard`); objects it could not prove are left in
        place and listed in ``GCReport.kept``.

        Raises:
            GCRunningError: another GC holds the lock.
            GCRefusedError: deleting is not proven safe; nothing was changed.
            StorageError, CatalogError: listing or the catalog failed; GC
                stopped without deleting any object it had not already
                unlinked from the catalog.
        """
        self._refuse_while_recovering("gc")
        seconds = grace.total_seconds() if isinstance(grace, timedelta) else grace
        if seconds is None:
            seconds = gc_engine.DEFAULT_GRACE_S
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 <= seconds < float("inf")
        ):
            raise InvalidArgumentError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        return gc_engine.collect(self._ctx, grace=float(seconds), dry_run=dry_run, force=force,
                                 progress=progress)

    # -- retention ----------------------------------------------------------

    def set_retention(
        self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
        keep_hourly: int | None = None, keep_daily: int | None = None, keep_weekly: int | None = None,
        keep_within: float | timedelta | str | None = None,
        keep_best: tuple[str, int, str] | None = None, keep_tagged: bool = True,
    ) -> RetentionPolicy:
        """Store the retention policy of ``run`` (replacing any); :meth:`gc` applies it.

        Rules combine as in restic's ``forget``: a version is kept if ANY rule
        keeps it (semantics in :mod:`casckpt.engine.retention`). ``keep_within``
        is a timedelta, seconds, or a string like ``"7d"``; ``keep_best`` is
        ``(metric, n, "min" | "max")``. Fork points of live runs are always
        kept. A run that does not exist yet is created, so a training
        script may set its policy before its first commit.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: a value is not positive, or no keep rule is
                given (``keep_tagged`` alone would delete every untagged version).
        """
        check_name(run, "run")
        policy = retention_engine.make_policy(
            keep_last=keep_last, keep_every=keep_every, keep_hourly=keep_hourly,
            keep_daily=keep_daily, keep_weekly=keep_weekly, keep_within=keep_within,
            keep_best=keep_best, keep_tagged=keep_tagged,
        )
        retention_sql.store_policy(self._ctx.catalog, run, retention_engine.policy_to_json(policy),
                                   create=True)
        records.record_run(self._ctx.locations, self._ctx.catalog, run)
        return policy

    def retention(self, run: str) -> RetentionPolicy | None:
        """The retention policy of ``run``; None when it has none (it keeps every version).

        Raises:
            RefNotFoundError: there is no such run.
        """
        stored = retention_sql.run_policies(self._ctx.catalog, self._existing_run(run)).get(run)
        return None if stored is None else retention_engine.policy_from_json(stored, run)

    def clear_retention(self, run: str) -> None:
        """Remove the retention policy of ``run``: it keeps every version again. Idempotent.

        Raises:
            RefNotFoundError: there is no such run.
        """
        if not retention_sql.store_policy(self._ctx.catalog, self._existing_run(run), None, create=False):
            raise run_not_found(self._ctx.catalog, run)
        records.record_run(self._ctx.locations, self._ctx.catalog, run)

    def plan_retention(self, run: str | None = None) -> list[RetentionPlan]:
        """What retention would do, writing nothing: a decision per visible version, with reasons.

        With ``run``: that run's plan (every version kept when it has no
        policy); without: a plan for every run that has a policy, by name.
        Bytes freed need a mark over the whole store: ``gc(dry_run=True)`` reports them.

        Raises:
            RefNotFoundError: there is no such run.
            CatalogError: a stored policy is malformed.
        """
        if run is not None:
            self._existing_run(run)
        with self._ctx.catalog.read() as conn:
            histories = retention_sql.load_histories(conn, run)
        return [retention_engine.plan(history) for history in histories]

    def delete(self, ref: Ref, reason: str = "manual") -> Version:
        """Soft-delete a version: it leaves refs, log and show at once; GC reclaims its data later.

        :meth:`undelete` brings it back until GC sweeps its chunks (after the
        grace period). Returns the version as it was. An explicit delete
        removes tagged versions and fork points too (retention never does);
        their tags stay and come back with :meth:`undelete`.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            InvalidArgumentError: ``reason`` is not a non-empty str.
        """
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError(f"reason must be a non-empty str, got {reason!r}")
        version = self.resolve(ref)
        retention_sql.delete_version(self._ctx.catalog, version.id, reason)
        return version

    def undelete(self, ref: str | Version) -> Version:
        """Make a deleted version visible again, exactly as it was (tags included).

        Args:
            ref: the deleted version's id, a unique prefix of it, or ``run@step``.

        Raises:
            RefNotFoundError, AmbiguousRefError: no (single) deleted version matches.
            VersionSweptError: GC already swept some of its data; it is gone.
        """
        row = retention_sql.resolve_deleted(self._ctx.catalog, ref.id if isinstance(ref, Version) else ref)
        label = f"{row.run}@{row.step}"
        if not self._ctx.locations.exists_anywhere(keys.manifest_key(row.id)):
            raise VersionSweptError(label, "GC already removed its manifest; it cannot be undeleted")
        manifest = trees.migrated(  # a migrated version's nodes are revived with its chunks
            trees.decode(self._ctx, self._ctx.catalog, self._ctx.catalog.manifest(row.id), row.id),
            tree_root(self._ctx.catalog, row.id))
        chunk_ids = [cid.hex() for cid in manifest.chunk_ids()]
        try:
            if not retention_sql.undelete_version(self._ctx.catalog, row.id, chunk_ids):
                raise RefNotFoundError(label, "it is no longer deleted (undeleted or purged meanwhile)")
        except MissingChunksError as exc:
            raise VersionSweptError(
                label, f"GC already swept {len(exc.missing)} of its chunks; it cannot be undeleted"
            ) from None
        return self.resolve(row.id)

    def _existing_run(self, run: str) -> str:
        check_run(self._ctx.catalog, check_name(run, "run"))
        return run

    # -- history and lineage ------------------------------------------------

    def diff(self, a: Ref, b: Ref) -> VersionDiff:
        """What changed from version ``a`` to version ``b``: tensors and plain values.

        Tensors are compared by content digest; changed bytes come from
        comparing chunk lists (see :class:`casckpt.types.TensorChange`), so no
        tensor data is read. Plain values come from the manifests the catalog keeps.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        return history_engine.diff(self._ctx.catalog, self._row(a), self._row(b))

    def history(self, run: str, path: str) -> list[TensorHistoryEntry]:
        """The versions of ``run`` in which the tensor at ``path`` changed, by step.

        Its first appearance counts as a change; so does its removal (an entry
        with ``change="removed"``). A forked run's history starts in the run it
        was forked from, up to the fork point.

        Raises:
            RefNotFoundError: no such run.
            TensorNotFoundError: no version has a tensor at ``path`` (near paths of
                the latest version suggested).
        """
        check_name(run, "run")
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"path must be a non-empty str, got {path!r}")
        return history_engine.tensor_history(self._ctx.catalog, run, path)

    def fork(self, ref: Ref, run: str) -> RunInfo:
        """Create run ``run`` branching from the version ``ref`` names (fine-tunes, sweeps).

        The first version committed to ``run`` gets that version as its parent;
        ``run`` has no versions until then. Retention keeps fork points.

        Raises:
            InvalidNameError: bad run name.
            RunExistsError: a run named ``run`` exists.
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        check_name(run, "run")
        row = self._row(ref)
        created = history_sql.fork(self._ctx.catalog, run, row.id)
        records.record_run(self._ctx.locations, self._ctx.catalog, run)
        return RunInfo(run, _utc(created), 0, None, None, 0)

    def tree(self) -> list[RunNode]:
        """Every run with its fork point and forks, depth first (root runs by name)."""
        return history_engine.run_nodes(history_sql.run_tree(self._ctx.catalog), _utc)

    def best(self, run: str, metric: str, mode: str = "min") -> Version:
        """The visible version of ``run`` with the lowest (``mode="min"``) or highest
        (``"max"``) value of ``metric``; ties go to the latest step.

        Raises:
            RefNotFoundError: no such run.
            MetricNotFoundError: no version of ``run`` records ``metric``.
            InvalidArgumentError: ``mode`` is not "min" or "max".
        """
        check_name(run, "run")
        return history_engine.best(self._ctx.catalog, run, metric, mode)

    # -- helpers ------------------------------------------------------------

    def _row(self, ref: Ref) -> VersionRow:
        return resolve(self._ctx.catalog, ref.id if isinstance(ref, Version) else ref)

    def _manifest(self, ref: Ref) -> Manifest:
        return load_manifest(self._ctx.catalog, self._row(ref))

    def _version(self, row: VersionRow) -> Version:
        return version_of(row, self._ctx.catalog.tags_of([row.id]).get(row.id, ()))


def _tensor_sizes(manifest: Manifest) -> list[tuple[str, int]]:
    """``(path, logical bytes)`` of every tensor (a sharded one once, whole; a rank's own
    tensors under ``rankN/``), as show's rows count them."""
    sizes: dict[str, int] = {}
    for t in manifest.tensors:
        path = rank_path(t.rank, t.path) if t.rank is not None and not t.is_shard else t.path
        sizes[path] = sizes.get(path, 0) + t.numel * element_size(t.kind, t.dtype)
    return list(sizes.items())

