"""Tensor history of tree versions from ``tree_changes`` (migration 0015) against a reference.

The reference compares consecutive visible versions of the lineage through ``Store.diff``
(trees, not the index). Random runs: tensors added, removed, changed in value, dtype or
shape, or left alone; forks; deletions; a handle reopened mid-run (its first commit has no
memo of its parent, so it records no rows and history indexes it from the trees).
"""

from __future__ import annotations

import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

import casckpt
from casckpt.catalog import schema as s
from casckpt.errors import TensorNotFoundError
from casckpt.testing.internals import internals

PATHS = ("m.a", "m.b", "m.c", "opt.d")
CHUNK = 4096


def _lineage(store: casckpt.Store, run: str) -> list[casckpt.Version]:
    node = {n.name: n for n in store.lineage()}[run]
    own = sorted(store.log(run), key=lambda v: v.step)
    if node.parent_run is None or node.fork_step is None:
        return own
    return [v for v in _lineage(store, node.parent_run) if v.step <= node.fork_step] + own


def _reference(store: casckpt.Store, run: str, path: str) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    previous: casckpt.Version | None = None
    for version in _lineage(store, run):
        if previous is None:
            for t in store.show(version.id, tensors=True).tensors:
                if t.path == path:
                    out.append((version.id, "added", t.nbytes, t.nbytes))
        else:
            d = store.diff(previous.id, version.id)
            for c in (*d.added, *d.removed, *d.changed):
                if c.path == path:
                    out.append((version.id, c.change, c.nbytes_after, c.changed_bytes))
        previous = version
    return out


def _history(store: casckpt.Store, run: str, path: str) -> list[tuple[Any, ...]]:
    try:
        entries = store.history(run, path)
    except TensorNotFoundError:
        return []
    for e in entries[:4]:  # each entry's digest is the version's (as show reads it from its tree)
        shown = {t.path: t.digest for t in store.show(e.version.id, tensors=True).tensors}
        assert e.digest == shown.get(path), (e.version.id, path)
    return [(e.version.id, e.change, e.nbytes, e.changed_bytes) for e in entries]


