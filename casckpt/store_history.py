"""The version history of a :class:`casckpt.Store`: versions, runs, tags, forks, deletes.

:class:`StoreHistory` is the base class of ``Store``: what the catalog answers and changes
without reading or writing tensor data -- the log, one version in detail, diffs, a tensor's
history, the lineage of runs, and the catalog-only changes (tags, forks, soft deletes and
undeletes). :class:`~casckpt.store_write.StoreWrite` (commits) and
:class:`~casckpt.store_read.StoreRead` (restores) build on it, and ``Store`` on those two (copies,
gc and the namespaces); each method is declared once, in one of the four. Thread-safe as the
store is.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from casckpt.catalog import history as history_sql
from casckpt.catalog import retention as retention_sql
from casckpt.engine.versions import records
from casckpt.engine.versions.logfilter import make_filter
from casckpt.engine.versions.refs import check_run
from casckpt.engine.versions.validate import check_limit, check_name
from casckpt.errors import InvalidArgumentError
from casckpt.store_core import Ref, StoreCore, utc
from casckpt.types import RunInfo, RunNode, TagInfo, TensorHistoryEntry, Version, VersionDetail, VersionDiff


class StoreHistory:
    """The version history of a store, kept in its catalog: the base class of :class:`casckpt.Store`."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def resolve(self, ref: Ref) -> Version:
        """The version a ref names.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        return self._core.version(self._core.row(ref))

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
            limit: at most this many versions (after ordering): 0 to 2**63 - 1.
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
        catalog = self._core.catalog
        if run is not None:
            check_run(catalog, check_name(run, "run"))
        query = make_filter(
            run, limit=check_limit(limit), since=since, until=until, min_step=min_step,
            max_step=max_step, tag=check_name(tag, "tag") if tag is not None else None, where=where,
            order=order)
        if tag is not None:
            from casckpt.engine.read import history as history_engine  # loads the manifest format

            history_engine.check_tag(catalog, tag)
        return history_sql.log(catalog, query)

    def show(self, ref: Ref, *, tensors: bool = True) -> VersionDetail:
        """A version with its tensors (in natural order: ``layers.2`` before ``layers.10``),
        plain values (from its manifest), and whether it is degraded now (see
        :class:`~casckpt.types.VersionDetail`).

        ``tensors=False`` leaves the per-tensor list out (``tensors`` is empty) and fills
        only the summary (``tensor_count``, ``tensor_bytes``, ``tensor_groups``): what
        ``casckpt show`` prints by default, without a row per tensor of a 100,000-tensor state.
        """
        from casckpt.engine.read.detail import version_detail  # loads the manifest format

        row = self._core.row(ref)
        return version_detail(self._core, row, self._core.version(row), tensors=tensors)

    def runs(self) -> list[RunInfo]:
        """Every run with a summary of its versions."""
        return [RunInfo(r[0], utc(r[1]), r[2], r[3], r[4], int(r[5])) for r in self._core.catalog.runs()]

    def tags(self, run: str | None = None) -> list[TagInfo]:
        """Every tag with the version it points at, sorted by name (``casckpt tags``).

        Args:
            run: only the tags pointing at this run's versions.

        Only tags of visible versions are listed: a deleted version's tags come back with
        :meth:`undelete`.

        Raises:
            RefNotFoundError: no such run (near names suggested).
        """
        if run is not None:
            check_run(self._core.catalog, check_name(run, "run"))
        return [TagInfo(name, utc(created), version)
                for name, created, version in history_sql.tags(self._core.catalog, run)]

    def diff(self, a: Ref, b: Ref) -> VersionDiff:
        """What changed from version ``a`` to version ``b``: tensors and plain values.

        Tensors are compared by content digest; changed bytes come from
        comparing chunk lists (see :class:`casckpt.types.TensorChange`), so no
        tensor data is read. Plain values come from the manifests the catalog keeps.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        from casckpt.engine.read import history as history_engine  # loads the manifest format

        return history_engine.diff(self._core.catalog, self._core.row(a), self._core.row(b))

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
        from casckpt.engine.read import history as history_engine  # loads the manifest format

        check_name(run, "run")
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"path must be a non-empty str, got {path!r}")
        return history_engine.tensor_history(self._core.catalog, run, path)

    def lineage(self) -> list[RunNode]:
        """Every run with its fork point and forks, depth first (root runs by name)."""
        from casckpt.engine.read import history as history_engine  # loads the manifest format

        return history_engine.run_nodes(history_sql.lineage_rows(self._core.catalog), utc)

    def best(self, run: str, metric: str, mode: str = "min") -> Version:
        """The visible version of ``run`` with the lowest (``mode="min"``) or highest
        (``"max"``) value of ``metric``; ties go to the latest step.

        Raises:
            RefNotFoundError: no such run.
            MetricNotFoundError: no version of ``run`` records ``metric``.
            InvalidArgumentError: ``mode`` is not "min" or "max".
        """
        from casckpt.engine.read import history as history_engine  # loads the manifest format

        check_name(run, "run")
        return history_engine.best(self._core.catalog, run, metric, mode)

    # -- changes to the history ---------------------------------------------

    def tag(self, ref: Ref, name: str) -> Version:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        self._core.refuse_write("tag", "the catalog")
        check_name(name, "tag")
        row = self._core.row(ref)
        self._core.catalog.set_tag(name, row.id)
        records.record_tag(self._core.locations, self._core.catalog, name, row.id)
        return self._core.version(row)

    def fork(self, ref: Ref, run: str) -> RunInfo:
        """Create run ``run`` branching from the version ``ref`` names (fine-tunes, sweeps).

        The first version committed to ``run`` gets that version as its parent;
        ``run`` has no versions until then. Retention keeps fork points.

        Raises:
            InvalidNameError: bad run name.
            RunExistsError: a run named ``run`` exists.
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        self._core.refuse_write("fork", "the catalog")
        check_name(run, "run")
        row = self._core.row(ref)
        created = history_sql.fork(self._core.catalog, run, row.id)
        records.record_run(self._core.locations, self._core.catalog, run)
        return RunInfo(run, utc(created), 0, None, None, 0)

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
        self._core.refuse_write("delete", "the catalog")
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError(f"reason must be a non-empty str, got {reason!r}")
        version = self._core.version(self._core.row(ref))
        retention_sql.delete_version(self._core.catalog, version.id, reason)
        return version

    def undelete(self, ref: str | Version) -> Version:
        """Make a deleted version visible again, exactly as it was (tags included).

        Args:
            ref: the deleted version's id, a unique prefix of it, or ``run@step``.

        Raises:
            RefNotFoundError, AmbiguousRefError: no (single) deleted version matches.
            VersionSweptError: GC already swept some of its data; it is gone.
        """
        self._core.refuse_write("undelete", "the catalog")
        from casckpt.engine.maintenance.undelete import undelete

        return self._core.version(self._core.row(undelete(self._core.ctx, ref)))
