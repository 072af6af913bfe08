"""The plan of a state's extents (:func:`plan_extents`): a plan made through the previous
commit's memo (its layout reused when every leaf's signature is the same) must be exactly the
plan made without one, whatever changed between the two, and read the state's bytes as they
are now."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casckpt.engine.versions.extents import ExtentSource, PackMemo, pack_limit, plan_extents
from casckpt.format.state import encode_state

_PACK = pack_limit(4 << 20)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {f"w{i}": torch.randn(3 + i % 5, generator=g) for i in range(40)}
    model["big"] = torch.randn(5000, generator=g)  # over the pack limit: an extent of its own
    model["grid"] = torch.randn(6, 4, generator=g)
    model["z"] = torch.randn(4, dtype=torch.complex64, generator=g)
    base = torch.randn(64, generator=g)
    model["head"], model["tail"] = base[:16], base[16:40]  # views of one storage: a shared extent
    return {"model": model, "step": seed}


def _mutate(state: dict[str, Any], op: int, pick: int) -> None:
    """One change a training loop (or a careless caller) can make between two commits."""
    model = state["model"]
    keys = list(model)
    key, other = keys[pick % len(keys)], keys[(pick * 7 + 3) % len(keys)]
    t = model[key]
    if op == 0:
        t.add_(1)  # in place: bytes only
    elif op == 1:
        model[key] = t.clone()  # a new tensor, a new storage
    elif op == 2:
        t.data = torch.zeros(t.numel() + 1, dtype=t.dtype)  # same object, new storage and shape
    elif op == 3 and t.dtype == model[other].dtype and t.numel():
        t.set_(model[other].untyped_storage(), 0, (1,), (1,))  # same object, another leaf's storage
    elif op == 4 and t.dtype == torch.float32:
        model[key] = t.view(torch.int32)  # same bytes, another dtype
    elif op == 5 and t.numel() % 2 == 0 and t.dim() == 1:
        model[key] = t.reshape(2, -1)  # same bytes, another shape
    elif op == 6 and t.dim() == 2:
        model[key] = t.t()  # another stride: not contiguous
    elif op == 7 and t.is_complex():
        model[key] = t.conj()  # the conjugate bit flipped, no byte moved
    elif op == 8 and t.dtype == torch.float32:
        model[key] = torch._neg_view(t)  # the negative bit flipped
    elif op == 9:
        model[f"new{pick}"] = torch.full((pick % 7 + 1,), float(pick))
    elif op == 10 and len(keys) > 3:
        del model[key]
    elif op == 11:
        model[key] = model.pop(key)  # reordered: moved to the end
    elif op == 12 and model[other].numel() > 2:
        model[key] = model[other][1:]  # a view of another leaf's storage
    elif op == 13:
        t.resize_(t.numel() + 2)  # same object, resized in place
    else:
        state["step"] += 1  # a plain value: the leaves are as they were


def _read(source: ExtentSource) -> bytes:
    return bytes(source.read()) if source.nbytes else b""


def _same(got: tuple[list[Any], list[ExtentSource]], want: tuple[list[Any], list[ExtentSource]]) -> None:
    assert got[0] == want[0]
    assert [(s.nbytes, s.align, s.packed, s.digest) for s in got[1]] == \
        [(s.nbytes, s.align, s.packed, s.digest) for s in want[1]]
    assert [_read(s) for s in got[1]] == [_read(s) for s in want[1]]


@given(st.integers(0, 3), st.lists(st.tuples(st.integers(0, 14), st.integers(0, 200)), max_size=12))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_plan_through_the_memo_is_the_plan_made_afresh(seed: int, ops: list[tuple[int, int]]) -> None:
    state = _state(seed)
    memo = None
    for op, pick in [(99, 0), *ops, (99, 0)]:  # an unchanged commit first and last
        _mutate(state, op, pick)
        _, leaves = encode_state(state)
        memo = PackMemo(memo)
        _same(plan_extents(leaves, pack=_PACK, memo=memo), plan_extents(leaves, pack=_PACK))


def test_an_unchanged_state_reuses_the_layout_and_still_reads_its_bytes() -> None:
    """The layout is reused (no leaf re-decided) but the bytes are read again: a change no
    signature shows (in place) is in the plan's bytes and digests."""
    state = _state(5)
    _, leaves = encode_state(state)
    memo = PackMemo(PackMemo())
    first = plan_extents(leaves, pack=_PACK, memo=memo)
    state["model"]["w1"].mul_(-1)
    memo = PackMemo(memo)
    again = plan_extents(leaves, pack=_PACK, memo=memo)
    assert memo._plan is not None and memo._old_plan is not None and memo._plan[1] is memo._old_plan[1]
    _same(again, plan_extents(leaves, pack=_PACK))
    assert [s.digest for s in again[1]] != [s.digest for s in first[1]]
