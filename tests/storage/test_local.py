"""LocalBlobStore passes the BlobStore conformance suite, plain and behind the retry wrapper."""

from __future__ import annotations

from pathlib import Path

from casckpt.storage import BlobStore, LocalBlobStore, RetryingBlobStore
from casckpt.testing import BlobStoreConformance


class TestLocalBlobStore(BlobStoreConformance):
    def make_store(self, tmp_path: Path) -> BlobStore:
        return LocalBlobStore(tmp_path / "blobs")

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        assert isinstance(store, LocalBlobStore)
        path = store.root / key
        return path.read_bytes() if path.exists() else None


class TestRetryingLocalBlobStore(BlobStoreConformance):
    list_count = 10

    def make_store(self, tmp_path: Path) -> BlobStore:
        return RetryingBlobStore(LocalBlobStore(tmp_path / "blobs"), attempts=3)

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        assert isinstance(store, RetryingBlobStore) and isinstance(store.inner, LocalBlobStore)
        path = store.inner.root / key
        return path.read_bytes() if path.exists() else None


def test_local_store_writes_no_leftovers_in_tmp(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("packs/aa/one", b"x" * 1000)
    staged = tmp_path / "staged"
    staged.write_bytes(b"y" * 1000)
    store.put_file("packs/aa/two", staged)
    tmp = tmp_path / "blobs" / "tmp"
    # only this store's (empty) scratch directory and its lock, while it is open
    assert [p.name for p in tmp.rglob("*") if p.is_file() and p.suffix != ".lock"] == []
    assert {i.key for i in store.list()} == {"packs/aa/one", "packs/aa/two"}
    store.close()
    assert list(tmp.iterdir()) == []
