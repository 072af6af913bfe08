"""Migrating a store of the previous release (manifest format 1, a ``tensors`` row per tensor)
to trees: ids and restores stay bit-exact, queries answer the same from the trees, the rows
go, and the migration is resumable and safe alongside gc."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from alembic import command
from doubles import ForkedPython
from sqlalchemy import create_engine, text

import casckpt
from casckpt.catalog.migrate import _config
from casckpt.engine.maintenance import treemigrate
from casckpt.format.manifest import decode_manifest
from casckpt.format.state import iter_leaves
from casckpt.format.treemanifest import with_tree
from casckpt.testing.internals import internals

BACKENDS = ["sqlite", "postgres"]
sys.path.insert(0, str(Path(__file__).parents[2] / "golden"))
from make_legacy import TREE_REFS, large_state, legacy  # noqa: E402
from make_legacy import tree_state as _state  # noqa: E402


def _url(root: Path, catalog: str | None) -> str:
    return catalog or f"sqlite:///{root / 'catalog.db'}"


def _sql(url: str, query: str) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(query)).all()
    finally:
        engine.dispose()


def _count(url: str, table: str) -> int:
    return int(_sql(url, f"SELECT COUNT(*) FROM {table}")[0][0])


def _old_store(root: Path, catalog: str | None) -> list[str]:
    """A store as the previous release left it (the golden ``tree-migration``): format 1
    versions in two runs (one a fork), a tag, delta-coded chunks, on the schema before tree
    manifests (0006). Returns the refs of its versions."""
    legacy("tree-migration", root, catalog=catalog)
    engine = create_engine(_url(root, catalog))
    try:
        with engine.connect() as conn:
            command.downgrade(_config(conn), "0006")
            conn.commit()
    finally:
        engine.dispose()
    return list(TREE_REFS)


def _equal(a: object, b: object) -> bool:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    return la.keys() == lb.keys() and all(
        torch.equal(x, lb[k]) and x.dtype == lb[k].dtype if isinstance(x, torch.Tensor) else x == lb[k]
        for k, x in la.items())


def _answers(store: casckpt.Store, refs: list[str]) -> dict[str, Any]:
    """What queries say about every version (compared before and after migrating)."""
    out: dict[str, Any] = {}
    for ref in refs:
        shown = store.show(ref)
        out[f"show {ref}"] = (shown.tensors, shown.values, shown.tensor_count, shown.tensor_bytes)
        out[f"load {ref}"] = [store.load_tensor(ref, p)
                              for p in ("model.emb", "model.head", "model.layers.l1.w", "model.w")]
    for a, b in (("r@0", "r@1"), ("r@1", "r@3"), ("r@1", "f@7"), ("r@3", "f@8")):
        d = store.diff(a, b)
        out[f"diff {a} {b}"] = (d.added, d.removed, d.changed, d.unchanged, d.changed_bytes)
    for run in ("r", "f"):
        for path in ("model.layers.l1.w", "model.layers.l2.w", "model.w", "model.head"):
            out[f"history {run} {path}"] = [(e.version.id, e.change, e.digest)
                                            for e in store.history(run, path)]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if key.startswith("load"):
            assert all(torch.equal(x, y) for x, y in zip(value, b[key], strict=True)), key
        else:
            assert value == b[key], key


def _nodes_of(store: casckpt.Store, ref: str) -> set[str]:
    catalog = internals(store).catalog
    row = casckpt.engine.versions.refs.resolve(catalog, ref)
    return {n.hex() for n in with_tree(decode_manifest(catalog.manifest(row.id), row.id))[1].nodes}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_of_the_previous_release_migrates_and_answers_the_same(
        tmp_path: Path, backend: str,
        request: pytest.FixtureRequest) -> None:
    root = tmp_path / "s"
    catalog = request.getfixturevalue("pg_url") if backend == "postgres" else None
    url = _url(root, catalog)
    refs = _old_store(root, catalog)
    with casckpt.open(root, catalog=catalog, chunk_size=4096) as store:  # Alembic upgrades it
        ids = [store.resolve(r).id for r in refs]
        before = _answers(store, refs)
        rows_bytes = int(_sql(url, "SELECT COALESCE(SUM(LENGTH(chunk_ids)), 0) FROM contents")[0][0])
        assert _count(url, "tensors") == 9 * len(refs) and _count(url, "tree_nodes") == 0
        assert store.ops.stats().versions_without_tree == len(refs)

        report = store.ops.migrate_trees()
        assert (report.versions_migrated, report.versions_left) == (len(refs), 0)
        assert report.tensor_rows_deleted == 9 * len(refs) and report.nodes_written > 0
        assert _count(url, "tensors") == 0 and _count(url, "contents") == 0
        assert _sql(url, "SELECT COUNT(*) FROM versions WHERE tree_root IS NULL")[0][0] == 0
        assert store.ops.stats().versions_without_tree == 0
        node_bytes = int(_sql(url, "SELECT SUM(LENGTH(body)) FROM tree_nodes")[0][0])
        assert node_bytes < rows_bytes + 9 * len(refs) * 100  # the catalog shrinks
        assert [store.resolve(r).id for r in refs] == ids
        _same(_answers(store, refs), before)
        for ref, step in zip(refs, (0, 1, 2, 3, 7, 8), strict=True):
            assert _equal(store.restore(ref), _state(step))
        assert store.resolve("tag:best").id == ids[2]
        assert store.ops.check(read_data=True).ok
        again = store.ops.migrate_trees()
        assert (again.versions_migrated, again.nodes_written, again.tensor_rows_deleted) == (0, 0, 0)

        gone = _nodes_of(store, "r@0") | _nodes_of(store, "f@7")
        store.delete("r@0")
        store.delete("f@7")
        store.gc(grace=0)
        kept = set().union(*(_nodes_of(store, r) for r in refs if r not in ("r@0", "f@7")))
        assert {r[0] for r in _sql(url, "SELECT id FROM tree_nodes")} == kept
        assert gone - kept, "deleting two versions should free some of their nodes"
        for ref, step in zip(refs, (0, 1, 2, 3, 7, 8), strict=True):
            if ref not in ("r@0", "f@7"):
                assert _equal(store.restore(ref), _state(step))
        assert store.ops.check(read_data=True).ok


def test_an_interrupted_migration_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "s"
    url = _url(root, None)
    refs = _old_store(root, None)
    monkeypatch.setattr(treemigrate, "BATCH_VERSIONS", 1)
    publish = treemigrate._publish_batch
    calls: list[int] = []

    def failing(*args: Any) -> None:
        if len(calls) == 2:
            raise RuntimeError("killed between batches")
        calls.append(1)
        publish(*args)

    with casckpt.open(root, chunk_size=4096) as store:
        before = _answers(store, refs)
        monkeypatch.setattr(treemigrate, "_publish_batch", failing)
        with pytest.raises(RuntimeError):
            store.ops.migrate_trees()
        assert _sql(url, "SELECT COUNT(*) FROM versions WHERE tree_root IS NOT NULL")[0][0] == 2
        assert _count(url, "leases") == 0
        _same(_answers(store, refs), before)  # half migrated: both kinds answer alike
        assert store.ops.check(read_data=True).ok
        monkeypatch.setattr(treemigrate, "_publish_batch", publish)
        report = store.ops.migrate_trees()
        assert report.versions_migrated == len(refs) - 2
        _same(_answers(store, refs), before)
        assert _count(url, "tensors") == 0 and store.ops.check(read_data=True).ok


def test_a_migration_killed_with_sigkill_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked_python: ForkedPython) -> None:
    root = tmp_path / "s"
    refs = _old_store(root, None)
    script = textwrap.dedent(f"""
        import os, signal
        import casckpt
        from casckpt.engine.maintenance import treemigrate
        treemigrate.BATCH_VERSIONS = 1
        publish, calls = treemigrate._publish_batch, []
        def dying(*args):
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            calls.append(1)
            publish(*args)
        treemigrate._publish_batch = dying
        with casckpt.open({str(root)!r}, chunk_size=4096) as store:
            store.ops.migrate_trees()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = forked_python.run(["-c", script], env=env, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    url = _url(root, None)
    assert _sql(url, "SELECT COUNT(*) FROM versions WHERE tree_root IS NOT NULL")[0][0] == 3
    with casckpt.open(root, chunk_size=4096) as store:
        assert store.ops.migrate_trees().versions_migrated == len(refs) - 3
        for ref, step in zip(refs, (0, 1, 2, 3, 7, 8), strict=True):
            assert _equal(store.restore(ref), _state(step))
        store.gc(grace=0)  # the killed run's lease and leftovers are reaped
        assert store.ops.check(read_data=True).ok and _count(url, "tensors") == 0


def _deleted_tree_twin(store: casckpt.Store) -> set[str]:
    """A tree version of r@3's state in another run, deleted: its nodes are the ones r@3's
    migration reuses, and no visible version references them. Returns those nodes."""
    store.delete(store.commit(_state(3), run="twin", step=3))
    nodes = _nodes_of(store, "r@3")
    with internals(store).catalog.read() as conn:
        have = {r[0] for r in conn.execute(text("SELECT id FROM tree_nodes"))}
    assert nodes <= have, "the twin should have written r@3's very tree"
    return nodes


def test_gc_between_the_node_write_and_the_publish_loses_no_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.catalog import leases

    root = tmp_path / "s"
    url = _url(root, None)
    refs = _old_store(root, None)
    publish = treemigrate._publish_batch
    with casckpt.open(root, chunk_size=4096) as store:
        before = _answers(store, refs)
        reused = _deleted_tree_twin(store)
        r3 = store.resolve("r@3").id
        monkeypatch.setattr(leases, "CLOCK_SKEW_S", 0.0)  # the twin is older than the lease: fair game
        rewritten: list[str] = []
        rewrite = treemigrate.rewrite_lost

        def gc_first(ctx: Any, batch: dict[str, Any], *args: Any) -> None:
            if r3 in batch:
                store.gc(grace=0)  # sweeps the twin's nodes, which the migration found live
            publish(ctx, batch, *args)

        def recording(ctx: Any, chunks: Any, missing: Any, *args: Any) -> Any:
            rewritten.extend(missing)
            return rewrite(ctx, chunks, missing, *args)

        monkeypatch.setattr(treemigrate, "_publish_batch", gc_first)
        monkeypatch.setattr(treemigrate, "rewrite_lost", recording)
        report = store.ops.migrate_trees()
        assert report.versions_migrated == len(refs)
        assert set(rewritten) & reused, "the publish should have found swept nodes and written them again"
        monkeypatch.setattr(treemigrate, "_publish_batch", publish)
        assert reused <= {r[0] for r in _sql(url, "SELECT id FROM tree_nodes")}
        assert reused <= {r[0] for r in _sql(url, "SELECT id FROM chunks WHERE state = 'live'")}
        store.gc(grace=0)
        _same(_answers(store, refs), before)
        assert store.ops.check(read_data=True).ok


def test_a_version_migrated_while_gc_runs_keeps_its_reused_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc marks r@3 as format 1 (no nodes), then the migration gives it the deleted twin's
    nodes, then gc condemns them: gc must mark r@3 again (its tree root changed) before it
    sweeps, or the nodes of a visible version are gone."""
    from casckpt.catalog import gc as gc_sql

    root = tmp_path / "s"
    url = _url(root, None)
    refs = _old_store(root, None)
    condemn = gc_sql.condemn
    with casckpt.open(root, chunk_size=4096) as store:
        before = _answers(store, refs)
        reused = _deleted_tree_twin(store)
        during = [store.ops.migrate_trees]

        def migrate_then_condemn(*args: Any, **kwargs: Any) -> Any:
            while during:
                during.pop()()
            return condemn(*args, **kwargs)

        monkeypatch.setattr(gc_sql, "condemn", migrate_then_condemn)
        store.gc(grace=0)
        monkeypatch.setattr(gc_sql, "condemn", condemn)
        assert reused <= {r[0] for r in _sql(url, "SELECT id FROM tree_nodes")}
        store.gc(grace=0)
        _same(_answers(store, refs), before)
        assert store.ops.check(read_data=True).ok


def test_catalog_rebuild_restores_migrated_trees(tmp_path: Path) -> None:
    root = tmp_path / "s"
    refs = _old_store(root, None)
    with casckpt.open(root, chunk_size=4096) as store:
        store.ops.migrate_trees()
        before = _answers(store, refs)
        roots = _sql(_url(root, None), "SELECT id, tree_root FROM versions ORDER BY id")
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with casckpt.open(root, recover=True, chunk_size=4096) as store:
        report = store.ops.rebuild_catalog()
        assert report.versions == len(refs) and not report.skipped
        assert _sql(_url(root, None), "SELECT id, tree_root FROM versions ORDER BY id") == roots
        assert _count(_url(root, None), "tensors") == 0
        _same(_answers(store, refs), before)
        assert store.ops.check(read_data=True).ok


def test_cli_migrate_trees(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from casckpt.cli.main import app

    root = tmp_path / "s"
    refs = _old_store(root, None)
    runner = CliRunner()
    result = runner.invoke(app, ["--store", str(root), "catalog", "migrate-trees", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["versions_migrated"] == len(refs) and report["ok"]
    result = runner.invoke(app, ["--store", str(root), "catalog", "migrate-trees"])
    assert result.exit_code == 0 and "versions migrated" in result.output


_BIG = 52 << 20  # bytes whose base64 JSON (69 MiB) passed the 64 MiB a tree node could hold


def test_migrating_a_version_with_a_large_plain_value_leaves_gc_and_queries_working(
        tmp_path: Path) -> None:
    """A version of format 1 may hold a plain value whose JSON passes MAX_NODE (its document
    may reach 512 MiB). Migrating it gave it a tree node no reader accepts: show raised
    CorruptManifestError ("does not match its id"), and every gc after refused to run
    (GCRefusedError), for a version that restored fine before the migration."""
    state = large_state()  # the golden ``large-value`` holds it at r@0, in format 1
    with casckpt.open(legacy("large-value", tmp_path / "s")) as store:
        store.ops.migrate_trees()
        store.gc(grace=0)
        shown = store.show("r@0")
        assert shown.tensor_count == 1 and shown.values["blob"] == state["blob"]
        assert _equal(store.restore("r@0"), state)
        assert store.ops.check().ok


def test_a_committed_large_plain_value_restores_or_the_commit_is_refused(tmp_path: Path) -> None:
    """A tree commit whose plain value makes a node larger than MAX_NODE published a version
    that no reader accepts (restore: CorruptManifestError; gc: refused while it is visible)."""
    state = {"w": torch.arange(6, dtype=torch.float32), "blob": bytes(_BIG)}
    with casckpt.open(tmp_path / "s") as store:
        try:
            store.commit(state, run="r", step=0)
        except casckpt.errors.UnsupportedStateError:
            return  # refused before anything was published: fine
        assert _equal(store.restore("r@0"), state)
        store.gc(grace=0)


def test_a_commit_whose_node_no_reader_accepts_is_refused_before_publishing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node over MAX_NODE is refused when the commit encodes it (a typed error, nothing
    published), never written for every reader (and gc) to refuse afterwards."""
    from casckpt.format import merkle, treeencode

    monkeypatch.setattr(merkle, "MAX_NODE", 1 << 20)
    monkeypatch.setattr(treeencode, "MAX_NODE", 1 << 20)
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"w": torch.ones(3)}, run="r", step=0)
        with pytest.raises(casckpt.errors.UnsupportedStateError, match="tree node"):
            store.commit({"w": torch.ones(3), "blob": bytes(1 << 20)}, run="r", step=1)
        assert [v.step for v in store.log("r")] == [0]
        store.gc(grace=0)
        assert store.ops.check().ok
