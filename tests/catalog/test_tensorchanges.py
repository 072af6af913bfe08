"""``tensors.changed_bytes``: recorded by migration 0014 and by catalog rebuilds, exact, and
used by tensor history only where it is: every history equals the one computed from chunk
lists alone (the column cleared), also after deletes, purges and rebuilds, on SQLite and on
PostgreSQL.

The stores are the golden format-1 store ``tree-migration`` (``r@0..3``; ``f`` forked at
``r@1`` with ``f@7, f@8``; a tensor changed by each step, a tied pair, delta-coded weights).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, select, update

import casckpt
from casckpt.catalog import Catalog, tensorchanges
from casckpt.catalog import history as history_sql
from casckpt.catalog import schema as s
from casckpt.errors import CatalogError

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
from make_legacy import OPTIONS, legacy  # noqa: E402

NAME = "tree-migration"
OPTS = OPTIONS[NAME]

# the upgraded SQLite catalog (migration 0014 fills the column) and catalogs rebuilt from the
# objects (each version's rows written with the column, by Catalog.add_version)
pytestmark = pytest.mark.real_migrations


def _open(tmp_path: Path, how: str, request: pytest.FixtureRequest) -> casckpt.Store:
    root = tmp_path / "store"
    if how == "upgraded":
        legacy(NAME, root)
        return casckpt.open(root, create=False, **OPTS)
    url = f"sqlite:///{tmp_path / 'rebuilt.db'}" if how == "rebuilt" else request.getfixturevalue("pg_url")
    legacy(NAME, root, catalog=url)
    return casckpt.open(root, catalog=url, blobs=str(tmp_path / "store-objects"), create=False, **OPTS)


def _catalog(store: casckpt.Store) -> Catalog:
    return store._core.ctx.catalog


def _recorded(store: casckpt.Store) -> dict[tuple[str, str], int | None]:
    t = s.tensors.c
    with _catalog(store).read() as conn:
        return {(r[0], r[1]): r[2] for r in conn.execute(select(t.version_id, t.path, t.changed_bytes))}


def _clear(store: casckpt.Store) -> None:
    with _catalog(store).write() as conn:
        conn.execute(update(s.tensors).values(changed_bytes=None))


def _histories(store: casckpt.Store) -> dict[tuple[str, str], list[tuple[Any, ...]]]:
    paths = {t.path for ref in ("r@0", "r@3", "f@8") for t in store.show(ref, tensors=True).tensors}
    out = {}
    for run in ("r", "f"):
        for path in sorted(paths):
            try:
                entries = store.history(run, path)
            except casckpt.TensorNotFoundError:
                continue
            out[run, path] = [(e.version.id, e.change, e.dtype, e.shape, e.nbytes, e.digest,
                               e.changed_bytes) for e in entries]
    return out


def _write(store: casckpt.Store, values: dict[tuple[str, str], int | None]) -> None:
    t = s.tensors
    statement = (update(t).where(t.c.version_id == bindparam("v"), t.c.path == bindparam("p"))
                 .values(changed_bytes=bindparam("n")))
    with _catalog(store).write() as conn:
        conn.execute(statement, [{"v": v, "p": p, "n": n} for (v, p), n in values.items()])


def _refilled(store: casckpt.Store) -> dict[tuple[str, str], int | None]:
    _clear(store)
    with _catalog(store).write() as conn:
        tensorchanges.fill(conn)
    return _recorded(store)


def _exact(store: casckpt.Store) -> dict[tuple[str, str], list[tuple[Any, ...]]]:
    """The histories, once shown equal to those computed with the column cleared. The column
    then holds what it held again (a count against a parent since purged stays, as it would)."""
    recorded, histories = _recorded(store), _histories(store)
    _clear(store)
    assert _histories(store) == histories
    refilled = _refilled(store)
    assert all(refilled[k] in (None, n) for k, n in recorded.items())  # None: its parent is gone
    _write(store, recorded)
    return histories


@pytest.mark.parametrize("how", ["upgraded", "rebuilt", "postgres"])
def test_recorded_changes_are_exact_and_history_is_unchanged(tmp_path: Path, how: str,
                                                             request: pytest.FixtureRequest,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with _open(tmp_path, how, request) as store:
        recorded = _recorded(store)
        known = {k: v for k, v in recorded.items() if v is not None}
        # every row but those of the runs' first versions has a parent with a row at its path
        first = {store.resolve("r@0").id}
        assert {k for k in recorded if k[0] not in first} == set(known)
        assert any(v > 0 for v in known.values()) and any(v == 0 for v in known.values())
        histories = _exact(store)
        changed = [e for entries in histories.values() for e in entries if e[1] == "changed"]
        assert len(changed) >= 8
        assert _refilled(store) == recorded  # the writer of each version's rows and fill() agree
        monkeypatch.setattr(history_sql, "BATCH", 2)  # the plan of a tensor with many contents
        assert _histories(store) == histories
        assert store.ops.check().ok


@pytest.mark.parametrize("how", ["upgraded", "postgres"])
def test_history_stays_exact_after_deletes_purges_and_undeletes(tmp_path: Path, how: str,
                                                                request: pytest.FixtureRequest) -> None:
    """A deleted version leaves its children's recorded counts against a state history no longer
    shows: history compares chunk lists there, before and after the version is purged."""
    with _open(tmp_path, how, request) as store:
        before = _exact(store)
        store.delete("r@2")
        store.delete("r@1")  # the fork point of f
        deleted = _exact(store)
        assert deleted != before
        store.undelete("r@1")
        _exact(store)
        report = store.gc(grace=0)
        assert report.versions_purged == 1
        assert _exact(store) != before
        assert store.ops.check().ok


def test_fill_is_idempotent_and_limited_to_the_versions_named(tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    with _open(tmp_path, "upgraded", request) as store:
        recorded = _recorded(store)
        _clear(store)
        child = store.resolve("r@3").id
        with _catalog(store).write() as conn:
            written = tensorchanges.fill(conn, [child])
            assert written == sum(1 for k in recorded if k[0] == child)
            assert tensorchanges.fill(conn, [child]) == 0
        assert _recorded(store) == {k: v if k[0] == child else None for k, v in recorded.items()}


@pytest.mark.parametrize("whole_listing", [False, True])
def test_history_uses_a_recorded_count_only_against_the_parent_state(
        tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        whole_listing: bool) -> None:
    """Every recorded count overwritten with 7: history shows 7 where the state before the
    entry is the version's parent's, and the count from chunk lists where it is not (both
    plans: versions by key, and each segment's whole listing)."""
    if whole_listing:
        monkeypatch.setattr(history_sql, "BATCH", 2)
    with _open(tmp_path, "upgraded", request) as store:
        store.delete("r@2")  # r@3's parent: r@3 follows r@1 in the history of r
        truth = _exact(store)
        _write(store, {k: 7 for k, n in _recorded(store).items() if n is not None})
        seen = _histories(store)
        r3 = store.resolve("r@3").id

        def at(key: tuple[str, str], version: str, histories: dict[Any, Any]) -> Any:
            return next(e[6] for e in histories[key] if e[0] == version and e[1] == "changed")

        # model.w changed at r@1, r@2 and r@3: r@2's state is not r@1's
        assert at(("r", "model.w"), r3, seen) == at(("r", "model.w"), r3, truth) == 12000
        # l3.w changed at r@3 only: r@2's l3.w is r@1's, so the count against r@2 holds
        assert at(("r", "model.layers.l3.w"), r3, seen) == 7
        assert at(("r", "model.layers.l3.w"), r3, truth) == 8000
        f7 = store.resolve("f@7").id
        assert at(("f", "model.w"), f7, seen) == 7  # its parent r@1 is the state before it


def test_a_damaged_recorded_count_is_a_typed_error(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with _open(tmp_path, "upgraded", request) as store:
        _write(store, {k: 1 << 40 for k, n in _recorded(store).items() if n is not None})
        with pytest.raises(CatalogError, match="changed_bytes .* `casckpt check`"):
            store.history("r", "model.w")
