"""``restore(into=...)``: every target is checked before any is written (issue 13).

A stride-0 target used to escape as torch's raw RuntimeError, and two targets
viewing the same memory (not as stored) were filled concurrently and failed
chunk verification as a CorruptChunkError blaming a healthy pack — or
silently came back wrong. Targets sharing memory exactly as the stored
tensors share it (tied weights, views of one tensor) keep working.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import casckpt
from casckpt.errors import RestoreTargetError

N = 3000  # 12 KB of float32: three chunks of 4 KiB, filled concurrently


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=4096) as s:
        s.commit({"a": torch.arange(N, dtype=torch.float32), "b": torch.arange(N, dtype=torch.float32) + 0.5,
                  "c": np.arange(10, dtype=np.float64)}, run="r", step=0)
        yield s
        assert s.ops.check(read_data=True).ok


def _refused(store: casckpt.Store, into: dict[str, Any], *words: str) -> None:
    """Restore into ``into``, expect RestoreTargetError, and check no target was written."""
    before = {k: (v.clone() if isinstance(v, torch.Tensor) and v.layout == torch.strided
                  and not v.is_nested and v.device.type != "meta" else None) for k, v in into.items()}
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into=into)
    message = str(info.value)
    assert "Nothing was restored" in message and "into=None" in message, message
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    for key, old in before.items():
        if old is not None:
            assert torch.equal(into[key], old), f"{key!r} was written by a refused restore"


def test_expanded_target_is_refused_before_anything_is_written(store: casckpt.Store) -> None:
    # used to fail in the middle of the restore with torch's "more than one element of the
    # written-to tensor refers to a single memory location"
    into = {"a": torch.zeros(N), "b": torch.zeros(1).expand(N), "c": np.zeros(10)}
    _refused(store, into, "'b'", "share memory", "expand()")
    assert not into["c"].any()


def test_expanded_target_inside_a_module_is_refused(store: casckpt.Store) -> None:
    store.commit({"weight": torch.ones(3, 4), "bias": torch.ones(3)}, run="lin", step=0)
    module = torch.nn.Linear(4, 3)
    module.bias.data = torch.zeros(1).expand(3)
    before = module.weight.detach().clone()
    with pytest.raises(RestoreTargetError) as info:
        store.restore("lin@0", into=module)
    assert "'bias'" in str(info.value)
    assert torch.equal(module.weight.detach(), before)


def _overlapping(kind: str) -> dict[str, Any]:
    if kind == "same-tensor":
        t = torch.zeros(N)
        return {"a": t, "b": t}
    if kind == "overlapping-slices":
        base = torch.zeros(2 * N)
        return {"a": base[:N], "b": base[N // 3: N // 3 + N]}
    if kind == "strided-interleaved":
        base = torch.zeros(2 * N)  # a: every element of the first half, b: every other one
        return {"a": base[:N], "b": base[::2]}
    assert kind == "from-numpy"
    backing = np.zeros(2 * N, dtype=np.float32)
    return {"a": torch.from_numpy(backing[:N]), "b": torch.from_numpy(backing[100: 100 + N])}


@pytest.mark.parametrize("kind", ["same-tensor", "overlapping-slices", "strided-interleaved", "from-numpy"])
def test_targets_sharing_memory_unlike_the_stored_tensors_are_refused(store: casckpt.Store,
                                                                      kind: str) -> None:
    # used to fill both in place at once: a CorruptChunkError blaming a healthy pack, or two
    # tensors silently restored wrong
    into = {**_overlapping(kind), "c": np.zeros(10)}
    _refused(store, into, "'a'", "'b'", "share memory", ".clone()")
    assert not into["c"].any()


def test_numpy_targets_sharing_memory_are_refused(store: casckpt.Store) -> None:
    store.commit({"x": np.arange(8.0), "y": np.arange(8.0) * 2}, run="np", step=0)
    backing = np.zeros(12)
    with pytest.raises(RestoreTargetError):
        store.restore("np@0", into={"x": backing[:8], "y": backing[4:]})
    assert not backing.any()
    reversed_view = backing[::-1]  # negative strides, disjoint halves: fine
    out = store.restore("np@0", into={"x": reversed_view[:8], "y": np.zeros(8)})
    assert np.array_equal(out["x"], np.arange(8.0))


# -- sharing memory as stored: unchanged -----------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_restore_into_a_tied_module(store: casckpt.Store) -> None:
    saved = _Tied()
    store.commit({"model": saved.state_dict()}, run="tied", step=0)
    fresh = _Tied()
    store.restore("tied@0", into={"model": fresh})
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, saved.embed.weight)


def test_equal_tensors_stored_apart_restore_into_tied_weights(store: casckpt.Store) -> None:
    # a checkpoint that did not record the tie (the same bytes twice) still loads into a tied
    # model: both names receive the same bytes
    w = torch.randn(50, 8)
    store.commit({"model": {"embed.weight": w, "head.weight": w.clone()}}, run="untied", step=0)
    fresh = _Tied()
    store.restore("untied@0", into={"model": fresh})
    assert torch.equal(fresh.embed.weight, w)
    store.commit({"model": {"embed.weight": w, "head.weight": w + 1}}, run="untied", step=1)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("untied@1", into={"model": _Tied()})
    assert "'model.embed.weight'" in str(info.value) and "'model.head.weight'" in str(info.value)


@pytest.mark.parametrize("views", [
    lambda base: {"a": base[4:60], "b": base[20:100], "c": base.view(torch.int32)[30:40]},
    lambda base: {"m": base.view(10, 10), "t": base.view(10, 10).t(), "row": base[30:40]},
    lambda base: {"same": base, "again": base},
], ids=["overlapping-slices", "transposed", "same-tensor"])
def test_views_of_one_stored_tensor_restore_into_matching_views(
    store: casckpt.Store, views: Callable[[torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    base = torch.randn(100)
    state = views(base)
    store.commit(state, run="views", step=0)
    target = torch.zeros(100)
    into = views(target)
    out = store.restore("views@0", into=into)
    for key, value in state.items():
        assert out[key] is into[key] and torch.equal(out[key], value), key


def test_disjoint_columns_of_one_matrix_are_fine(store: casckpt.Store) -> None:
    # their byte ranges interleave, but no element is shared: not refused
    q, k = torch.randn(4, 3), torch.randn(4, 3)
    store.commit({"q": q, "k": k}, run="qk", step=0)
    fused = torch.zeros(4, 6)
    store.restore("qk@0", into={"q": fused[:, :3], "k": fused[:, 3:]})
    assert torch.equal(fused, torch.cat([q, k], dim=1))


# -- targets that cannot be written -----------------------------------------------------------


def _unwritable(kind: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "meta":
            return torch.empty(N, device="meta")
        if kind == "sparse":
            return torch.zeros(N).to_sparse()
        if kind == "nested":
            return torch.nested.nested_tensor([torch.zeros(N)])
        if kind == "quantized":
            return torch.quantize_per_tensor(torch.zeros(N), 0.1, 0, torch.quint8)
        if kind == "inference":
            with torch.inference_mode():
                return torch.zeros(2 * N)[::2]
    assert kind == "read-only"
    array = np.zeros(10)
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(("kind", "word"), [
    ("meta", "meta device"),  # used to be "restored" silently: a meta tensor holds nothing
    ("sparse", "sparse"),  # raw RuntimeError from copy_
    ("nested", "nested"),  # raw RuntimeError from .shape
    ("quantized", "quantized"),
    ("inference", "inference mode"),  # raw RuntimeError after other targets were written
    ("read-only", "read-only"),  # raw ValueError from np.copyto
])
def test_targets_that_cannot_be_written_are_refused(store: casckpt.Store, kind: str, word: str) -> None:
    into = {"a": torch.zeros(N), "b": torch.zeros(N), "c": np.zeros(10)}
    into["c" if kind == "read-only" else "b"] = _unwritable(kind)
    _refused(store, into, word)
    assert not into["a"].any()
