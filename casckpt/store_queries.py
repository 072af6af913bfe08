"""Queries of a store: versions, runs, tags, tensor history and lineage.

:class:`StoreQueries` is the part of :class:`casckpt.store.Store` that reads the catalog
(and manifests) to answer questions, writing only tags and forks; ``Store`` delegates to
it and documents each method. It works on the :class:`~casckpt.store_core.StoreCore` it
is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog import history as history_sql
from casckpt.catalog.rows import VersionRow
from casckpt.catalog.treemigrate import tree_root
from casckpt.engine import degraded, records, trees, treeviews
from casckpt.engine import history as history_engine
from casckpt.engine.logfilter import make_filter, time_bound
from casckpt.engine.refs import bind, check_run, load_manifest
from casckpt.engine.validate import check_limit, check_name
from casckpt.errors import InvalidArgumentError
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, TreeHead, decode_manifest, sharding
from casckpt.format.tree import iter_values, rank_path
from casckpt.format.treemanifest import head_values
from casckpt.store_core import Ref, StoreCore, utc
from casckpt.types import (
    AuditEntry,
    RunInfo,
    RunNode,
    TagInfo,
    TensorHistoryEntry,
    TensorInfo,
    Version,
    VersionDetail,
    VersionDiff,
    group_tensors,
    natural_key,
    sorted_groups,
)


class StoreQueries:
    """What a store holds: versions, runs, tags, diffs, tensor history, lineage.

    Every public method is the ``Store`` method of the same name (documented there);
    thread-safe as the store is.
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def resolve(self, ref: Ref) -> Version:
        """The version a ref names."""
        return self._core.version(self._core.row(ref))


    def log(
        self, run: str | None = None, *, limit: int | None = None,
        since: datetime | float | None = None, until: datetime | float | None = None,
        min_step: int | None = None, max_step: int | None = None, tag: str | None = None,
        where: str | Iterable[str] | None = None, order: str = "desc",
    ) -> list[Version]:
        """Versions of ``run`` (all runs if None) that pass every filter given, newest first."""
        if run is not None:
            check_run(self._core.ctx.catalog, check_name(run, "run"))
        limit = check_limit(limit)
        query = make_filter(
            run, limit=limit, since=since, until=until, min_step=min_step, max_step=max_step,
            tag=check_name(tag, "tag") if tag is not None else None, where=where, order=order,
        )
        if tag is not None:
            history_engine.check_tag(self._core.ctx.catalog, tag)
        return history_sql.log(self._core.ctx.catalog, query)


    def audit(self, *, since: datetime | float | None = None, until: datetime | float | None = None,
              action: str | None = None, target: str | None = None,
              limit: int | None = None) -> list[AuditEntry]:
        """The audit trail's rows that pass every filter given, oldest first."""
        limit = check_limit(limit)
        for name, value in (("action", action), ("target", target)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"{name} must be a non-empty str, got {value!r}")
        return self._core.ctx.catalog.audit_entries(
            since=time_bound(since, "since", upper=False), until=time_bound(until, "until", upper=True),
            action=action, target=target, limit=limit)

    def show(self, ref: Ref, *, tensors: bool = True) -> VersionDetail:
        """A version with its tensors (in natural order: ``layers.2`` before ``layers.10``),
        plain values (from its manifest), and whether it is degraded now (see
        :class:`~casckpt.types.VersionDetail`)."""
        row = self._core.row(ref)
        catalog = self._core.ctx.catalog
        manifest = bind(row, decode_manifest(catalog.manifest(row.id), row.id))  # a tree's head
        if manifest.tree is not None:
            quick = None if tensors else self._summary(row, manifest.tree)
            if quick is not None:
                return quick
            manifest = load_manifest(self._core.ctx.catalog, row)
        else:  # a version of format 1 migrated to a tree reads as one (its tensor rows are gone)
            manifest = trees.adopted(manifest, tree_root(self._core.ctx.catalog, row.id))
        pieces = sharding(manifest)
        if tensors:
            found = self._core.ctx.catalog.tensors_of(row.id) if manifest.tree is None else \
                treeviews.Trees(self._core.ctx.catalog).tensor_rows(manifest)[0]
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
        delta_chunks, longest = deltas_sql.version_deltas(self._core.ctx.catalog, ids)
        below = degraded.of_chunks(self._core.ctx, ids)
        return VersionDetail(self._core.version(row), listed, dict(iter_values(manifest.root)),
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
                deltas_sql.any_deltas(self._core.ctx.catalog) or degraded.anywhere(self._core.ctx):
            return None
        return VersionDetail(self._core.version(row), (), values, None, None, 0, 0, degraded=False,
                             tensor_count=tree.tensors, tensor_bytes=tree.nbytes,
                             tensor_groups=sorted_groups(tree.groups))


    def runs(self) -> list[RunInfo]:
        """Every run with a summary of its versions."""
        return [
            RunInfo(r[0], utc(r[1]), r[2], r[3], r[4], int(r[5])) for r in self._core.ctx.catalog.runs()
        ]

    def tags(self, run: str | None) -> list[TagInfo]:
        """Every tag with the version it points at, by name; of ``run``'s versions only, when given."""
        if run is not None:
            check_run(self._core.ctx.catalog, check_name(run, "run"))
        return [TagInfo(name, utc(created), version)
                for name, created, version in history_sql.tags(self._core.ctx.catalog, run)]

    def tag(self, ref: Ref, name: str) -> Version:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        check_name(name, "tag")
        row = self._core.row(ref)
        self._core.ctx.catalog.set_tag(name, row.id)
        records.record_tag(self._core.ctx.locations, self._core.ctx.catalog, name, row.id)
        return self._core.version(row)


    # -- history and lineage ------------------------------------------------

    def diff(self, a: Ref, b: Ref) -> VersionDiff:
        """What changed from version ``a`` to version ``b``: tensors and plain values."""
        return history_engine.diff(self._core.ctx.catalog, self._core.row(a), self._core.row(b))

    def history(self, run: str, path: str) -> list[TensorHistoryEntry]:
        """The versions of ``run`` in which the tensor at ``path`` changed, by step."""
        check_name(run, "run")
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"path must be a non-empty str, got {path!r}")
        return history_engine.tensor_history(self._core.ctx.catalog, run, path)

    def fork(self, ref: Ref, run: str) -> RunInfo:
        """Create run ``run`` branching from the version ``ref`` names (fine-tunes, sweeps)."""
        check_name(run, "run")
        row = self._core.row(ref)
        created = history_sql.fork(self._core.ctx.catalog, run, row.id)
        records.record_run(self._core.ctx.locations, self._core.ctx.catalog, run)
        return RunInfo(run, utc(created), 0, None, None, 0)

    def tree(self) -> list[RunNode]:
        """Every run with its fork point and forks, depth first (root runs by name)."""
        return history_engine.run_nodes(history_sql.run_tree(self._core.ctx.catalog), utc)

    def best(self, run: str, metric: str, mode: str = "min") -> Version:
        """The visible version of ``run`` with the lowest (``mode="min"``) or highest
        (``"max"``) value of ``metric``; ties go to the latest step."""
        check_name(run, "run")
        return history_engine.best(self._core.ctx.catalog, run, metric, mode)


def _tensor_sizes(manifest: Manifest) -> list[tuple[str, int]]:
    """``(path, logical bytes)`` of every tensor (a sharded one once, whole; a rank's own
    tensors under ``rankN/``), as show's rows count them."""
    sizes: dict[str, int] = {}
    for t in manifest.tensors:
        path = rank_path(t.rank, t.path) if t.rank is not None and not t.is_shard else t.path
        sizes[path] = sizes.get(path, 0) + t.numel * element_size(t.kind, t.dtype)
    return list(sizes.items())

