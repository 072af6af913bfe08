"""History and lineage: versions of the log, diff, tensor history, forks, the run lineage.

The log's filters and predicates are checked in :mod:`casckpt.engine.versions.logfilter`.

Served from the catalog only (``casckpt.catalog.history`` holds the SQL);
the one thing read besides catalog rows is the manifest copy the catalog
keeps in ``versions.manifest``, for the plain values ``diff`` compares.

Changed bytes compare two chunk lists position by position: a chunk whose id
differs (or that one side lacks) counts with its size in the newer tensor.
When dtype, shape or chunk size differ, the whole tensor counts. Tensors that
share one storage share a chunk list, so their changed bytes are capped at
each tensor's own size.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from casckpt import collector
from casckpt.catalog import Catalog, rows, tensorchanges
from casckpt.catalog import history as sql
from casckpt.catalog.rows import StoredContent, VersionRow, damaged, versions
from casckpt.engine.read import treeindex, treeviews
from casckpt.engine.versions.refs import bind, check_run, load_manifest, tag_not_found
from casckpt.errors import (
    CatalogError,
    InvalidArgumentError,
    MetricNotFoundError,
    RefNotFoundError,
    TensorNotFoundError,
)
from casckpt.format.chunks import differing_bytes
from casckpt.format.manifest import Manifest
from casckpt.format.state import iter_values
from casckpt.types import (
    RunNode,
    TensorChange,
    TensorHistoryEntry,
    ValueChange,
    Version,
    VersionDiff,
)

# -- runs and tags ------------------------------------------------------------------------


def check_tag(catalog: Catalog, tag: str) -> None:
    """Raise RefNotFoundError (with near names) unless tag ``tag`` exists."""
    if catalog.tag_target(tag) is None:
        raise tag_not_found(catalog, f"tag:{tag}", tag)


# -- diff ---------------------------------------------------------------------------------


def changed_bytes(before: StoredContent | None, after: StoredContent | None, nbytes: int) -> int:
    """Bytes of ``after``'s chunks that differ from ``before``'s at the same position, at most ``nbytes``.

    Without both chunk lists, or with different chunk sizes, all ``nbytes`` count.
    """
    if before is None or after is None or before.chunk_size != after.chunk_size:
        return nbytes
    return min(nbytes, differing_bytes(after.chunk_size, after.nbytes, before.chunk_ids, after.chunk_ids))


def _change(path: str, a: Any, b: Any,
            contents: Mapping[str, StoredContent]) -> TensorChange:
    if a is not None and b is not None:
        same_layout = a.dtype == b.dtype and list(a.shape) == list(b.shape)
        moved = changed_bytes(contents.get(a.digest), contents.get(b.digest), b.nbytes) \
            if same_layout else b.nbytes
        kind = "changed"
    else:
        moved, kind = (b.nbytes, "added") if b is not None else (a.nbytes if a else 0, "removed")
    return TensorChange(
        path, kind, a.dtype if a else None, b.dtype if b else None,
        tuple(a.shape) if a else None, tuple(b.shape) if b else None,
        a.nbytes if a else 0, b.nbytes if b else 0, moved,
    )


def _same(x: object, y: object) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and isinstance(y, float):
        return x.hex() == y.hex() or (math.isnan(x) and math.isnan(y))
    return x == y


def value_changes(before: Mapping[str, object], after: Mapping[str, object]) -> tuple[ValueChange, ...]:
    """Plain values added, removed or changed, by path (floats compare bit for bit, NaN == NaN)."""
    out: list[ValueChange] = []
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            out.append(ValueChange(path, "removed", before[path], None))
        elif path not in before:
            out.append(ValueChange(path, "added", None, after[path]))
        elif not _same(before[path], after[path]):
            out.append(ValueChange(path, "changed", before[path], after[path]))
    return tuple(out)


def _values(catalog: Catalog, row: VersionRow) -> dict[str, object]:
    return dict(iter_values(load_manifest(catalog, row).root))


def diff(catalog: Catalog, a: VersionRow, b: VersionRow) -> VersionDiff:
    """What changed from version ``a`` to version ``b`` (:func:`~casckpt.engine.versions.refs.resolve` rows).

    Two tree versions are compared by walking only the subtrees whose node ids differ;
    otherwise every tensor of each side is compared (rows, or a tree read whole)."""
    heads = treeviews.head(catalog, a.id), treeviews.head(catalog, b.id)
    views = treeviews.Trees(catalog)
    if views.comparable(*heads):
        return _tree_diff(catalog, a, b, bind(a, heads[0]), bind(b, heads[1]))
    old, old_contents = _tensors_of(views, a, heads[0])
    new, new_contents = _tensors_of(views, b, heads[1])
    differ = [p for p in sorted(old.keys() | new.keys())
              if p not in old or p not in new or old[p].digest != new[p].digest]
    both = [p for p in differ if p in old and p in new]
    wanted = [old[p].digest for p in both] + [new[p].digest for p in both]
    found = sql.contents(catalog, [d for d in wanted if d not in old_contents and d not in new_contents])
    contents = {**found, **old_contents, **new_contents}
    changes = [_change(p, old.get(p), new.get(p), contents) for p in differ]
    return _version_diff(catalog, a, b, changes, len(old.keys() & new.keys()) - len(both),
                         value_changes(_values(catalog, a), _values(catalog, b)))


def _version_diff(catalog: Catalog, a: VersionRow, b: VersionRow, changes: Sequence[TensorChange],
                  unchanged: int, values: tuple[ValueChange, ...]) -> VersionDiff:
    va, vb = versions([a, b], catalog.tags_of([a.id, b.id]))
    return VersionDiff(
        a=va, b=vb,
        added=tuple(c for c in changes if c.change == "added"),
        removed=tuple(c for c in changes if c.change == "removed"),
        changed=tuple(c for c in changes if c.change == "changed"),
        unchanged=unchanged, changed_bytes=sum(c.changed_bytes for c in changes), values=values,
    )


def _tensors_of(views: treeviews.Trees, row: VersionRow, head: Manifest
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A version's tensor rows by path, and the contents rows a tree version derives."""
    rows_, contents = views.rows_of(row, head)
    return {r.path: r for r in rows_}, contents


