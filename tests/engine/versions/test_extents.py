"""The plan of a state's extents (:func:`plan_extents`): a plan made through the previous
commit's memo (its layout reused when every leaf's signature is the same) must be exactly the
plan made without one, whatever changed between the two, and read the state's bytes as they
are now."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutations import MUTATIONS, mutate, state_of

from casckpt.engine.versions.extents import ExtentSource, PackMemo, pack_limit, plan_extents
from casckpt.format.state import encode_state

_PACK = pack_limit(4 << 20)


def _read(source: ExtentSource) -> bytes:
    return bytes(source.read()) if source.nbytes else b""


def _same(got: tuple[list[Any], list[ExtentSource]], want: tuple[list[Any], list[ExtentSource]]) -> None:
    assert got[0] == want[0]
    assert [(s.nbytes, s.align, s.packed, s.digest) for s in got[1]] == \
        [(s.nbytes, s.align, s.packed, s.digest) for s in want[1]]
    assert [_read(s) for s in got[1]] == [_read(s) for s in want[1]]


@given(st.integers(0, 3), st.lists(st.tuples(st.integers(0, 14), st.integers(0, 200)), max_size=12))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_plan_through_the_memo_is_the_plan_made_afresh(seed: int, ops: list[tuple[int, int]]) -> None:
    state = state_of(seed)
    memo = None
    for op, pick in [(99, 0), *ops, (99, 0)]:  # an unchanged commit first and last
        mutate(state, op % MUTATIONS, pick)
        _, leaves = encode_state(state)
        memo = PackMemo(memo)
        _same(plan_extents(leaves, pack=_PACK, memo=memo), plan_extents(leaves, pack=_PACK))


def test_an_unchanged_state_reuses_the_layout_and_still_reads_its_bytes() -> None:
    """The layout is reused (no leaf re-decided) but the bytes are read again: a change no
    signature shows (in place) is in the plan's bytes and digests."""
    state = state_of(5)
    _, leaves = encode_state(state)
    memo = PackMemo(PackMemo())
    first = plan_extents(leaves, pack=_PACK, memo=memo)
    state["model"]["w1"].mul_(-1)
    memo = PackMemo(memo)
    again = plan_extents(leaves, pack=_PACK, memo=memo)
    assert memo._plan is not None and memo._old_plan is not None and memo._plan[1] is memo._old_plan[1]
    _same(again, plan_extents(leaves, pack=_PACK))
    assert [s.digest for s in again[1]] != [s.digest for s in first[1]]
