"""Tree manifests: versions share the nodes of unchanged subtrees; catalog rows grow with
what changed; queries read only the nodes they need; forged nodes are refused."""

from __future__ import annotations

import random
import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.engine.versions import refs
from casckpt.errors import CorruptManifestError, TensorNotFoundError
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, decode_manifest
from casckpt.format.merkle import PART_MAX_ITEMS, SPLIT_ITEMS, Nodes, NodeSource
from casckpt.format.state import encode_state, iter_leaves
from casckpt.format.treemanifest import encode_tree_manifest
from casckpt.format.treeread import TreeReader
from casckpt.testing.internals import internals

sys.path.insert(0, str(Path(__file__).parents[2] / "golden"))
from make_legacy import legacy  # noqa: E402


def _count(root: Path, sql: str) -> int:
    with closing(sqlite3.connect(root / "catalog.db")) as conn:
        return int(conn.execute(sql).fetchone()[0])


def _flat(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(8, generator=g) for i in range(n)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _equal(a: object, b: object) -> bool:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    if la.keys() != lb.keys():
        return False
    for k, x in la.items():
        y = lb[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(_bytes(x), _bytes(y))):
                return False
        elif type(x) is not type(y) or (x != y and not (x != x and y != y)):
            return False
    return True


# -- sharing: rows and nodes per commit ----------------------------------------------------


def test_rows_and_nodes_grow_with_what_changed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    n = 3 * PART_MAX_ITEMS  # a flat dict cut into parts, with an index above them
    state = {"model": _flat(n), "opt": {"step": 1, "lr": 0.5}}
    with casckpt.open(root) as store:
        store.commit(state, run="r", step=1)
        nodes_1 = _count(root, "SELECT COUNT(*) FROM tree_nodes")
        chunks_1 = _count(root, "SELECT COUNT(*) FROM chunks")
        assert nodes_1 >= 3
        assert _count(root, "SELECT COUNT(*) FROM tensors") == 0
        assert _count(root, "SELECT COUNT(*) FROM contents") == 0

        store.commit(state, run="r", step=2)  # unchanged: the same root, nothing new
        assert _count(root, "SELECT COUNT(*) FROM tree_nodes") == nodes_1
        assert _count(root, "SELECT COUNT(*) FROM chunks") == chunks_1
        v1, v2 = store.log("r", order="asc")
        assert v2.new_bytes == 0
        roots = [r for (r,) in sqlite3.connect(root / "catalog.db").execute(
            "SELECT tree_root FROM versions ORDER BY step")]
        assert roots[0] == roots[1] and roots[0] is not None

        state["model"]["layers.7.w"] = state["model"]["layers.7.w"] + 1  # one tensor
        store.commit(state, run="r", step=3)
        added = _count(root, "SELECT COUNT(*) FROM tree_nodes") - nodes_1
        assert 1 <= added <= 4  # its part, the model dict's top, the root (at most one index level)
        assert _count(root, "SELECT COUNT(*) FROM chunks") - chunks_1 == 1 + added

        state = {"model": _flat(n, seed=9), "opt": {"step": 2, "lr": 0.5}}  # everything
        store.commit(state, run="r", step=4)
        assert _count(root, "SELECT COUNT(*) FROM tree_nodes") - nodes_1 - added >= nodes_1 - 1
        for step, seed in ((1, 0), (4, 9)):
            assert _equal(store.restore(f"r@{step}")["model"], _flat(n, seed))


def test_unchanged_recommit_adds_little_to_the_catalog(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        state = _flat(4000)
        store.commit(state, run="r", step=1)
        before = _count(root, "SELECT SUM(LENGTH(manifest)) FROM versions")
        store.commit(state, run="r", step=2)
        after = _count(root, "SELECT SUM(LENGTH(manifest)) FROM versions")
        assert after - before < 1024  # the manifest names the root; nodes are shared
        assert _count(root, "SELECT COUNT(*) FROM tree_nodes") == _count(
            root, "SELECT COUNT(DISTINCT id) FROM tree_nodes")


# -- round trips ---------------------------------------------------------------------------


class _Dict(NodeSource):
    def __init__(self, nodes: dict[bytes, bytes]) -> None:
        self.nodes = nodes

    def get_many(self, ids: Any) -> dict[bytes, bytes]:
        return {i: self.nodes[i] for i in ids if i in self.nodes}


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8),
    st.integers(min_value=0, max_value=40).map(lambda n: torch.arange(n, dtype=torch.float32)),
)
_key = st.one_of(st.text(alphabet="abcxyz_019", min_size=1, max_size=6), st.integers(-3, 300))
_trees = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.lists(inner, max_size=6).map(tuple),
    st.dictionaries(_key, inner, max_size=6)), max_leaves=40)