def _tree_diff(catalog: Catalog, a: VersionRow, b: VersionRow, ha: Manifest, hb: Manifest) -> VersionDiff:
    tensors, found, before, after = treeviews.Trees(catalog).differences(ha, hb)
    changes = [_change(p, x, y, found) for p, x, y in tensors]
    both = sum(1 for _, x, y in tensors if x is not None and y is not None)
    removed = sum(1 for _, x, y in tensors if y is None)
    tree_a = ha.tree
    unchanged = (tree_a.tensors if tree_a is not None else 0) - removed - both
    return _version_diff(catalog, a, b, changes, unchanged, value_changes(before, after))


# -- tensor history -----------------------------------------------------------------------


_INDEX_PASSES = 4
"""Times history indexes the versions it finds without usable rows, and looks again (versions
committed or deleted while it indexed are found on the next pass)."""

# positions in a ``sql.tensor_changes`` row, after the version columns (rows are read by
# position and the loop allocates as little as it can: 10,000 entries are a common case)
_ROOT, _DTYPE, _SHAPE, _NBYTES, _DIGEST, _N, _SIZE, _CONTENT_NBYTES, _IDS, _CHANGED = range(
    len(VersionRow._fields), len(VersionRow._fields) + 10)


def _kind(before: Sequence[Any] | None, now: Sequence[Any]) -> str | None:
    had = before is not None and before[_DIGEST] is not None
    if now[_DIGEST] is None:
        return "removed" if had else None
    if not had:
        return "added"
    return "changed" if before is not None and before[_DIGEST] != now[_DIGEST] else None


class _Shapes(dict[str, tuple[int, ...]]):
    """JSON shape text -> tuple, parsed once per distinct text."""

    def __missing__(self, text: str) -> tuple[int, ...]:
        shape = self[text] = tuple(rows.shape(text, "a tensor of the run's history"))
        return shape


def _checked(row: Sequence[Any]) -> Sequence[Any]:
    """``row`` once the values an entry is made of are of their types (the catalog may be damaged)."""
    nbytes, dtype, digest = row[_NBYTES], row[_DTYPE], row[_DIGEST]
    if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0
            and isinstance(dtype, str) and (digest is None or isinstance(digest, str))):
        raise damaged("the row of a tensor of the run's history holds values of the wrong type")
    return row


def _entry(version: Version, change: str, before: Sequence[Any] | None, now: Sequence[Any],
           shapes: _Shapes) -> TensorHistoryEntry:
    if change == "removed":  # ``now`` is the version without the tensor; ``before`` had it
        return TensorHistoryEntry(version, change, None, None, 0, None,
                                  _checked(before)[_NBYTES] if before is not None else 0)
    now = _checked(now)
    shape, nbytes = shapes[now[_SHAPE]], now[_NBYTES]
    moved = nbytes
    if change == "changed" and before is not None:
        if (recorded := now[_CHANGED]) is not None:  # recorded with the row, against this very state
            if not (isinstance(recorded, int) and not isinstance(recorded, bool) and 0 <= recorded <= nbytes):
                raise damaged(f"a tensor row's changed_bytes is {recorded!r}, not a count of its bytes")
            moved = recorded
        else:  # the rule the recorded counts were made with
            same = before[_DTYPE] == now[_DTYPE] and shapes[before[_SHAPE]] == shape
            moved = tensorchanges.changed_bytes(same, before[_SIZE:_IDS + 1], now[_SIZE:_IDS + 1], nbytes)
    return TensorHistoryEntry(version, change, now[_DTYPE], shape, nbytes, now[_DIGEST], moved)


