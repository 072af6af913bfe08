"""Delta coding's base cache and keyframe policy (issue 17): what the cache keeps, ``delta_memory=0``,
keyframes placed by cost and staggered."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

import casckpt
from casckpt import config
from casckpt.catalog import schema
from casckpt.catalog.deltas import DEFAULT_DELTA_CHAIN
from casckpt.engine.memory import deltabase
from casckpt.engine.memory.deltabase import CachedChunk, ChainPolicy
from casckpt.errors import CorruptChunkError, InvalidArgumentError
from casckpt.format.codecs import (
    CODECS,
    SPARSE_BLOCK,
    Delta,
    apply_sparse,
    decode_chunk,
    sparse_delta,
    sparse_planes,
)
from casckpt.testing.internals import internals

CHUNK = 16 << 10


def _open(path: Path) -> casckpt.Store:
    return casckpt.open(path, chunk_size=CHUNK, pack_size=256 << 10)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _rows(t: torch.Tensor, g: torch.Generator, fraction: float, scale: float = 1e-2) -> torch.Tensor:
    """``t`` (2-D) with ``fraction`` of its rows nudged (at least one), as a sparse optimizer would."""
    out = t.clone()
    rows = max(1, int(t.shape[0] * fraction))
    picked = torch.randperm(t.shape[0], generator=g)[:rows]
    out[picked] += scale * torch.randn(rows, t.shape[1], generator=g)
    return out


def _every_row_block(t: torch.Tensor, g: torch.Generator, per_chunk: int) -> torch.Tensor:
    """``t`` with ``per_chunk`` rows nudged in every chunk: every chunk changes alike."""
    out = t.clone()
    rows_per_chunk = CHUNK // (t.shape[1] * t.element_size())
    for start in range(0, t.shape[0], rows_per_chunk):
        picked = start + torch.randperm(rows_per_chunk, generator=g)[:per_chunk]
        out[picked] += 1e-2 * torch.randn(per_chunk, t.shape[1], generator=g)
    return out


def _chunk_rows(store: casckpt.Store) -> dict[str, Any]:
    with internals(store).catalog.read() as conn:
        return {row.id: row for row in conn.execute(select(schema.chunks))}


# ---- delta_memory ----------------------------------------------------------------------------------


def test_delta_memory_zero_turns_delta_coding_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.settings(env={"CASCKPT_DELTA_MEMORY": "0"}).delta_memory == 0
    assert config.settings({"delta_memory": 0}, env={}).delta_memory == 0
    with pytest.raises(InvalidArgumentError, match="CASCKPT_DELTA_MEMORY"):
        config.settings(env={"CASCKPT_DELTA_MEMORY": "-1"})
    with pytest.raises(InvalidArgumentError, match="CASCKPT_CHUNK_SIZE"):  # 0 still means nothing there
        config.settings(env={"CASCKPT_CHUNK_SIZE": "0"})
    g = torch.Generator().manual_seed(1)
    table = torch.randn(256, 64, generator=g)
    kept = []
    monkeypatch.setenv("CASCKPT_DELTA_MEMORY", "0")
    with _open(tmp_path / "s") as store:
        assert store.ops.delta_chain() > 0  # the store's policy is untouched: this process codes no deltas
        for step in range(4):
            kept.append(table.clone())
            store.commit({"t": table}, run="r", step=step)
            table = _rows(table, g, 0.01)
        assert store.ops.stats().delta_chunks == 0 and internals(store).context.bases.held == 0
        for step, want in enumerate(kept):
            assert _bits(store.restore(f"r@{step}")["t"]) == _bits(want)
    monkeypatch.delenv("CASCKPT_DELTA_MEMORY")
    with _open(tmp_path / "s") as store:  # the same store, delta coding on again
        for step in range(4, 7):
            store.commit({"t": table}, run="r", step=step)
            table = _rows(table, g, 0.01)
        assert store.ops.stats().delta_chunks > 0


def test_delta_memory_default_is_a_small_fraction_of_ram() -> None:
    memory = config.Settings().delta_memory
    assert 0 < memory <= min(1 << 30, config._ram() // 16)


# ---- what the base cache keeps ------------------------------------------------------------------


def test_a_first_commit_keeps_full_copies_only_up_to_its_allowance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deltabase, "FIRST_FULL", 4 * CHUNK)
    monkeypatch.setattr(deltabase, "SAMPLE", 1 << 10)
    g = torch.Generator().manual_seed(2)
    table = torch.randn(64 * CHUNK // 256, 64, generator=g)  # 64 chunks of fp32 rows
    flags = torch.randint(0, 255, (8 * CHUNK,), generator=g, dtype=torch.uint8)  # 1-byte elements
    kept = []
    with _open(tmp_path / "s") as store:
        store.ops.set_delta_policy("max")  # the cache's allowance, not balanced's tighter bound
        bases = internals(store).context.bases
        for step in range(4):
            kept.append(table.clone())
            version = store.commit({"t": table, "flags": flags}, run="r", step=step)
            if step == 0:  # 4 chunks in full, a 1 KiB sample of the other 60, nothing of the uint8 ones
                assert bases.held == 4 * CHUNK + 60 * (1 << 10)
            if step == 1:  # deltas on the 4 full copies; full copies of the rest, the samples promising
                assert store.show(version.id).delta_chunks == 4
                assert bases.held == 64 * CHUNK
            if step >= 2:  # (the 4 chains started first may take staggered keyframes from step 3 on)
                assert store.show(version.id).delta_chunks >= 60
                assert version.stored_bytes < 0.2 * version.new_bytes
            table = _every_row_block(table, g, per_chunk=1)
            flags = flags.clone()
            flags[: 8 * CHUNK : 97] += 1
        for step, want in enumerate(kept):
            assert _bits(store.restore(f"r@{step}")["t"]) == _bits(want)


def test_chunks_whose_deltas_do_not_pay_drop_back_to_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deltabase, "SAMPLE", 1 << 10)
    g = torch.Generator().manual_seed(3)
    with _open(tmp_path / "s") as store:
        bases = internals(store).context.bases
        store.commit({"t": torch.randn(32 * CHUNK // 4, generator=g)}, run="r", step=0)
        assert bases.held == 32 * CHUNK  # small enough to try in full
        store.commit({"t": torch.randn(32 * CHUNK // 4, generator=g)}, run="r", step=1)
        assert bases.held == 32 * (1 << 10)  # every value new: no delta pays
        lesson = bases.lessons("r").get("t")
        assert lesson is not None and lesson.delta is not None and lesson.delta > 0.6
        store.commit({"t": torch.randn(32 * CHUNK // 4, generator=g)}, run="r", step=2)
        # learned: no delta is tried, no sample kept, but for the chunks drawn to re-try next time
        assert bases.held < 32 * (1 << 10)
        assert store.ops.stats().delta_chunks == 0


# ---- keyframes by cost ---------------------------------------------------------------------------


def chain_within(policy: ChainPolicy, levels: list[tuple[int, int, int]], key_bytes: int) -> bool:
    """Whether a stored chain is within ``policy`` as the encoder extends it: ``levels`` are its
    deltas' (raw length, stored length, codec id), keyframe first; ``key_bytes`` the keyframe's
    stored length."""
    state: CachedChunk | None = CachedChunk(memoryview(b""), 0, key_bytes=key_bytes)
    for raw_len, stored, codec in levels:
        sparse = CODECS[codec].delta is Delta.SPARSE
        state = policy.extend(state, raw_len, stored, sparse) if state is not None else None
    return state is not None


def _check_chains(store: casckpt.Store, policy: ChainPolicy) -> int:
    """Every stored chain is within ``policy``; returns the longest."""
    rows = _chunk_rows(store)
    longest = 0
    for row in rows.values():
        levels, node = [], row
        while node.base_id is not None:
            levels.append((node.raw_len, node.stored_len, node.codec))
            node = rows[node.base_id]
        assert chain_within(policy, levels[::-1], node.stored_len), (row.id, levels, node.stored_len)
        longest = max(longest, len(levels))
    return longest


@pytest.mark.parametrize("examples", [5, pytest.param(12, marks=pytest.mark.slow)])
def test_keyframes_by_cost_keep_every_chain_within_the_policy(
        tmp_path_factory: pytest.TempPathFactory, examples: int) -> None:
    @given(updates=st.lists(st.sampled_from([0.002, 0.02, 0.2, 1.0]), min_size=6, max_size=14),
           scale=st.sampled_from([1e-4, 1e-2]), seed=st.integers(0, 1000))
    @settings(max_examples=examples, deadline=None)
    def within(updates: list[float], scale: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(24 * CHUNK // 256, 64, generator=g)
        half = torch.randn(6 * CHUNK // 2, generator=g).bfloat16()
        kept = []
        with _open(tmp_path_factory.mktemp("cost")) as store:
            for step, fraction in enumerate(updates):
                kept.append((table.clone(), half.clone()))
                store.commit({"t": table, "h": half}, run="r", step=step)
                table = _rows(table, g, fraction, scale)
                half = (half.float() * (1 + scale * torch.randn(half.shape, generator=g))).bfloat16()
            assert _check_chains(store, ChainPolicy(DEFAULT_DELTA_CHAIN, by_cost=True)) <= DEFAULT_DELTA_CHAIN
            for step, (t, h) in enumerate(kept):
                got = store.restore(f"r@{step}")
                assert _bits(got["t"]) == _bits(t) and _bits(got["h"]) == _bits(h)
            assert store.ops.check(read_data=True).ok

    within()


def test_chunks_reaching_their_bound_together_take_keyframes_over_several_commits(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    chunks = 48
    table = torch.randn(chunks * CHUNK // 256, 64, generator=g)
    kept, counts = [], []
    with _open(tmp_path / "s") as store:
        for step in range(14):
            kept.append(table.clone())
            version = store.commit({"t": table}, run="r", step=step)
            counts.append(store.show(version.id).delta_chunks)
            table = _every_row_block(table, g, per_chunk=2)  # every chain grows alike
        # after the first commit every commit delta-codes most chunks: keyframes are spread out ...
        assert counts[0] == 0 and all(c >= chunks // 4 for c in counts[1:]), counts
        # ... yet chains do end (the cost bound is reached within these commits)
        assert any(c < chunks for c in counts[2:]), counts
        assert _check_chains(store, ChainPolicy(DEFAULT_DELTA_CHAIN, by_cost=True)) >= 2
        for step, want in enumerate(kept):
            assert _bits(store.restore(f"r@{step}")["t"]) == _bits(want)


def test_a_chain_length_that_was_set_is_a_fixed_depth(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    table = torch.randn(8 * CHUNK // 256, 64, generator=g)
    with _open(tmp_path / "s") as store:
        store.ops.set_delta_chain(6)
        counts = []
        for step in range(8):
            counts.append(store.show(store.commit({"t": table}, run="r", step=step).id).delta_chunks)
            table = _every_row_block(table, g, per_chunk=1)
        assert counts == [0, 8, 8, 8, 8, 8, 8, 0]  # keyframes at step 7, all at once: a fixed depth


def test_chain_policy_bounds() -> None:
    by_cost = ChainPolicy(32, by_cost=True)
    # a delta of 1% of the chunk costs 0.11 keyframe restores: four fit under 0.5, five do not
    dense, sparse = 7, 9  # xor-group4-zstd, xor-sparse-zstd
    assert chain_within(by_cost, [(1000, 10, dense)] * 4, 1000)
    assert not chain_within(by_cost, [(1000, 10, dense)] * 5, 1000)
    # sparse deltas patch only what changed: 0.03 each, 16 fit
    assert chain_within(by_cost, [(1000, 10, sparse)] * 16, 1000)
    assert not chain_within(by_cost, [(1000, 10, sparse)] * 17, 1000)
    assert not chain_within(by_cost, [(1000, 1, sparse)] * 33, 1000)  # the depth bound
    # a delta of 45% costs 0.55: none fits; deltas adding up past the keyframe's bytes end a chain
    assert not chain_within(by_cost, [(1000, 450, dense)], 1000)
    assert not chain_within(by_cost, [(1000, 300, sparse)], 250)
    fixed = ChainPolicy(3)
    assert chain_within(fixed, [(1000, 450, dense)] * 3, 1000)
    assert not chain_within(fixed, [(1000, 1, sparse)] * 4, 1000)


# ---- sparse deltas ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 64), width=st.sampled_from([1, 2, 4, 8]),
       changed=st.lists(st.integers(0, 4095), max_size=40), seed=st.integers(0, 1 << 16))
def test_sparse_deltas_round_trip_and_touch_only_changed_blocks(blocks: int, width: int, changed: list[int],
                                                                seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (blocks * SPARSE_BLOCK,), generator=g, dtype=torch.uint8).numpy()
    data = base.copy()
    for at in changed:
        data[at % len(data)] ^= 1 + at % 255
    encoded = sparse_delta(data.data, base.data, width, 1, 1.0)
    assert encoded is not None
    codec, payload = encoded
    assert codec.delta is Delta.SPARSE
    index, xor = sparse_planes(payload, len(data))
    assert np.flatnonzero((data != base).reshape(-1, SPARSE_BLOCK).any(axis=1)).tolist() == index.tolist()
    assert bytes(decode_chunk(codec.id, payload, len(data), base.tobytes())) == data.tobytes()
    assert apply_sparse(base.copy(), index, xor).tobytes() == data.tobytes()


def test_sparse_deltas_refuse_dense_changes_and_malformed_payloads() -> None:
    base = np.zeros(64 * SPARSE_BLOCK, dtype=np.uint8)
    data = base.copy()
    data[::SPARSE_BLOCK] = 1  # every block changed
    assert sparse_delta(data.data, base.data, 4, 1, 0.25) is None
    assert sparse_delta(data[:100].data, base[:100].data, 4, 1, 1.0) is None  # not whole blocks
    data = base.copy()
    data[5] = 7
    encoded = sparse_delta(data.data, base.data, 4, 1, 0.25)
    assert encoded is not None
    payload = encoded[1]
    with pytest.raises(CorruptChunkError):
        sparse_planes(payload, 32 * SPARSE_BLOCK + 1)  # another length
    head = zstandard.ZstdCompressor().compress(struct.pack("<BBHI", 4, 6, 0, 2) + struct.pack("<II", 3, 0)
                                               + bytes(2 * SPARSE_BLOCK))
    with pytest.raises(CorruptChunkError, match="out of order"):
        sparse_planes(head, 64 * SPARSE_BLOCK)  # block 3 twice
    with pytest.raises(CorruptChunkError, match="out of order"):
        sparse_planes(zstandard.ZstdCompressor().compress(struct.pack("<BBHI", 4, 6, 0, 1) + struct.pack(
            "<I", 64) + bytes(SPARSE_BLOCK)), 64 * SPARSE_BLOCK)  # past the end
    with pytest.raises(CorruptChunkError):
        sparse_planes(b"not zstd", 64 * SPARSE_BLOCK)


def test_an_embedding_table_stores_long_cheap_chains_of_sparse_deltas(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    table = torch.randn(32 * CHUNK // 256, 64, generator=g)
    kept = []
    with _open(tmp_path / "s") as store:
        for step in range(14):
            kept.append(table.clone())
            store.commit({"t": table}, run="r", step=step)
            table = _rows(table, g, 0.005)
        rows = _chunk_rows(store)
        assert {CODECS[r.codec].delta for r in rows.values() if r.base_id is not None} == {Delta.SPARSE}
        # within the default policy's bound (1.2x a keyframe), yet longer than dense chains
        assert _check_chains(store, ChainPolicy(DEFAULT_DELTA_CHAIN, by_cost=True, restore_bound=0.2)) >= 3
        for step, want in enumerate(kept):
            assert _bits(store.restore(f"r@{step}")["t"]) == _bits(want)
            assert _bits(store.load_tensor(f"r@{step}", "t")) == _bits(want)
        assert store.ops.check(read_data=True).ok