def _manifest(state: object) -> Manifest:
    root, leaves = encode_state(state)
    sizes = [4 * leaf.value.numel() for leaf in leaves]
    extents = tuple(ExtentEntry(n, 64, tuple(bytes([i % 256, j]) * 16 for j in range(-(-n // 64))))
                    for i, n in enumerate(sizes))
    tensors = tuple(TensorEntry(leaf.path, "torch", "float32", tuple(leaf.value.shape), i)
                    for i, leaf in enumerate(leaves))
    return Manifest("r", 1, None, 1.0, root, tensors, extents)


@given(_trees)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_state_round_trips_through_nodes(state: object) -> None:
    try:
        manifest = _manifest(state)
    except casckpt.CasckptError:
        return  # a state commit refuses (two keys joining to one path)
    vid, data, tree = encode_tree_manifest(manifest)
    back = decode_manifest(data, vid, _Dict(tree.nodes))
    assert back.root == manifest.root
    assert [(t.path, t.shape) for t in back.tensors] == [(t.path, t.shape) for t in manifest.tensors]
    assert ([back.extents[t.extent] for t in back.tensors]
            == [manifest.extents[t.extent] for t in manifest.tensors])
    assert set(back.nodes) == set(tree.nodes)


def test_large_containers_round_trip_and_find_one_key() -> None:
    state = {"flat": {f"k{i}": torch.zeros(1) for i in range(5 * SPLIT_ITEMS * 4)},
             "seq": [torch.zeros(1) for _ in range(3 * SPLIT_ITEMS)],
             "deep": {"a": {"b": {"c": torch.ones(2)}}}}
    manifest = _manifest(state)
    vid, data, tree = encode_tree_manifest(manifest)
    assert decode_manifest(data, vid, _Dict(tree.nodes)).root == manifest.root
    reader = TreeReader(Nodes(_Dict(tree.nodes)))
    for path in ("flat.k4321", "seq.700", "deep.a.b.c"):
        found = reader.find_tensor(tree.root, path)
        assert found is not None and found[0] == path and found[1]["t"] == "tensor"
    assert reader.find_tensor(tree.root, "flat.nope") is None
    assert len(reader.visited) < len(tree.nodes) // 2  # lookups read few of the nodes


def test_store_round_trip_of_nested_state(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"model": {f"blocks.{i}": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
                       for i in range(300)},
             "optim": {"state": {i: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, generator=g)}
                                 for i in range(600)},
                       "param_groups": [{"lr": 1e-3, "params": list(range(600))}]},
             "rng": torch.get_rng_state(), "epoch": 3, "tied": None}
    state["tied"] = state["model"]["blocks.0"]["w"]  # shares storage with another tensor
    with casckpt.open(tmp_path / "s") as store:
        store.commit(state, run="r", step=1)
        back = store.restore("r@1")
        assert _equal(back, state)
        tied = back["model"]["blocks.0"]["w"]
        assert back["tied"].untyped_storage().data_ptr() == tied.untyped_storage().data_ptr()
        last = state["optim"]["state"][599]["exp_avg"]
        assert torch.equal(store.load_tensor("r@1", "optim.state.599.exp_avg"), last)
        assert torch.equal(store.load_tensor("r@1", "tied"), state["tied"])
        with pytest.raises(TensorNotFoundError):
            store.load_tensor("r@1", "optim.state.600.exp_avg")
        assert store.ops.check(read_data=True).ok


# -- diff and history against a brute-force reference ---------------------------------------


def _reference_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[set[str], set[str], set[str]]:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    ta = {k for k, v in la.items() if isinstance(v, torch.Tensor)}
    tb = {k for k, v in lb.items() if isinstance(v, torch.Tensor)}
    changed = {k for k in ta & tb if not torch.equal(la[k], lb[k]) or la[k].shape != lb[k].shape}
    return tb - ta, ta - tb, changed


@pytest.mark.parametrize("seed", [0, 1])
def test_diff_and_history_match_brute_force(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    keys = [f"m.{i}" for i in range(700)]
    state: dict[str, Any] = {"model": {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}, "lr": 0.1}
    states = []
    with casckpt.open(tmp_path / "s") as store:
        for step in range(1, 7):
            model = dict(state["model"])
            for _ in range(rng.randint(0, 5)):
                k = rng.choice(keys)
                if rng.random() < 0.2:
                    model.pop(k, None)
                else:
                    model[k] = torch.full((2,), rng.random())
            state = {"model": model, "lr": rng.choice([0.1, 0.2])}
            states.append(state)
            store.commit(state, run="r", step=step)
        for i in range(len(states) - 1):
            d = store.diff(f"r@{i + 1}", f"r@{i + 2}")
            added, removed, changed = _reference_diff(states[i], states[i + 1])
            assert {c.path for c in d.added} == added
            assert {c.path for c in d.removed} == removed
            assert {c.path for c in d.changed} == changed
            assert d.unchanged == len(states[i]["model"]) - len(removed) - len(changed)
            want_values = {"lr"} if states[i]["lr"] != states[i + 1]["lr"] else set()
            assert {v.path for v in d.values} == want_values
        for k in rng.sample(keys, 20):
            path = f"model.{k}"
            want, last = [], None
            for step, s in enumerate(states, 1):
                now = s["model"].get(k)
                if now is None and last is not None:
                    want.append((step, "removed"))
                elif now is not None and last is None:
                    want.append((step, "added"))
                elif now is not None and last is not None and not torch.equal(now, last):
                    want.append((step, "changed"))
                last = now
            got = [(e.version.step, e.change) for e in store.history("r", path)]
            assert got == want


# -- forged and damaged nodes ----------------------------------------------------------------


def test_forged_or_truncated_nodes_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        store.commit({"model": _flat(600)}, run="r", step=1)
    with closing(sqlite3.connect(root / "catalog.db")) as conn, conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM tree_nodes")]
        import zstandard

        from casckpt.format.merkle import node_json
        body = conn.execute("SELECT body FROM tree_nodes WHERE id = ?", (ids[0],)).fetchone()[0]
        raw = node_json(body)
        forged = raw.replace(b'"float32"', b'"float64"', 1) if b'"float32"' in raw else raw[:-1]
        conn.execute("UPDATE tree_nodes SET body = ? WHERE id = ?",
                     (zstandard.ZstdCompressor().compress(forged), ids[0]))
    with casckpt.open(root) as store:
        with pytest.raises(CorruptManifestError):
            store.restore("r@1")
        assert not store.ops.check().ok
    with closing(sqlite3.connect(root / "catalog.db")) as conn, conn:
        conn.execute("UPDATE tree_nodes SET body = ? WHERE id = ?",
                     (zstandard.ZstdCompressor().compress(raw[: len(raw) // 2]), ids[0]))
    with casckpt.open(root) as store:
        with pytest.raises(CorruptManifestError):
            store.restore("r@1")
        report = store.ops.repair()  # the node's copy in the packs is intact
        assert report.tree_nodes_restored == 1
        assert store.ops.check(read_data=True).ok
        assert _equal(store.restore("r@1"), {"model": _flat(600)})
    with closing(sqlite3.connect(root / "catalog.db")) as conn, conn:
        conn.execute("DELETE FROM tree_nodes WHERE id = ?", (ids[-1],))
    with casckpt.open(root) as store:
        assert not store.ops.check().ok
        assert store.ops.repair().tree_nodes_restored == 1
        assert store.ops.check(read_data=True).ok


# -- gc and retention ------------------------------------------------------------------------


def test_gc_frees_exactly_the_unreachable_nodes_and_chunks(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        base = _flat(2 * PART_MAX_ITEMS)
        store.commit({"model": base}, run="r", step=1)
        one = dict(base)
        one["layers.3.w"] = one["layers.3.w"] + 1
        store.commit({"model": one}, run="r", step=2)
        store.commit({"model": base, "extra": torch.ones(3)}, run="r", step=3)
        nodes = {r[0] for r in sqlite3.connect(root / "catalog.db").execute("SELECT id FROM tree_nodes")}
        store.delete("r@2")
        store.gc(grace=0)
        left = {r[0] for r in sqlite3.connect(root / "catalog.db").execute("SELECT id FROM tree_nodes")}
        reachable = set()
        for ref in ("r@1", "r@3"):
            catalog = internals(store).catalog
            m = refs.load_manifest(catalog, refs.resolve(catalog, ref))
            reachable |= {n.hex() for n in m.nodes}
            live = {c[0] for c in sqlite3.connect(root / "catalog.db").execute("SELECT id FROM chunks")}
            assert {c.hex() for c in m.chunk_ids()} <= live
        assert left == reachable and left < nodes
        assert _equal(store.restore("r@1")["model"], base)
        assert store.ops.check(read_data=True).ok


def test_gc_reads_each_shared_node_once_however_many_versions_share_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark walks trees through a set of visited nodes: a node (and its subtree) shared by
    every version is read once, not once per version as expanding each manifest did."""
    from casckpt.engine.versions import nodes as node_source

    root = tmp_path / "s"
    requested: list[bytes] = []
    get_many = node_source.StoreNodes.get_many

    def counting(self: node_source.StoreNodes, ids: Any) -> Any:
        requested.extend(ids)
        return get_many(self, ids)

    with casckpt.open(root) as store:
        state = {"model": _flat(2 * PART_MAX_ITEMS), "opt": {"lr": 0.1}}
        for step in range(5):
            state["model"] = dict(state["model"], **{f"layers.{step}.w": torch.full((8,), float(step))})
            store.commit(state, run="r", step=step)
        monkeypatch.setattr(node_source.StoreNodes, "get_many", counting)
        store.gc(grace=0)
        monkeypatch.undo()
        nodes = {bytes.fromhex(r[0]) for r in sqlite3.connect(root / "catalog.db").execute(
            "SELECT id FROM tree_nodes")}
        assert requested and len(requested) == len(set(requested)), "a node was read twice"
        assert set(requested) == nodes  # every node of every version, each once
        assert _equal(store.restore("r@4"), state)
        assert store.ops.check(read_data=True).ok


def test_a_commit_reusing_a_subtree_gc_condemned_revives_everything_below_it(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        state = {"model": _flat(2 * PART_MAX_ITEMS)}
        store.commit(state, run="r", step=1)
        store.delete("r@1")
        store.gc(grace=3600)  # condemns the whole tree; sweeps nothing yet
        assert _count(root, "SELECT COUNT(*) FROM chunks WHERE state = 'condemned'") > 0
        store.commit(state, run="r", step=2)  # the same tree again: its nodes are reused
        assert _count(root, "SELECT COUNT(*) FROM chunks WHERE state = 'condemned'") == 0
        store.gc(grace=0)
        assert _equal(store.restore("r@2")["model"], state["model"])
        assert store.ops.check(read_data=True).ok


# -- older stores ----------------------------------------------------------------------------


def test_versions_of_the_previous_format_read_and_compare_with_trees(tmp_path: Path) -> None:
    root = legacy("previous", tmp_path / "s")  # r@1: {"model": _flat(300, 1)} in format 1
    a, b = _flat(300, 1), _flat(300, 1)
    b["layers.5.w"] = b["layers.5.w"] * 2
    with casckpt.open(root) as store:
        assert _count(root, "SELECT COUNT(*) FROM tensors") == 300
        store.commit({"model": b}, run="r", step=2)
        d = store.diff("r@1", "r@2")
        assert [c.path for c in d.changed] == ["model.layers.5.w"] and d.unchanged == 299
        assert [(e.version.step, e.change) for e in store.history("r", "model.layers.5.w")] == [
            (1, "added"), (2, "changed")]
        assert [(e.version.step, e.change) for e in store.history("r", "model.layers.6.w")] == [(1, "added")]
        assert _equal(store.restore("r@1")["model"], a) and _equal(store.restore("r@2")["model"], b)
        shown = {t.path: t.digest for t in store.show("r@1").tensors}
        assert shown == {t.path: t.digest for t in store.show("r@2").tensors} | {
            "model.layers.5.w": shown["model.layers.5.w"]}
        assert store.ops.check(read_data=True).ok


def _downgrade(url: str, revision: str) -> None:
    from alembic import command
    from sqlalchemy import create_engine

    from casckpt.catalog.migrate import _config

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            command.downgrade(_config(conn), revision)
            conn.commit()
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_store_of_the_previous_release_upgrades_and_every_version_stays_bit_exact(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """Versions written as the release before tree manifests wrote them (the golden
    ``release``), on its schema (0006), then opened by this one: the catalog gains its tree
    tables, every old version restores bit for bit and keeps its id, and new (tree) versions
    build on them."""
    root = tmp_path / "s"
    catalog = request.getfixturevalue("pg_url") if backend == "postgres" else None
    url = catalog or f"sqlite:///{root / 'catalog.db'}"
    states = [{"model": _flat(600, seed), "step": seed} for seed in range(3)]
    legacy("release", root, catalog=catalog)
    old = sorted(p.name for p in (root if catalog is None else tmp_path / "s-objects").glob("manifests/*"))
    _downgrade(url, "0006")
    with casckpt.open(root, catalog=catalog) as store:  # upgraded on open
        assert sorted(v.id for v in store.log("r")) == old
        for i, s in enumerate(states):
            assert _equal(store.restore(f"r@{i}"), s)
        newer = {"model": dict(states[-1]["model"]), "step": 3}
        newer["model"]["layers.1.w"] = newer["model"]["layers.1.w"] * 3
        store.commit(newer, run="r", step=3)
        assert _equal(store.restore("r@3"), newer)
        d = store.diff("r@2", "r@3")
        assert [c.path for c in d.changed] == ["model.layers.1.w"]
        assert [e.version.step for e in store.history("r", "model.layers.1.w")] == [0, 1, 2, 3]
        assert store.ops.check(read_data=True).ok


def test_catalog_rebuild_restores_the_trees(tmp_path: Path) -> None:
    root = tmp_path / "s"
    states = [{"model": _flat(2 * PART_MAX_ITEMS, seed), "lr": 0.1 * seed} for seed in range(3)]
    states[2]["model"] = dict(states[1]["model"], **{"layers.9.w": torch.ones(8)})
    with casckpt.open(root) as store:
        for i, s in enumerate(states):
            store.commit(s, run="r", step=i)
        before = {r[0] for r in sqlite3.connect(root / "catalog.db").execute("SELECT id FROM tree_nodes")}
        ids = [v.id for v in store.log("r", order="asc")]
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with casckpt.open(root, recover=True) as store:
        report = store.ops.rebuild_catalog()
        assert report.versions == 3 and not report.skipped
        after = {r[0] for r in sqlite3.connect(root / "catalog.db").execute("SELECT id FROM tree_nodes")}
        assert after == before
        assert [v.id for v in store.log("r", order="asc")] == ids
        for i, s in enumerate(states):
            assert _equal(store.restore(f"r@{i}"), s)
        assert [c.path for c in store.diff("r@1", "r@2").changed] == ["model.layers.9.w"]
        assert store.ops.check(read_data=True).ok


def test_show_summary_without_the_tensor_list_agrees_with_the_full_listing(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"model": _flat(700), "optim": {"state": {0: {"m": torch.ones(3)}}}, "lr": 0.5},
                     run="r", step=1)
        full, summary = store.show("r@1"), store.show("r@1", tensors=False)
    assert summary.tensors == () and len(full.tensors) == 701
    assert (summary.tensor_count, summary.tensor_bytes, summary.tensor_groups) == (
        full.tensor_count, full.tensor_bytes, full.tensor_groups)
    assert [(g.name, g.tensors) for g in full.tensor_groups] == [("model", 700), ("optim", 1)]
    assert full.tensor_bytes == sum(t.nbytes for t in full.tensors) == 700 * 32 + 12
    assert summary.values == full.values == {"lr": 0.5}


def _no_node_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.catalog import nodes as node_sql

    def refuse(catalog: object, ids: object) -> None:
        raise AssertionError("the summary read tree nodes")

    monkeypatch.setattr(node_sql, "tree_nodes", refuse)


def test_show_summary_reads_no_tree_node_unless_it_must(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary comes from the version's document; a document that could not keep it (too
    many path heads, large values) or a store with degraded packs has the tree read instead."""
    many_heads = {f"h{i}": torch.ones(2) for i in range(100)}
    big_value = {"model": _flat(300), "sampler": list(range(2000))}
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"model": _flat(300), "step": 7}, run="r", step=1)
        store.commit(many_heads, run="r", step=2)
        store.commit(big_value, run="r", step=3)
        expected = {i: store.show(f"r@{i}") for i in (1, 2, 3)}
        with monkeypatch.context() as m:
            _no_node_reads(m)
            quick = store.show("r@1", tensors=False)
            for i in (2, 3):
                with pytest.raises(AssertionError, match="read tree nodes"):
                    store.show(f"r@{i}", tensors=False)
        for i in (1, 2, 3):
            got = store.show(f"r@{i}", tensors=False)
            assert (got.tensor_count, got.tensor_bytes, got.tensor_groups, got.values) == (
                expected[i].tensor_count, expected[i].tensor_bytes, expected[i].tensor_groups,
                expected[i].values)
        assert quick.values == {"step": 7} and quick.tensor_count == 300
        assert len(expected[2].tensor_groups) == 100 and expected[3].values["sampler.1999"] == 1999


def test_a_summary_disagreeing_with_its_tree_is_refused() -> None:
    """A document is trusted as far as its id; one written wrong (a bug) must not pass a full read."""
    import json

    import zstandard

    from casckpt.format.chunks import object_id

    state = {"model": _flat(20), "lr": 0.1}
    root, leaves = encode_state(state)
    tensors = tuple(TensorEntry(leaf.path, "torch", "float32", (8,), i) for i, leaf in enumerate(leaves))
    extents = tuple(ExtentEntry(32, 1 << 20, (bytes([i]) * 32,)) for i in range(len(leaves)))
    manifest = Manifest("r", 1, None, 0.0, root, tensors, extents)
    _, data, tree = encode_tree_manifest(manifest)
    doc = json.loads(zstandard.ZstdDecompressor().decompress(data))
    assert doc["tree"]["groups"] == [["model", 20, 640]] and doc["tree"]["values"][0][0] == "lr"

    class Source(NodeSource):
        def get_many(self, ids: Any) -> Any:
            return {i: tree.nodes[i] for i in ids if i in tree.nodes}

    for field, forged in (("groups", [["model", 20, 641]]), ("values", [["lr", {"t": "int", "v": 1}]])):
        bad = json.loads(json.dumps(doc))
        bad["tree"][field] = forged
        raw = json.dumps(bad, sort_keys=True, separators=(",", ":")).encode()
        with pytest.raises(CorruptManifestError, match="disagree with its tree"):
            decode_manifest(zstandard.ZstdCompressor().compress(raw), object_id(raw), Source())


def test_a_commit_reusing_a_node_newer_than_gcs_floor_keeps_the_old_chunks_below_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: gc condemns by age, so a node written after a gc's floor stayed live
    over condemned chunks; a commit reusing that node re-checked only the node, and the next
    gc swept the chunks a visible version needed. Publishing re-checks every chunk now."""
    import time

    from casckpt.catalog import gc as gc_sql

    g = torch.Generator().manual_seed(0)
    shared = {f"k{i}": torch.randn(5000, generator=g) for i in range(20)}

    def state(y: int) -> dict[str, Any]:
        return {"a": {"m": shared}, "y": y}

    during: list[Any] = []
    condemn = gc_sql.condemn

    def condemn_after_a_commit(*args: Any, **kwargs: Any) -> Any:  # a commit racing the gc
        while during:
            during.pop()()
        return condemn(*args, **kwargs)

    monkeypatch.setattr(gc_sql, "condemn", condemn_after_a_commit)
    with casckpt.open(tmp_path / "s") as store:
        store.delete(store.commit(state(0), run="r", step=1))
        during.append(lambda: store.commit(state(1), run="r", step=2))  # a new root over old nodes
        store.gc(grace=1.0)
        store.delete("r@2")
        time.sleep(1.2)
        during.append(lambda: store.commit(state(1), run="r", step=3))  # reuses r@2's root
        store.gc(grace=1.0)
        assert _equal(store.restore("r@3"), state(1))
        assert store.ops.check(read_data=True).ok


def test_a_forged_tree_of_shared_nodes_is_refused_promptly() -> None:
    """Found in review: a list node naming one child twice, 24 levels deep, expanded 2^24
    values (minutes); the work of a walk is bounded by the bytes of the nodes it read."""
    import json

    from casckpt.format.chunks import chunk_id
    from casckpt.format.treeread import TreeReader

    nodes: dict[bytes, bytes] = {}
    raw = json.dumps({"n": 0, "b": 0, "v": {"t": "int", "v": 1}}, sort_keys=True,
                     separators=(",", ":")).encode()
    for _ in range(24):
        node_id = chunk_id(raw)
        nodes[node_id] = raw
        ref = {"t": "ref", "id": node_id.hex(), "n": 0, "b": 0, "c": 1}
        raw = json.dumps({"n": 0, "b": 0, "v": {"t": "list", "v": [ref, ref]}}, sort_keys=True,
                         separators=(",", ":")).encode()
    root = chunk_id(raw)
    nodes[root] = raw
    for walk in (lambda r: r.expand(root), lambda r: list(r.leaves({"t": "ref", "id": root.hex()}))):
        reader = TreeReader(Nodes(_Dict(nodes)))
        with pytest.raises(CorruptManifestError, match="forged or corrupt"):
            walk(reader)
        assert reader.work < 2 * (1 << 18)  # 2^24 values unless bounded


@pytest.mark.parametrize("forgery", ["parts not refs", "ref id a list", "key neither str nor int"])
def test_malformed_nodes_with_valid_ids_are_typed_errors_in_every_walk(forgery: str) -> None:
    import json

    from casckpt.format.chunks import chunk_id
    from casckpt.format.treeread import TreeReader

    def node(value: dict[str, Any]) -> tuple[bytes, bytes]:
        raw = json.dumps({"n": 1, "b": 4, "v": value}, sort_keys=True, separators=(",", ":")).encode()
        return chunk_id(raw), raw

    leaf = {"t": "tensor", "e": {"kind": "torch", "dtype": "float32", "shape": [1], "offset": 0,
                                 "stride": None, "blob": {"nbytes": 4, "chunk_size": 64,
                                                          "chunks": ["ab" * 32]}}}
    value: dict[str, Any] = {
        "parts not refs": {"t": "dict", "parts": [1, "zz"]},
        "ref id a list": {"t": "dict", "parts": [{"t": "ref", "id": ["x"], "n": 1, "b": 4, "c": 1}]},
        "key neither str nor int": {"t": "dict", "k": [{"z": 1}], "v": [leaf]},
    }[forgery]
    a, raw_a = node(value)
    b, raw_b = node({"t": "dict", "k": ["w"], "v": [leaf]})
    nodes = {a: raw_a, b: raw_b}
    for walk in (lambda r: r.expand(a), lambda r: r.find_tensor(a, "w"),
                 lambda r: list(r.differences(a, b))):
        with pytest.raises(CorruptManifestError):
            walk(TreeReader(Nodes(_Dict(nodes))))


@pytest.mark.parametrize("field,value", [("offset", 1 << 20), ("shape", [-4]), ("shape", [10**30])])
def test_one_tensor_read_from_a_tree_is_validated_like_a_whole_manifest(field: str, value: Any) -> None:
    """Found in review: load_tensor, diff and history took one entry of a node as it was
    (an offset past its extent reached torch as an untyped RuntimeError)."""
    from casckpt.engine.read.treeviews import checked_tensor, value_row

    entry = {"kind": "torch", "dtype": "float32", "shape": [4], "offset": 0, "stride": None,
             "blob": {"nbytes": 16, "chunk_size": 64, "chunks": ["ab" * 32]}}
    pieces = {"t": "sharded", "v": [{"t": "tensor", "e": {**entry, "gs": [4], "go": [0]}}]}
    checked_tensor("w", {"t": "tensor", "e": entry}, ())  # the unforged entry is fine
    checked_tensor("w", pieces, ())
    entry[field] = value
    pieces["v"][0]["e"][field] = value
    for forged in ({"t": "tensor", "e": entry}, pieces):
        with pytest.raises(CorruptManifestError):
            checked_tensor("w", forged, ())
        with pytest.raises(CorruptManifestError):
            value_row("w", forged, ())
