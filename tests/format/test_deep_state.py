"""States nest at most MAX_DEPTH containers: any tree up to it round-trips through a
store, one level more is refused before anything is written (issue 13: deep trees used to
escape as a RecursionError from the encoder, ~490 levels down)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.errors import (
    InvalidArgumentError,
    RefNotFoundError,
    RestoreTargetError,
    UnsupportedStateError,
)
from casckpt.format.state import MAX_DEPTH

PROPERTY = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_steps = itertools.count()


def _objects(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for sub in ("packs", "manifests", "tmp", "cache/staging")
                  for p in (root / sub).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path_factory.mktemp("deep") / "store", chunk_size=256) as s:
        yield s
        assert s.ops.check(read_data=True).ok


def _nest(node: Any, kinds: list[str], extras: list[Any]) -> Any:
    """Wrap ``node`` in one container per kind (innermost first), each with a sibling value."""
    for kind, extra in zip(kinds, extras, strict=True):
        if kind == "dict":
            node = {"s": node, 7: extra}
        elif kind == "list":
            node = [extra, node]
        else:
            node = (node, extra)
    return node


def _depth(tree: Any) -> int:
    if isinstance(tree, dict):
        return 1 + max((_depth(v) for v in tree.values()), default=0)
    if isinstance(tree, (list, tuple)):
        return 1 + max((_depth(v) for v in tree), default=0)
    return 0


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


leaves = st.one_of(
    st.none(), st.integers(), st.text(max_size=4), st.binary(max_size=4),
    st.integers(0, 30).map(lambda n: torch.arange(n, dtype=torch.float32)),
    st.integers(0, 30).map(lambda n: np.arange(n, dtype=np.int16)),
)
siblings = st.one_of(leaves, st.just({}), st.just(()))  # an empty container is one level deeper


@st.composite
def deep_trees(draw: st.DrawFn) -> tuple[Any, int]:
    depth = draw(st.integers(1, MAX_DEPTH))
    kinds = draw(st.lists(st.sampled_from(["dict", "list", "tuple"]), min_size=depth, max_size=depth))
    extras = [draw(leaves)] + [draw(siblings) for _ in kinds[1:]]  # the innermost is at the limit
    return _nest(draw(leaves), kinds, extras), depth


@PROPERTY
@given(sample=deep_trees(), wrappers=st.lists(st.sampled_from(["dict", "list", "tuple"]), min_size=1,
                                               max_size=3))
def test_trees_up_to_the_limit_roundtrip_and_one_more_level_is_refused(
    store: casckpt.Store, sample: tuple[Any, int], wrappers: list[str],
) -> None:
    tree, depth = sample
    assert _depth(tree) == depth
    version = store.commit(tree, run="deep", step=next(_steps))
    _assert_same(store.restore(version), tree)

    # wrap it until it is one level deeper than allowed
    kinds = (wrappers * MAX_DEPTH)[: MAX_DEPTH - depth + 1]
    deeper = _nest(tree, kinds, [None] * len(kinds))
    assert _depth(deeper) == MAX_DEPTH + 1
    assert store.path is not None
    before = (len(store.log("deep")), store.ops.stats(), _objects(store.path))
    with pytest.raises(UnsupportedStateError) as info:
        store.commit(deeper, run="deep", step=next(_steps))
    after = (len(store.log("deep")), store.ops.stats(), _objects(store.path))
    assert after == before, "a refused commit wrote"
    message = str(info.value)
    assert f"deeper than {MAX_DEPTH}" in message and "Flatten" in message


def test_tree_of_500_levels_is_refused_naming_the_path(store: casckpt.Store) -> None:
    tree: Any = torch.ones(2)
    for _ in range(500):
        tree = {"k": tree}
    assert store.path is not None
    before = (store.ops.stats(), _objects(store.path))
    with pytest.raises(UnsupportedStateError) as info:
        store.commit(tree, run="deep500", step=0, block=False)
    assert (store.ops.stats(), _objects(store.path)) == before
    assert repr(".".join(["k"] * MAX_DEPTH)) in str(info.value)
    with pytest.raises(RefNotFoundError):
        store.resolve("deep500@latest")


def test_metadata_deeper_than_the_limit_is_refused(store: casckpt.Store) -> None:
    # metadata is stored in the manifest: deeper than a state may be, it would make the
    # manifest one that decoding refuses as forged
    meta: Any = {"x": 1}
    for _ in range(MAX_DEPTH):
        meta = {"m": meta}
    with pytest.raises(InvalidArgumentError) as info:
        store.commit({"w": torch.ones(1)}, run="deepmeta", step=0, metadata=meta)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)
    store.commit({"w": torch.ones(1)}, run="deepmeta", step=0, metadata=meta["m"])
    assert store.resolve("deepmeta@0").metadata == meta["m"]
    assert torch.equal(store.restore("deepmeta@0")["w"], torch.ones(1))  # its manifest decodes


def test_into_deeper_than_any_stored_tree_is_refused(store: casckpt.Store) -> None:
    store.commit({"w": torch.ones(3)}, run="deepinto", step=0)
    target = torch.zeros(3)
    into: Any = {"w": target}
    for _ in range(600):
        into = {"w": into}
    with pytest.raises(RestoreTargetError) as info:
        store.restore("deepinto@0", into=into)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)
    cyclic: dict[str, Any] = {"w": target}
    cyclic["self"] = cyclic
    with pytest.raises(RestoreTargetError):
        store.restore("deepinto@0", into=cyclic)
    assert torch.equal(target, torch.zeros(3))
