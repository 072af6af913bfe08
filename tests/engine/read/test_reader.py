"""The reader against a damaged catalog: every chunk record is checked before it sizes a buffer
or a read, so a forged number, type or id is a CorruptChunkError, never another exception.

Found by the fuzz campaign (benchmarks/fuzz.py, target "catalog"); each case changes one column of
one chunk row through SQL, as the campaign does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.errors import CorruptChunkError

CHUNK = 4096


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