def tensor_history(catalog: Catalog, run: str, path: str) -> list[TensorHistoryEntry]:
    """The versions of ``run``'s lineage in which the tensor at ``path`` changed, oldest first.

    A forked run's history starts in its parent run (up to the fork point).

    Raises:
        RefNotFoundError: no such run.
        TensorNotFoundError: no version of the lineage has a tensor at ``path``.
    """
    segments = sql.lineage(catalog, run)
    if segments is None:
        check_run(catalog, run)
        raise RefNotFoundError(run, "the run disappeared")
    with collector.paused():  # 10,000 entries are common: see casckpt.collector
        return _history(catalog, run, path, segments)


def _history(catalog: Catalog, run: str, path: str,
             segments: Sequence[sql.Segment]) -> list[TensorHistoryEntry]:
    rows, tags, stale = sql.tensor_changes(catalog, segments, path)
    overlay: dict[str, tuple[str | None, Any]] = {}
    for _ in range(_INDEX_PASSES):  # tree versions without rows against the version before them
        if not stale:
            break
        computed = treeindex.index(catalog, stale)
        overlay.update((vid, (base, treeindex.state_of(found, path)))
                       for vid, (base, found) in computed.items())
        rows, tags, stale = sql.tensor_changes(catalog, segments, path, overlay)  # and new ones
    if stale:  # versions committed or deleted faster than they could be indexed
        raise CatalogError(f"the history of run {run!r} changed while it was read; read it again")
    kept: list[Sequence[Any]] = []
    kinds: list[str] = []
    before: list[Sequence[Any] | None] = []
    last: Sequence[Any] | None = None  # the tensor since the previous row (also across segments)
    for row in rows:
        change = _kind(last, row)
        if change is not None:
            kept.append(row)
            kinds.append(change)
            before.append(last)
        last = row
    if not kept:
        raise _tensor_not_found(catalog, run, path)
    shapes = _Shapes()
    return [_entry(v, kinds[i], before[i], kept[i], shapes)
            for i, v in enumerate(versions(kept, tags))]


def _tensor_not_found(catalog: Catalog, run: str, path: str) -> TensorNotFoundError:
    latest = catalog.nth_latest(run, 0)
    paths: list[str] = []
    if latest is not None:
        head = treeviews.head(catalog, latest.id)
        paths = [t.path for t in (_tensors_of(treeviews.Trees(catalog), latest, head)[0].values())]
    near = difflib.get_close_matches(path, paths, n=3)
    suggestion = f" Did you mean: {', '.join(near)}?" if near else ""
    return TensorNotFoundError(
        f"no version of run {run!r} has a tensor at {path!r} (paths are dotted, e.g. "
        f"model.layers.0.weight; `casckpt show {run}@latest` lists them).{suggestion}")


# -- lineage ------------------------------------------------------------------------------


def run_nodes(rows: Sequence[sql.LineageRow], utc: Callable[[float], datetime]) -> list[RunNode]:
    """The run lineage, depth first: each root run (by name), then its forks, recursively."""
    children: dict[str | None, list[str]] = {}
    by_name = {r.name: r for r in rows}
    for r in rows:
        parent = r.parent_run if r.parent_run in by_name and r.parent_run != r.name else None
        children.setdefault(parent, []).append(r.name)
    order: list[str] = []
    stack = sorted(children.get(None, []), reverse=True)
    while stack:
        name = stack.pop()
        if name not in order:
            order.append(name)
            stack += sorted(children.get(name, []), reverse=True)
    order += sorted(n for n in by_name if n not in order)  # only a corrupt catalog has cycles
    return [
        RunNode(name, utc(by_name[name].created_at), by_name[name].parent_run,
                by_name[name].parent_version, by_name[name].fork_step,
                tuple(sorted(children.get(name, []))), int(by_name[name].versions))
        for name in order
    ]


def best(catalog: Catalog, run: str, metric: str, mode: str) -> Version:
    """The version row of ``run`` with the best ``metric`` (``mode`` ``"min"`` or ``"max"``).

    Raises:
        InvalidArgumentError: bad ``metric`` or ``mode``.
        RefNotFoundError: no such run.
        MetricNotFoundError: no visible version of the run records ``metric``.
    """
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"mode must be 'min' or 'max', got {mode!r}")
    if not isinstance(metric, str) or not metric or '"' in metric or "\\" in metric:
        raise InvalidArgumentError(f"metric must be a non-empty str without quotes, got {metric!r}")
    check_run(catalog, run)
    found = sql.best(catalog, run, metric, mode == "max")
    if found is None:
        raise MetricNotFoundError(metric, run, sql.metric_names(catalog, run))
    return found
