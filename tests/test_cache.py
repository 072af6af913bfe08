"""The LMDB index cache is a hint: a stale entry must never make a commit skip a chunk."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import torch

import casckpt
from casckpt.cache import IndexCache


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(500, generator=g)}


def _forget_everything(store_dir: Path) -> None:
    """Remove versions, chunks and packs from the catalog, and the pack and manifest files
    (as a GC would)."""
    db = sqlite3.connect(store_dir / "catalog.db")
    with db:
        for table in ("tags", "tensors", "versions", "chunks", "packs"):
            db.execute(f"DELETE FROM {table}")
    db.close()
    for top in ("packs", "manifests"):
        for path in (store_dir / top).rglob("*"):
            if path.is_file():
                path.unlink()


def test_stale_cache_entries_are_rewritten(tmp_path: Path) -> None:
    root = tmp_path / "store"
    state = _state(0)
    with casckpt.open(root, chunk_size=4096) as store:
        first = store.commit(state, run="r", step=1)
    assert first.new_bytes == 3500 * 4
    _forget_everything(root)
    with casckpt.open(root, chunk_size=4096) as store:
        again = store.commit(state, run="r", step=2)
        # every chunk was still in the LMDB cache, yet all of them had to be written again
        assert again.new_bytes == first.new_bytes
        restored = store.restore("r@2")
        assert all(torch.equal(restored[k], state[k]) for k in state)
        assert store.check(read_data=True).ok


def test_cache_from_another_store_is_wiped(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    cache = IndexCache(path, "store-one")
    cache.put_many([(bytes(32), "ab" * 32, 8, 100, 100, 0)])
    assert len(cache) == 1
    cache.close()
    other = IndexCache(path, "store-two")
    assert len(other) == 0
    assert other.get_many([bytes(32)]) == {}
    other.close()
    same = IndexCache(path, "store-two")
    same.put_many([(b"\x01" * 32, "cd" * 32, 8, 10, 7, 1)])
    assert same.get_many([b"\x01" * 32]) == {b"\x01" * 32: ("cd" * 32, 8, 10, 7, 1)}
    same.close()


def test_unusable_cache_degrades_to_misses(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.mkdir()
    (blocker / "index").write_text("not a directory")  # LMDB cannot open a file as its dir
    with casckpt.open(tmp_path / "store", cache=blocker, chunk_size=4096) as store:
        state = _state(1)
        store.commit(state, run="r", step=1)
        second = store.commit(state, run="r", step=2)
        assert second.new_bytes == 0  # the catalog still dedups without the cache
        assert torch.equal(store.restore("r@2")["a"], state["a"])
