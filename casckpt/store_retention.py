"""Retention and reclaiming space: policies, plans, soft deletes, garbage collection.

:class:`StoreRetention` is the part of :class:`casckpt.store.Store` that decides which
versions a store keeps and reclaims the rest; ``Store`` delegates to it and documents each
method. It works on the :class:`~casckpt.store_core.StoreCore` it is given.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from casckpt.catalog import MissingChunksError
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.treemigrate import tree_root
from casckpt.engine import gc as gc_engine
from casckpt.engine import records, trees
from casckpt.engine import retention as retention_engine
from casckpt.engine.refs import check_run, run_not_found
from casckpt.engine.validate import check_name
from casckpt.errors import InvalidArgumentError, RefNotFoundError, VersionSweptError
from casckpt.format import keys
from casckpt.retention_rules import make_policy, policy_from_json, policy_to_json
from casckpt.store_core import Ref, StoreCore
from casckpt.types import GCReport, GCRun, ProgressCallback, RetentionPlan, RetentionPolicy, Version


class StoreRetention:
    """Which versions a store keeps, and reclaiming the space of the rest.

    Every public method is the ``Store`` method of the same name (documented there);
    thread-safe as the store is.
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def gc(self, *, dry_run: bool = False, grace: float | timedelta | None = None,
           force: bool = False, progress: ProgressCallback | None = None) -> GCReport:
        """Apply every run's retention policy, then reclaim space no version needs."""
        self._core.refuse_while_recovering("gc")
        seconds = grace.total_seconds() if isinstance(grace, timedelta) else grace
        if seconds is None:
            seconds = gc_engine.DEFAULT_GRACE_S
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 <= seconds < float("inf")
        ):
            raise InvalidArgumentError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        return gc_engine.collect(self._core.ctx, grace=float(seconds), dry_run=dry_run, force=force,
                                 progress=progress)


    def gc_history(self, since: float | None) -> list[GCRun]:
        """Every gc run since ``since`` (epoch seconds) with what it committed, killed ones too."""
        return gc_sql.runs_since(self._core.ctx.catalog, since)

    def set_retention(self, run: str, **rules: Any) -> RetentionPolicy:
        """Store the retention policy of ``run`` (replacing any); :meth:`gc` applies it."""
        check_name(run, "run")
        policy = make_policy(**rules)
        retention_sql.store_policy(self._core.ctx.catalog, run, policy_to_json(policy), create=True)
        records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)
        return policy

    def retention(self, run: str) -> RetentionPolicy | None:
        """The retention policy of ``run``; None when it has none (it keeps every version)."""
        stored = retention_sql.run_policies(self._core.ctx.catalog, self.existing_run(run)).get(run)
        return None if stored is None else policy_from_json(stored, run)

    def clear_retention(self, run: str) -> None:
        """Remove the retention policy of ``run``: it keeps every version again. Idempotent."""
        if not retention_sql.store_policy(self._core.ctx.catalog, self.existing_run(run), None, create=False):
            raise run_not_found(self._core.ctx.catalog, run)
        records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)

    def plan_retention(self, run: str | None = None) -> list[RetentionPlan]:
        """What retention would do, writing nothing: a decision per visible version, with reasons."""
        if run is not None:
            self.existing_run(run)
        with self._core.ctx.catalog.read() as conn:
            histories = retention_sql.load_histories(conn, run)
        return [retention_engine.plan(history) for history in histories]

    def delete(self, ref: Ref, reason: str = "manual") -> Version:
        """Soft-delete a version: it leaves refs, log and show at once; GC reclaims its data later."""
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError(f"reason must be a non-empty str, got {reason!r}")
        version = self._core.version(self._core.row(ref))
        retention_sql.delete_version(self._core.ctx.catalog, version.id, reason)
        return version

    def undelete(self, ref: str | Version) -> Version:
        """Make a deleted version visible again, exactly as it was (tags included)."""
        ctx = self._core.ctx
        row = retention_sql.resolve_deleted(ctx.catalog, ref.id if isinstance(ref, Version) else ref)
        label = f"{row.run}@{row.step}"
        if not ctx.locations.exists_anywhere(keys.manifest_key(row.id)):
            raise VersionSweptError(label, "GC already removed its manifest; it cannot be undeleted")
        manifest = trees.migrated(  # a migrated version's nodes are revived with its chunks
            trees.decode(ctx, ctx.catalog, ctx.catalog.manifest(row.id), row.id),
            tree_root(ctx.catalog, row.id), ctx.crypto.chunk_id)
        chunk_ids = [cid.hex() for cid in manifest.chunk_ids()]
        try:
            if not retention_sql.undelete_version(ctx.catalog, row.id, chunk_ids):
                raise RefNotFoundError(label, "it is no longer deleted (undeleted or purged meanwhile)")
        except MissingChunksError as exc:
            raise VersionSweptError(
                label, f"GC already swept {len(exc.missing)} of its chunks; it cannot be undeleted"
            ) from None
        return self._core.version(self._core.row(row.id))

    def existing_run(self, run: str) -> str:
        check_run(self._core.ctx.catalog, check_name(run, "run"))
        return run
