"""The LMDB index cache is a hint: a stale entry must never make a commit skip a chunk."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest
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
        assert store.ops.check(read_data=True).ok


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


def test_caches_of_one_path_in_a_process_share_one_lmdb_environment(tmp_path: Path) -> None:
    # LMDB forbids opening an environment twice in a process: closing one handle drops the
    # process's lock, the next process to open it resets the lock table, and writers deadlock
    # (seen as concurrent creation hanging: threads of two processes each opening the store)
    path = tmp_path / "cache"
    first, second = IndexCache(path, "s"), IndexCache(path / "." / "", "s")
    assert len(first) == len(second) == 0  # opened on first use
    assert first._env is not None and first._env is second._env
    first.put_many([(b"\x02" * 32, "ab" * 32, 0, 4, 4, 0)])
    first.close()
    assert second.get_many([b"\x02" * 32])  # still open: the other cache uses it
    third = IndexCache(path, "s")
    assert not third.get_many([b"\x09" * 32]) and third._env is second._env
    second.close()
    third.close()
    fresh = IndexCache(path, "s")
    assert fresh.get_many([b"\x02" * 32])  # reopened once every user had closed it
    fresh.close()


def test_a_forked_child_never_uses_its_parents_environment(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    parent = IndexCache(path, "s")
    parent.put_many([(b"\x03" * 32, "ab" * 32, 0, 4, 4, 0)])
    pid = os.fork()
    if pid == 0:  # LMDB: a child must not use its parent's environment; py-lmdb refuses a
        code = 1  # second one on the same path, so the child runs without a cache
        try:
            child = IndexCache(path, "s")
            code = 0 if child._env is None and child.get_many([b"\x03" * 32]) == {} else 2
            child.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.get_many([b"\x03" * 32])  # the child's close left the parent's handle alone
    parent.close()


def test_many_threads_open_one_store_and_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    casckpt.open(root, chunk_size=4096).close()
    barrier, errors = threading.Barrier(8), []

    def one(step: int) -> None:
        barrier.wait()
        try:
            for _ in range(3):
                with casckpt.open(root) as store:
                    store.commit({"t": torch.full((2048,), float(step))}, run=f"r{step}", step=_)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "opening one store from many threads hung"
    assert not errors, errors
    # every handle had the cache: none found it "already open in this process" and went without
    assert "unusable" not in caplog.text
    with casckpt.open(root) as store:
        assert len(store.log()) == 24 and store.ops.check().ok
