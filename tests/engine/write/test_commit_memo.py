"""A run's next commit reuses what its last one derived (pack groups, tree nodes) for the parts
of the state that did not change: the memos must never change what is written.

Every test compares the memo's output with a memo-free encoding of the same state: the same
tree root, the same nodes, the same document; and versions restore bit-exact.
"""

from __future__ import annotations

import functools
import gc
import random
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutations import MUTATIONS, mutate, state_of

import casckpt
from casckpt.engine.versions.extents import PackMemo, plan_extents
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry
from casckpt.format.merkle import SPLIT_ITEMS
from casckpt.format.state import encode_state, iter_leaves
from casckpt.format.treeencode import TreeMemo
from casckpt.format.treemanifest import encode_tree_manifest

_leaf = st.one_of(
    st.none(), st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.text(max_size=4),
    st.integers(min_value=1, max_value=12).map(lambda n: torch.arange(n, dtype=torch.float32)),
)
_key = st.one_of(st.text(alphabet="abc_01", min_size=1, max_size=4), st.integers(0, 40))
_trees = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
    st.dictionaries(_key, inner, max_size=5)), max_leaves=30)


def _manifest(state: object) -> Manifest:
    """A manifest of ``state`` with made-up extents (a function of each tensor's values)."""
    root, leaves = encode_state(state)
    tensors, extents = [], []
    for i, leaf in enumerate(leaves):
        t = torch.as_tensor(leaf.value)
        tensors.append(TensorEntry(leaf.path, "torch", "float32", tuple(t.shape), i))
        extents.append(ExtentEntry(4 * t.numel(), 64, (t.numpy().tobytes()[:32].ljust(32, b"-"),)))
    return Manifest("r", 1, None, 1.0, root, tuple(tensors), tuple(extents))


def _wide(seed: int, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"flat": {f"k{i}": torch.randn(2, generator=g) for i in range(n)},
            "seq": [torch.randn(1, generator=g) for _ in range(SPLIT_ITEMS + 10)],
            "step": seed}


Encoded = tuple[str, bytes, str, object]  # version id, document, tree root, tree nodes


def _reference(m: Manifest) -> Encoded:
    """The memo-free encoding of ``m``."""
    vid, data, tree = encode_tree_manifest(m)
    return vid, data, tree.root, tree.nodes


@functools.cache
def _wide_manifests() -> tuple[tuple[Manifest, Encoded], ...]:
    """Two wide states' manifests with their memo-free encodings: the same in every example,
    so built once (manifests are frozen; a memo chain starts empty in each example)."""
    return tuple((m, _reference(m)) for m in (_manifest(_wide(0, 3 * SPLIT_ITEMS)),
                                                _manifest(_wide(1, 3 * SPLIT_ITEMS))))


@given(st.lists(_trees, min_size=1, max_size=4), st.lists(st.integers(0, 3), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_tree_memo_never_changes_the_encoding(states: list[object], order: list[int]) -> None:
    """Manifests encoded in any order through a chain of memos (the same manifest objects
    again, as a commit of an unchanged state gives) encode exactly as without a memo."""
    manifests: list[tuple[Manifest, Encoded | None]] = []
    for state in states:
        try:
            manifests.append((_manifest(state), None))
        except casckpt.CasckptError:
            continue  # a state commit refuses (two keys joining to one path)
    manifests += _wide_manifests()
    memo = None
    for i in order + order:
        m, reference = manifests[i % len(manifests)]
        if reference is None:  # each manifest's reference is computed once, on first use
            reference = _reference(m)
            manifests[i % len(manifests)] = (m, reference)
        memo = TreeMemo(memo)
        vid, data, tree = encode_tree_manifest(m, memo)
        assert (vid, data, tree.root, tree.nodes) == reference


def test_a_pack_memo_never_changes_the_entries() -> None:
    """Pack groups reused from the last commit only where bytes, paths, dtypes, shapes and
    places all match: a tensor changed in place, reinterpreted (same bytes, another dtype or
    shape), renamed or moved gets entries of its own."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(4, generator=g) for i in range(400)}
    memo = PackMemo()
    edits = [lambda s: None,
             lambda s: s["w5"].add_(1),  # in place: same object, new bytes
             lambda s: s.update(w7=s["w7"].view(torch.int32)),  # same bytes, another dtype
             lambda s: s.update(w9=s["w9"].reshape(2, 2)),  # same bytes, another shape
             lambda s: s.update(w11=s.pop("w12")),  # renamed
             lambda s: s.update(extra=torch.ones(3)),  # added: later groups shift
             lambda s: s.pop("w0")]
    for edit in edits:
        edit(state)
        memo = PackMemo(memo)
        _, leaves = encode_state(state)
        got, _ = plan_extents(leaves, pack=16 << 10, memo=memo)
        want, _ = plan_extents(leaves, pack=16 << 10)
        assert got == want


def _roots(path: Path) -> list[str]:
    with closing(sqlite3.connect(path / "catalog.db")) as conn:
        return [r[0] for r in conn.execute("SELECT tree_root FROM versions ORDER BY committed_at")]


def _edit(state: dict[str, Any], rng: random.Random) -> None:
    keys = sorted(state["model"])
    op = rng.randrange(7)
    key = rng.choice(keys)
    if op == 0:
        state["model"][key].mul_(-1)  # in place
    elif op == 1:
        state["model"][key] = state["model"][key].clone().view(torch.int32)
    elif op == 2:
        state["model"][f"new{rng.randrange(1000)}"] = torch.full((3,), float(rng.randrange(9)))
    elif op == 3 and len(keys) > 2:
        del state["model"][key]
    elif op == 4:
        state["lr"] = rng.random()
    elif op == 5:
        other = rng.choice(keys)
        state["model"][key], state["model"][other] = state["model"][other], state["model"][key]
    else:
        state["optim"][key] = {"m": state["model"][key].clone()}


@pytest.mark.parametrize("seed", [0, 1])
def test_commits_through_memos_write_what_a_fresh_process_writes(tmp_path: Path, seed: int) -> None:
    """One store object commits a run step after step (its memos in use); each state is also
    committed under a run of its own (no memo): the trees are the same, and every version
    restores bit-exact."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"model": {f"layer.{i}.w": torch.randn(5, generator=g) for i in range(600)},
                             "optim": {}, "lr": 0.1}
    copies = []
    with casckpt.open(tmp_path / "a") as a, casckpt.open(tmp_path / "b") as b:
        for step in range(8):
            if step:
                for _ in range(rng.randrange(1, 4)):
                    _edit(state, rng)
            a.commit(state, run="r", step=step)
            b.commit(state, run=f"fresh{step}", step=0)
            copies.append({k: v for k, v in iter_leaves(state)})
            copies[-1] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in copies[-1].items()}
        for step, expected in enumerate(copies):
            back = dict(iter_leaves(a.restore(f"r@{step}")))
            assert back.keys() == expected.keys()
            for k, v in expected.items():
                if isinstance(v, torch.Tensor):
                    assert back[k].dtype == v.dtype and torch.equal(back[k], v), (step, k)
                else:
                    assert back[k] == v
    assert _roots(tmp_path / "a") == _roots(tmp_path / "b")