def _tensor(kind: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == 0:
        return torch.rand(2048, generator=g)  # two chunks
    if kind == 1:
        return torch.rand(16, generator=g).double()  # packed with the other small ones
    return torch.rand(4, 8, generator=g)


_OPS = st.lists(st.tuples(st.sampled_from(["commit", "commit", "commit", "fork", "delete", "reopen"]),
                          st.lists(st.tuples(st.sampled_from(PATHS),
                                             st.sampled_from(["same", "value", "kind", "drop", "part"]),
                                             st.integers(0, 2)), max_size=3),
                          st.integers(0, 1000)), min_size=3, max_size=12)


def _apply(state: dict[str, torch.Tensor], changes: list[tuple[str, str, int]], seed: int) -> None:
    for n, (path, how, kind) in enumerate(changes):
        if how == "drop":
            state.pop(path, None)
        elif how == "part" and path in state and state[path].numel() == 2048:
            t = state[path].clone()
            t[0] = float(seed)  # one chunk of two changes
            state[path] = t
        elif how != "same" or path not in state:
            state[path] = _tensor(kind, seed * 10 + n)


def _nested(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, t in state.items():
        head, leaf = path.split(".")
        out.setdefault(head, {})[leaf] = t
    return out


def _play(root: Path, ops: list[Any]) -> casckpt.Store:
    store = casckpt.open(root, chunk_size=CHUNK)
    states: dict[str, dict[str, torch.Tensor]] = {"main": {p: _tensor(0, i) for i, p in enumerate(PATHS[:2])}}
    steps = {"main": 0}
    store.commit(_nested(states["main"]), run="main", step=0)
    for op, changes, seed in ops:
        if op == "fork" and "ft" not in states:
            store.fork("main@latest", "ft")
            states["ft"], steps["ft"] = dict(states["main"]), steps["main"]
        elif op == "delete":
            versions = [v for v in store.log() if v.step != steps["main"] or v.run != "main"]
            fork = {n.fork_version for n in store.lineage()}
            victims = [v for v in versions if v.id not in fork and v.step not in (0, steps.get(v.run))]
            if victims:
                store.delete(victims[seed % len(victims)].id)
        elif op == "reopen":
            store.close()
            store = casckpt.open(root, chunk_size=CHUNK)
        else:
            run = "ft" if "ft" in states and seed % 2 else "main"
            _apply(states[run], changes, seed)
            steps[run] += 1
            store.commit(_nested(states[run]), run=run, step=steps[run])
    return store


def _count(root: Path, table: str) -> int:
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def _rows(store: casckpt.Store, table: str) -> int:
    """Rows of a catalog table, through the store's own catalog (SQLite or PostgreSQL)."""
    with internals(store).catalog.read() as conn:
        return int(conn.execute(select(func.count()).select_from(getattr(s, table))).scalar_one())


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("pg_url") if request.param == "postgres" else None


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(ops=_OPS)
@example(ops=[  # CI found it: a fork's first version reused m.b, the next one removed it
    ("commit", [], 111), ("commit", [], 106),
    ("commit", [("m.a", "drop", 2), ("m.c", "same", 1), ("m.c", "same", 0)], 301),
    ("commit", [("m.a", "drop", 2), ("m.c", "same", 2), ("m.c", "same", 0)], 301),
    ("delete", [], 587), ("reopen", [], 294), ("delete", [], 484),
    ("fork", [("m.b", "drop", 2), ("m.c", "drop", 0), ("opt.d", "part", 2)], 15),
    ("fork", [("m.a", "value", 0), ("m.a", "drop", 0), ("m.c", "same", 1)], 215),
    ("commit", [("m.b", "kind", 1), ("m.b", "drop", 0), ("m.a", "value", 2)], 577),
    ("commit", [("m.b", "value", 2)], 33), ("commit", [("m.a", "drop", 0)], 237)])
def test_history_from_the_index_matches_consecutive_diffs(ops: list[Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="treehist-") as tmp:
        root = Path(tmp) / "store"
        store = _play(root, ops)
        try:
            runs = [r.name for r in store.runs()]
            for run in runs:
                for path in PATHS:
                    assert _history(store, run, path) == _reference(store, run, path), (run, path)
            # every visible version answered from rows now (recorded by commit or by history)
            with closing(sqlite3.connect(root / "catalog.db")) as db:
                unindexed = db.execute(
                    "SELECT COUNT(*) FROM versions v WHERE state = 'visible' AND NOT EXISTS "
                    "(SELECT 1 FROM tree_indexed i WHERE i.version_id = v.id)").fetchone()[0]
            assert unindexed == 0
        finally:
            store.close()


def test_a_removal_after_a_forks_unchanged_first_version_is_listed(tmp_path: Path,
                                                                   catalog: str | None) -> None:
    """A fork's first version reuses the tensor (no row), the next removes it, the one after
    brings it back: history lists the removal and the return as an addition (the tensor's
    state carries from the fork point into the fork's rows, not reset to "absent")."""
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK, catalog=catalog) as store:
        state = {p: _tensor(0, i) for i, p in enumerate(PATHS[:2])}
        store.commit(_nested(state), run="main", step=0)
        store.fork("main@latest", "ft")
        store.commit(_nested(state), run="ft", step=1)
        _apply(state, [("m.b", "drop", 0)], 1)
        store.commit(_nested(state), run="ft", step=2)
        _apply(state, [("m.b", "value", 2)], 2)
        store.commit(_nested(state), run="ft", step=3)
        assert [e[1] for e in _history(store, "ft", "m.b")] == ["added", "removed", "added"]
        assert _history(store, "ft", "m.b") == _reference(store, "ft", "m.b")


def test_commit_records_rows_and_history_reads_no_tree(tmp_path: Path, catalog: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits of one process record every version's rows; history then answers without
    reading any tree (the walk of every version's root node is what took 5 s at 10,000)."""
    from casckpt.engine.read import treeindex

    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK, catalog=catalog) as store:
        state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
        for step in range(12):
            _apply(state, [("m.a", "part", 0)] + ([("opt.d", "drop", 0)] if step == 6 else []), step)
            store.commit(_nested(state), run="r", step=step)
        assert _rows(store, "tree_indexed") == 12

        def no_trees(*_: Any) -> Any:
            raise AssertionError("history read a tree")

        monkeypatch.setattr(treeindex, "rows_against", no_trees)
        for path in PATHS:
            assert _history(store, "r", path) == _reference(store, "r", path)
        kinds = [e[1] for e in _history(store, "r", "opt.d")]
        assert kinds == ["added", "removed"]
        assert [e[3] for e in _history(store, "r", "m.a")][1:] == [CHUNK] * 11


def _unindex(root: Path) -> None:
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        db.execute("DELETE FROM tree_changes")
        db.execute("DELETE FROM tree_indexed")
        db.commit()


def test_migrate_trees_backfills_versions_committed_without_rows(tmp_path: Path) -> None:
    """Versions committed before migration 0015 (rows deleted here) are indexed by
    ``migrate-trees``; a read-only handle answers the same without recording anything."""
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK) as store:
        state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
        for step in range(8):
            _apply(state, [("m.b", "value", step % 3), ("m.c", "kind" if step == 4 else "part", 2)], step)
            store.commit(_nested(state), run="r", step=step)
        store.fork("r@5", "f")
        for step in range(6, 9):
            _apply(state, [("m.a", "value", 0)], step + 50)
            store.commit(_nested(state), run="f", step=step)
        expected = {(run, p): _reference(store, run, p) for run in ("r", "f") for p in PATHS}
    _unindex(root)
    with casckpt.open(root, read_only=True) as reader:
        for (run, path), want in expected.items():
            assert _history(reader, run, path) == want
    assert _count(root, "tree_indexed") == 0
    with casckpt.open(root) as store:
        report = store.ops.migrate_trees()
        assert report.versions_indexed == 11
        assert store.ops.migrate_trees().versions_indexed == 0
    assert _count(root, "tree_indexed") == 11
    with casckpt.open(root, read_only=True) as reader:
        for (run, path), want in expected.items():
            assert _history(reader, run, path) == want


def test_purged_versions_take_their_rows(tmp_path: Path, catalog: str | None) -> None:
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK, catalog=catalog) as store:
        state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
        for step in range(6):
            _apply(state, [("m.a", "value", 0)], step)
            store.commit(_nested(state), run="r", step=step)
        store.delete("r@2")
        store.delete("r@3")
        store.gc(grace=0)
        assert _rows(store, "versions") == 4
        with internals(store).catalog.read() as conn:
            orphans = conn.exec_driver_sql(
                "SELECT COUNT(*) FROM tree_changes c WHERE NOT EXISTS (SELECT 1 FROM tree_indexed i "
                "WHERE i.key = c.version_key)").scalar_one()
            dangling = conn.exec_driver_sql(
                "SELECT COUNT(*) FROM tree_indexed i WHERE NOT EXISTS (SELECT 1 FROM versions v "
                "WHERE v.id = i.version_id)").scalar_one()
        assert (orphans, dangling) == (0, 0)
        for path in PATHS:
            assert _history(store, "r", path) == _reference(store, "r", path)


def test_rows_of_an_encrypted_store_hold_keyed_digests(tmp_path: Path) -> None:
    """The catalog holds paths in the clear (docs/SECURITY.md); a tensor's digest in
    ``tree_changes`` is keyed like its chunk ids: not the digest of the same bytes in a
    plain store, so it does not let anyone test for a tensor."""
    key = tmp_path / "key"
    casckpt.generate_key_file(key)
    digests = []
    for name, kw in (("plain", {}), ("sealed", {"key_file": key})):
        root = tmp_path / name
        with casckpt.open(root, chunk_size=CHUNK, **kw) as store:
            state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
            store.commit(_nested(state), run="r", step=0)
            _apply(state, [("m.a", "value", 0)], 1)
            store.commit(_nested(state), run="r", step=1)
            entries = store.history("r", "m.a")
            assert [e.change for e in entries] == ["added", "changed"]
        with closing(sqlite3.connect(root / "catalog.db")) as db:
            digests.append({bytes(d).hex() for (d,) in db.execute(
                "SELECT digest FROM tree_changes WHERE digest IS NOT NULL")})
        assert entries[-1].digest in digests[-1]
    assert digests[0] and digests[1] and not digests[0] & digests[1]


def test_a_rebuilt_catalog_indexes_every_tree_version(tmp_path: Path) -> None:
    """The rebuild restores versions without rows (no encoder ran); it records them from the
    trees it restored, so history answers from rows at once, and answers the same."""
    blobs = tmp_path / "blobs"
    with casckpt.open(tmp_path / "store", blobs=str(blobs), chunk_size=CHUNK) as store:
        state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
        for step in range(6):
            _apply(state, [("m.a", "part", 0), ("m.b", "drop" if step == 3 else "same", 0)], step)
            store.commit(_nested(state), run="r", step=step)
        expected = {p: _reference(store, "r", p) for p in PATHS}
    with casckpt.open(tmp_path / "store2", blobs=str(blobs), recover=True, chunk_size=CHUNK) as store:
        assert store.ops.rebuild_catalog().versions == 6
        assert _rows(store, "tree_indexed") == 6
        for path in PATHS:
            assert _history(store, "r", path) == expected[path]


def test_history_calls_indexing_the_same_versions_at_once_all_answer(tmp_path: Path,
                                                                     catalog: str | None) -> None:
    # versions a reopened handle committed first have no rows; several handles' history calls
    # index them at once, and only one can record them (a unique key): the others still answer
    import threading

    root = tmp_path / "s"
    store = casckpt.open(root, chunk_size=CHUNK, catalog=catalog)
    state = {p: _tensor(0, i) for i, p in enumerate(PATHS)}
    for step in range(8):
        _apply(state, [(PATHS[step % 4], "value", step % 3)], step)
        store.commit(_nested(state), run="r", step=step)
        if step % 2 == 0:
            store.close()
            store = casckpt.open(root, chunk_size=CHUNK, catalog=catalog)
    expected = _reference(store, "r", "m.a")
    store.close()
    answers: list[Any] = []

    def ask() -> None:
        try:
            with casckpt.open(root, catalog=catalog) as handle:
                answers.append(_history(handle, "r", "m.a"))
        except Exception as exc:  # noqa: BLE001 - reported below
            answers.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [expected] * 4
