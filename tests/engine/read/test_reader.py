"""The reader: delta chains decoded bit-exact on the fast path, damage anywhere in a chain found,
and the reader against a damaged catalog: every chunk record is checked before it sizes a buffer
or a read, so a forged number, type or id is a CorruptChunkError, never another exception.

The damaged-catalog cases were found by the fuzz campaign (benchmarks/fuzz.py, target "catalog");
each changes one column of one chunk row through SQL, as the campaign does.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.engine.read import deltachains
from casckpt.errors import CorruptChunkError
from casckpt.format.codecs import CODECS, Delta, sparse_planes
from casckpt.format.pack import ENTRY_HEADER_SIZE
from casckpt.testing.internals import internals

CHUNK = 4096
SPARSE_CODEC = next(cid for cid, codec in CODECS.items() if codec.delta is Delta.SPARSE)


def _build(root: Path) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4 * 1024, generator=g)
    with casckpt.open(root, chunk_size=CHUNK, pack_size=64 << 10, workers=2) as store:
        store.ops.set_delta_chain(2)  # a fixed depth: by cost, dense fp32 deltas this size are not kept
        for step in (1, 2, 3):  # steps 2 and 3: delta-coded, chains of two
            store.commit({"w": w}, run="r", step=step)
            w = w * (1 + 1e-4 * torch.randn(w.shape, generator=g))
        assert store.ops.stats().longest_chain == 2


def _sql(root: Path, *statements: str) -> None:
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        for statement in statements:
            db.execute(statement)


def _delta(column: str, value: str) -> str:
    return f"UPDATE chunks SET {column} = {value} WHERE rowid = (SELECT min(rowid) FROM chunks " \
        "WHERE base_id IS NOT NULL)"


def _plain(column: str, value: str) -> str:
    return f"UPDATE chunks SET {column} = {value} WHERE rowid = (SELECT max(rowid) FROM chunks " \
        "WHERE base_id IS NULL AND id NOT IN (SELECT id FROM tree_nodes))"  # tensor data


DAMAGE: dict[str, Callable[[], list[str]]] = {
    # a base naming its own dependent: the chain loops (was a RecursionError)
    "base_cycle": lambda: [
        "UPDATE chunks SET base_id = (SELECT id FROM chunks c WHERE c.base_id IS NOT NULL AND "
        "c.base_id = chunks.id LIMIT 1) WHERE base_id IS NULL AND EXISTS (SELECT 1 FROM chunks c "
        "WHERE c.base_id = chunks.id)",
        "UPDATE chunks SET codec = 7 WHERE base_id IS NOT NULL AND codec < 5"],
    "base_id_not_hex": lambda: [_delta("base_id", "'128'")],  # was a ValueError from bytes.fromhex
    "base_id_number": lambda: [_delta("base_id", "7")],
    "stored_len_huge": lambda: [_plain("stored_len", str(1 << 62))],  # would allocate 4 EiB
    "stored_len_huge_delta": lambda: [_delta("stored_len", str(1 << 62))],
    "offset_float": lambda: [_plain("offset", "1.5")],  # was a TypeError from preadv
    "offset_text": lambda: [_plain("offset", "'abc'")],
    # the keyframe under a chain of two: the retry that verifies every level did not locate it
    # again and failed with a KeyError
    "keyframe_under_two_deltas": lambda: [
        "UPDATE chunks SET codec = 99 WHERE id IN (SELECT b.base_id FROM chunks d JOIN chunks b "
        "ON d.base_id = b.id WHERE b.base_id IS NOT NULL)"],
    "raw_len_huge_base": lambda: [  # a base of another length than its delta: would allocate it
        "UPDATE chunks SET raw_len = 4611686018427387904, stored_len = 4611686018427387904 "
        "WHERE id IN (SELECT base_id FROM chunks WHERE base_id IS NOT NULL)"],
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_chunk_record_is_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "store"
    _build(root)
    _sql(root, *DAMAGE[name]())
    with casckpt.open(root, create=False, workers=2) as store:
        with pytest.raises(CorruptChunkError):
            store.restore("r@3")


# ---- delta chains ---------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _changed(t: torch.Tensor, g: torch.Generator, fraction: float) -> torch.Tensor:
    """``t`` with ``fraction`` of its elements moved a little (a few rows: sparse; all: dense)."""
    mask = torch.rand(t.shape, generator=g) < fraction
    if t.is_floating_point():
        moved = (t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=g))).to(t.dtype)
    else:
        moved = t + torch.randint(1, 3, t.shape, generator=g, dtype=t.dtype)
    return torch.where(mask, moved, t)


def _step(state: dict[str, torch.Tensor], kinds: tuple[str, str], g: torch.Generator,
          ) -> dict[str, torch.Tensor]:
    """The next state: each tensor changed in a few rows, densely, not at all, or set to the other's
    previous value (then its chunks are the other's parent chunks: a base that is itself wanted,
    or shared by two deltas)."""
    out = {}
    for (name, t), kind in zip(state.items(), kinds, strict=True):
        other = state["b" if name == "a" else "a"]
        out[name] = {"rows": lambda t=t: _changed(t, g, 0.003), "dense": lambda t=t: _changed(t, g, 1.0),
                     "same": lambda t=t: t.clone(), "copy": lambda o=other: o.clone()}[kind]()
    return out


def _no_second_pass(*_: object) -> int:
    raise AssertionError("the fast path decoded a chain wrongly: the verifying pass ran")


def test_random_delta_chains_restore_bit_exact_on_the_fast_path(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    kinds = st.sampled_from(["rows", "rows", "dense", "same", "copy"])

    @given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32]),
           policy=st.sampled_from(["max", 2, 4, 6]), steps=st.lists(st.tuples(kinds, kinds), min_size=1,
                                                                     max_size=7),
           window=st.sampled_from([CHUNK, 3 * CHUNK, deltachains.DELTA_WINDOW]), seed=st.integers(0, 1000))
    @settings(max_examples=10, deadline=None)
    def round_trips(dtype: torch.dtype, policy: str | int, steps: list[tuple[str, str]], window: int,
                    seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        size = 4 * CHUNK // dtype.itemsize
        state = {name: (torch.randn(size, generator=g) * 100).to(dtype) for name in ("a", "b")}
        kept = []
        with casckpt.open(tmp_path_factory.mktemp("chains"), chunk_size=CHUNK, pack_size=64 << 10,
                          workers=2) as store, pytest.MonkeyPatch.context() as mp:
            if isinstance(policy, int):
                store.ops.set_delta_chain(policy)
            else:
                store.ops.set_delta_policy(policy)
            for step, kind in enumerate([("same", "same"), *steps]):
                state = _step(state, kind, g)
                kept.append({k: v.clone() for k, v in state.items()})
                store.commit(state, run="r", step=step)
            mp.setattr(deltachains, "DELTA_WINDOW", window)  # small: bases shared across windows
            mp.setattr(deltachains.DeltaReader, "_decode_levels", _no_second_pass)
            for step, want in enumerate(kept):
                got = store.restore(f"r@{step}")
                assert all(_bits(got[k]) == _bits(v) for k, v in want.items()), step
                assert _bits(store.load_tensor(f"r@{step}", "a")) == _bits(want["a"])
            assert store.ops.check(read_data=True).ok

    round_trips()


def _sparse_chain(root: Path, g: torch.Generator, **kwargs: Any) -> list[torch.Tensor]:
    """Five versions of an embedding-like table, four sparse deltas deep at the last."""
    table = torch.randn(16 * CHUNK // 256, 64, generator=g)
    kept = []
    with casckpt.open(root, chunk_size=CHUNK, pack_size=64 << 10, workers=2, **kwargs) as store:
        store.ops.set_delta_chain(4)
        for step in range(5):
            kept.append(table.clone())
            store.commit({"t": table}, run="r", step=step)
            rows = torch.arange(0, table.shape[0], 16) + int(torch.randint(0, 16, (1,), generator=g))
            table = table.clone()  # one row of each chunk changed
            table[rows] += 1e-3 * torch.randn(len(rows), 64, generator=g)
        assert store.show("r@4").longest_chain == 4
    return kept


def _mid_chain_base(root: Path) -> tuple[str, str, int]:
    """A sparse delta that is itself the base of another delta: (chunk id, pack id, offset)."""
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        row = db.execute("SELECT d.id, d.pack_id, d.\"offset\" FROM chunks d JOIN chunks u "
                         "ON u.base_id = d.id WHERE d.base_id IS NOT NULL AND d.codec = ? LIMIT 1",
                         (SPARSE_CODEC,)).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def _flip(pack: Path, offset: int) -> None:
    data = bytearray(pack.read_bytes())
    data[offset + ENTRY_HEADER_SIZE + 7] ^= 0x40
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(data))


def test_a_corrupt_base_in_the_middle_of_a_chain_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "s"
    kept = _sparse_chain(root, torch.Generator().manual_seed(11))
    chunk, pack, offset = _mid_chain_base(root)
    _flip(next(p for p in root.rglob(f"{pack}*") if p.is_file()), offset)
    with casckpt.open(root, create=False, workers=2) as store:
        with pytest.raises(CorruptChunkError):
            store.restore("r@4")
        assert _bits(store.restore("r@0")["t"]) == _bits(kept[0])  # the keyframe's version is whole
        report = store.ops.check(read_data=True)
        named = [p for p in report.problems if p.subject == chunk and "delta-coded on it" in p.detail]
        assert named and "r@4" in named[0].detail


def test_with_copies_a_corrupt_base_in_the_middle_of_a_chain_is_repaired(tmp_path: Path) -> None:
    root = tmp_path / "s"
    copies: dict[str, Any] = {"blobs": [str(tmp_path / "a"), str(tmp_path / "b")],
                              "redundancy": "replicate:2"}
    kept = _sparse_chain(root, torch.Generator().manual_seed(12), **copies)
    _, pack, offset = _mid_chain_base(root)
    with casckpt.open(root, create=False, workers=2, **copies) as store:
        for where in ("a", "b"):  # one of the two is the copy reads go to first
            _flip(next(p for p in (tmp_path / where).rglob(f"{pack}*") if p.is_file()), offset)
            internals(store).packs.layouts.forget(pack)
            assert _bits(store.restore("r@4")["t"]) == _bits(kept[4])  # from the good copy
            report = store.ops.check(read_data=True)  # a bad copy left is found; no chunk is corrupt
            assert all(p.kind in ("pack", "shard") for p in report.problems), report.problems
            store.ops.repair()
            assert store.ops.check(read_data=True).ok


def _flip_silently(root: Path, chunk: str, pack: Path, offset: int) -> None:
    """Flip a bit of ``chunk``'s sparse delta payload where the payload still decodes, to other
    XOR bytes: damage that only checking the decoded chunk against its id finds."""
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        stored_len, raw_len = db.execute("SELECT stored_len, raw_len FROM chunks WHERE id = ?",
                                         (chunk,)).fetchone()
    data = bytearray(pack.read_bytes())
    start = offset + ENTRY_HEADER_SIZE
    payload = bytes(data[start : start + stored_len])
    index, blocks = sparse_planes(payload, raw_len)
    for at in range(stored_len):
        flipped = bytearray(payload)
        flipped[at] ^= 0x40
        try:
            got_index, got_blocks = sparse_planes(bytes(flipped), raw_len)
        except CorruptChunkError:
            continue
        if np.array_equal(got_index, index) and not np.array_equal(got_blocks, blocks):
            break
    else:
        pytest.fail("no bit of the payload decodes to other bytes")
    data[start + at] ^= 0x40
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(data))


def test_a_mid_chain_delta_that_decodes_to_wrong_bytes_is_named_by_the_restore(tmp_path: Path) -> None:
    """The verifying pass checks every level of a chain, not only its end: the chunk a restore
    names is the damaged base, not the wanted chunk decoded through it."""
    root = tmp_path / "s"
    _sparse_chain(root, torch.Generator().manual_seed(13))
    chunk, pack, offset = _mid_chain_base(root)
    _flip_silently(root, chunk, next(p for p in root.rglob(f"{pack}*") if p.is_file()), offset)
    with casckpt.open(root, create=False, workers=2) as store, pytest.raises(CorruptChunkError) as err:
        store.restore("r@4")
    assert err.value.chunk_id == chunk, str(err.value)


@pytest.mark.parametrize("where", ["a", "b"])  # one of the two is the copy reads go to first
def test_with_copies_a_mid_chain_delta_that_decodes_to_wrong_bytes_is_read_from_the_good_copy(
        tmp_path: Path, where: str) -> None:
    """Only the id check at the damaged base's own level finds the pack to reconstruct: checked
    at the end of the chain only, the wanted chunk's pack would be reconstructed, to no avail."""
    root = tmp_path / "s"
    copies: dict[str, Any] = {"blobs": [str(tmp_path / "a"), str(tmp_path / "b")],
                              "redundancy": "replicate:2"}
    kept = _sparse_chain(root, torch.Generator().manual_seed(14), **copies)
    chunk, pack, offset = _mid_chain_base(root)
    _flip_silently(root, chunk, next(p for p in (tmp_path / where).rglob(f"{pack}*") if p.is_file()), offset)
    with casckpt.open(root, create=False, workers=2, **copies) as store:
        assert _bits(store.restore("r@4")["t"]) == _bits(kept[4])