@pytest.mark.parametrize("enabled", [True, False])
def test_a_commit_leaves_the_garbage_collector_as_it_found_it(tmp_path: Path, enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with casckpt.open(tmp_path / "s") as store:
            store.commit({"w": torch.ones(3)}, run="r", step=1)
            assert gc.isenabled() is enabled
            with pytest.raises(casckpt.CasckptError):
                store.commit({"w": object()}, run="r", step=2)  # a failed snapshot too
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_snapshots_of_several_threads_share_the_pause_and_resume_the_collector(tmp_path: Path) -> None:
    import threading

    assert gc.isenabled()
    g = torch.Generator().manual_seed(5)
    states = [{f"w{i}": torch.randn(4, generator=g) for i in range(3000)} for _ in range(3)]
    with casckpt.open(tmp_path / "s") as store:
        threads = [threading.Thread(target=lambda n=n: [store.commit(states[n], run=f"r{n}", step=s)
                                                         for s in range(3)]) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gc.isenabled()
        for n in range(3):
            back = store.restore(f"r{n}@2")
            assert all(torch.equal(back[k], v) for k, v in states[n].items())


def test_a_commit_keeps_what_the_program_froze_frozen(tmp_path: Path) -> None:
    """Resuming the collector promotes the snapshot's objects with gc.freeze/unfreeze, never
    when the program froze objects itself (unfreezing would undo that)."""
    was = gc.isenabled()
    held = [[i] for i in range(100)]
    try:
        gc.enable()
        gc.freeze()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with casckpt.open(tmp_path / "s") as store:
            store.commit({"w": torch.ones(3), "held": len(held)}, run="r", step=1)
        # unfreezing would empty the permanent generation (a few frozen objects may be freed)
        assert gc.get_freeze_count() > frozen // 2 and gc.isenabled()
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


@given(st.integers(0, 3), st.lists(st.tuples(st.integers(0, MUTATIONS - 1), st.integers(0, 200)),
                                   min_size=1, max_size=5))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
def test_a_recommit_after_any_mutation_is_what_a_fresh_run_commits(
        tmp_path_factory: pytest.TempPathFactory, seed: int, ops: list[tuple[int, int]]) -> None:
    """Random changes to a nested state between commits of one run (in place, new tensors, a
    storage swapped under the same object, dtype / shape / stride / conj / neg changes, keys
    added, removed, reordered, plain values): each commit's tree is the one a run with no
    memo commits of the same state, and every version restores bit-exact."""
    root = tmp_path_factory.mktemp("mut")
    state = state_of(seed)
    copies = []
    with casckpt.open(root / "a") as a:
        for step, (op, pick) in enumerate([(MUTATIONS - 1, 0), (MUTATIONS - 1, 0), *ops]):
            mutate(state, op, pick)
            a.commit(state, run="r", step=step)
            a.commit(state, run=f"fresh{step}", step=0)  # a run of its own: no memo
            copies.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in iter_leaves(state)})
        for step, expected in enumerate(copies):
            back = dict(iter_leaves(a.restore(f"r@{step}")))
            assert back.keys() == expected.keys()
            for k, v in expected.items():
                if isinstance(v, torch.Tensor):
                    assert back[k].dtype == v.dtype and back[k].shape == v.shape
                    assert torch.equal(back[k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg())
                else:
                    assert back[k] == v
        assert a.ops.check().ok
    roots = _roots(root / "a")
    assert roots[0::2] == roots[1::2]