def test_a_base_deltas_of_two_windows_need_is_read_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tensors equal at one step and then changed in different rows: their sparse deltas
    share every base chunk, one wanted chunk per window. Each base is read once and kept for
    the later window (it was read and decoded again for each window that needed it)."""
    chunk = 4096
    reads: dict[bytes, int] = {}
    read_located = deltachains.read_located

    def counting(ctx: Any, targets: Any, *args: Any, **kwargs: Any) -> int:
        for cid in targets:
            reads[cid] = reads.get(cid, 0) + 1
        return read_located(ctx, targets, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(deltachains, "read_located", counting)
    w = torch.randn(16 * chunk // 256, 64, generator=torch.Generator().manual_seed(0))
    with casckpt.open(tmp_path / "s", chunk_size=chunk, pack_size=64 << 10, workers=2) as store:
        store.ops.set_delta_chain(4)
        store.commit({"a": w, "b": w.clone()}, run="r", step=0)
        a, b = w.clone(), w.clone()
        a[3::16] += 1e-3
        b[9::16] += 1e-3
        store.commit({"a": a, "b": b}, run="r", step=1)
        assert store.show("r@1").longest_chain >= 1
        monkeypatch.setattr(deltachains, "DELTA_WINDOW", chunk)  # a window per wanted chunk
        got = store.restore("r@1")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert reads and max(reads.values()) == 1, sorted(reads.values())
