"""A conformance test suite every BlobStore backend passes.

Subclass :class:`BlobStoreConformance` in a test module, name the subclass
``Test...`` so pytest collects it, and say how to make a fresh, empty store,
either by overriding :meth:`~BlobStoreConformance.make_store`::

    class TestLocalBlobStore(BlobStoreConformance):
        def make_store(self, tmp_path):
            return LocalBlobStore(tmp_path / "blobs")

or, when the store needs other fixtures (a server, a bucket), by overriding
the ``blob_store`` fixture itself::

    class TestS3BlobStore(BlobStoreConformance):
        @pytest.fixture
        def blob_store(self, s3_url):
            store = S3BlobStore(s3_url)
            yield store
            store.close()

Class attributes size the work (``list_count``, ``large_size``) so a slow
backend can keep the suite fast. Overriding :meth:`raw_get` lets the suite
check each object against the raw storage (the file, the S3 object) too.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from casckpt.errors import BlobNotFoundError, InvalidNameError, OversizedObjectError, StorageError
from casckpt.storage.base import BlobStore

MiB = 1024 * 1024
INVALID_KEYS = ("../x", "/abs", "a//b", "UPPER", "", "packs/../x", "with space", "tail/")


def blob(size: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes."""
    return random.Random(seed).randbytes(size)


class BlobStoreConformance:
    """The BlobStore contract, as pytest tests. Subclass it; see the module docstring."""

    #: keys written by the listing test; raise it to cross the backend's page size
    list_count: int = 25
    #: size of the "large" object (set it above a multipart threshold to cover that path)
    large_size: int = 3 * MiB + 7
    #: threads in the concurrency test
    threads: int = 8

    def make_store(self, tmp_path: Path) -> BlobStore:
        """Return a new, empty store. Override this or the ``blob_store`` fixture."""
        raise NotImplementedError(f"{type(self).__name__} must override make_store or blob_store")

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        """Return the raw stored bytes of ``key`` bypassing ``store``, or None if absent.

        The default raises ``NotImplementedError``, which skips the raw checks.
        """
        raise NotImplementedError

    @pytest.fixture
    def blob_store(self, tmp_path: Path) -> Iterator[BlobStore]:
        store = self.make_store(tmp_path)
        try:
            yield store
        finally:
            store.close()

    # round trips -----------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4097, "large"])
    def test_put_get_round_trip(self, blob_store: BlobStore, size: int | str) -> None:
        n = self.large_size if size == "large" else int(size)
        data = blob(n, seed=n)
        blob_store.put("objects/round-trip", data)
        assert blob_store.get("objects/round-trip") == data
        assert blob_store.size("objects/round-trip") == n

    def test_put_accepts_memoryview(self, blob_store: BlobStore) -> None:
        backing = bytearray(blob(10_000, seed=1))
        blob_store.put("objects/view", memoryview(backing)[100:9_100])
        assert blob_store.get("objects/view") == bytes(backing[100:9_100])

    def test_all_byte_values_round_trip(self, blob_store: BlobStore) -> None:
        data = bytes(range(256)) * 64 + bytes(range(255, -1, -1))
        blob_store.put("objects/bytes", data)
        assert blob_store.get("objects/bytes") == data
        assert blob_store.get_range("objects/bytes", 250, 12) == data[250:262]

    def test_put_same_content_again_is_idempotent(self, blob_store: BlobStore) -> None:
        data = blob(5000, seed=2)
        blob_store.put("packs/ab/abcdef", data)
        blob_store.put("packs/ab/abcdef", data)
        assert blob_store.get("packs/ab/abcdef") == data
        assert [i.key for i in blob_store.list("packs/")] == ["packs/ab/abcdef"]

    @pytest.mark.parametrize("size", [0, 70_000, "large"])
    def test_put_file_round_trip(self, blob_store: BlobStore, tmp_path: Path,
                                 size: int | str) -> None:
        n = self.large_size if size == "large" else int(size)
        data = blob(n, seed=3)
        path = tmp_path / "staged.pack"
        path.write_bytes(data)
        blob_store.put_file("packs/cd/staged", path)  # path may be consumed
        assert blob_store.get("packs/cd/staged") == data
        assert blob_store.size("packs/cd/staged") == n

    def test_put_file_of_missing_file_is_a_storage_error(self, blob_store: BlobStore,
                                                         tmp_path: Path) -> None:
        with pytest.raises(StorageError):
            blob_store.put_file("packs/cd/nothing", tmp_path / "does-not-exist")
        assert blob_store.size("packs/cd/nothing") is None

    def test_raw_storage_holds_what_was_put(self, blob_store: BlobStore) -> None:
        data = blob(3000, seed=4)
        try:
            absent = self.raw_get(blob_store, "manifests/raw")
        except NotImplementedError:
            pytest.skip("this suite subclass does not implement raw_get")
        assert absent is None
        blob_store.put("manifests/raw", data)
        assert self.raw_get(blob_store, "manifests/raw") == data
        blob_store.delete("manifests/raw")
        assert self.raw_get(blob_store, "manifests/raw") is None

    # ranges ----------------------------------------------------------------

    def test_get_range(self, blob_store: BlobStore) -> None:
        data = blob(10_000, seed=5)
        blob_store.put("objects/ranged", data)
        cases = [(0, 1), (0, 100), (4_321, 1_000), (9_999, 1), (9_000, 1_000), (0, 10_000),
                 (9_990, 100), (0, 20_000), (10_000, 5), (12_345, 10), (500, 0), (10_000, 0)]
        rng = random.Random(6)
        cases += [(rng.randrange(11_000), rng.randrange(1, 3_000)) for _ in range(10)]
        for offset, length in cases:
            got = blob_store.get_range("objects/ranged", offset, length)
            assert got == data[offset:offset + length], (offset, length)

    def test_read_into_scatters_a_range(self, blob_store: BlobStore) -> None:
        data = blob(10_000, seed=8)
        blob_store.put("objects/scatter", data)
        sizes = [1, 92, 4_096, 0, 1_000]
        buffers = [memoryview(bytearray(n)) for n in sizes]
        assert blob_store.read_into("objects/scatter", 123, buffers) == sum(sizes)
        assert b"".join(bytes(b) for b in buffers) == data[123 : 123 + sum(sizes)]
        tail = [memoryview(bytearray(300)), memoryview(bytearray(300))]
        assert blob_store.read_into("objects/scatter", 9_600, tail) == 400  # the object ends
        assert bytes(tail[0]) + bytes(tail[1][:100]) == data[9_600:]
        with pytest.raises(BlobNotFoundError):
            blob_store.read_into("objects/absent", 0, [memoryview(bytearray(4))])

    def test_get_range_of_empty_object(self, blob_store: BlobStore) -> None:
        blob_store.put("objects/empty", b"")
        assert blob_store.get_range("objects/empty", 0, 10) == b""

    def test_get_range_of_large_object_is_exact(self, blob_store: BlobStore) -> None:
        data = blob(self.large_size, seed=7)
        blob_store.put("objects/large", data)
        middle = self.large_size // 2
        assert blob_store.get_range("objects/large", middle, 65_536) == \
            data[middle:middle + 65_536]
        tail = blob_store.get_range("objects/large", self.large_size - 10, 100)
        assert tail == data[-10:]

    # bounded reads ---------------------------------------------------------

    def test_get_refuses_an_object_larger_than_max_size(self, blob_store: BlobStore) -> None:
        data = blob(10_000, seed=9)
        blob_store.put("packs/ab/bounded", data)
        assert blob_store.get("packs/ab/bounded", max_size=10_000) == data
        assert blob_store.get("packs/ab/bounded", max_size=None) == data
        for limit in (9_999, 0):
            with pytest.raises(OversizedObjectError) as refused:
                blob_store.get("packs/ab/bounded", max_size=limit)
            assert isinstance(refused.value, StorageError) and "packs/ab/bounded" in str(refused.value)
        blob_store.put("packs/ab/empty", b"")
        assert blob_store.get("packs/ab/empty", max_size=0) == b""
        with pytest.raises(BlobNotFoundError):
            blob_store.get("packs/ab/absent", max_size=10)

    # missing objects -------------------------------------------------------

    def test_missing_object(self, blob_store: BlobStore) -> None:
        assert blob_store.size("objects/missing") is None
        with pytest.raises(BlobNotFoundError):
            blob_store.get("objects/missing")
        with pytest.raises(BlobNotFoundError):
            blob_store.get_range("objects/missing", 0, 10)
        with pytest.raises(BlobNotFoundError):
            blob_store.get_range("objects/missing", 0, 0)

    def test_blob_not_found_is_a_storage_error_and_file_not_found(self) -> None:
        assert issubclass(BlobNotFoundError, StorageError)
        assert issubclass(BlobNotFoundError, FileNotFoundError)

    # listing ---------------------------------------------------------------

    def test_list_with_prefixes(self, blob_store: BlobStore) -> None:
        objects = {
            "packs/aa/aa01": b"1", "packs/aa/aa02": b"22", "packs/ab/ab01": b"333",
            "manifests/m1": b"4444", "manifests/m2": b"",
        }
        before = time.time()
        for key, data in objects.items():
            blob_store.put(key, data)
        listed = {i.key: i for i in blob_store.list()}
        assert set(listed) == set(objects)
        for key, info in listed.items():
            assert info.size == len(objects[key])
            assert abs(info.mtime - before) < 24 * 3600, "mtime is not seconds since the epoch"
        assert {i.key for i in blob_store.list("packs/")} == \
            {"packs/aa/aa01", "packs/aa/aa02", "packs/ab/ab01"}
        assert {i.key for i in blob_store.list("packs/aa/")} == {"packs/aa/aa01", "packs/aa/aa02"}
        assert {i.key for i in blob_store.list("packs/a")} == \
            {"packs/aa/aa01", "packs/aa/aa02", "packs/ab/ab01"}
        assert {i.key for i in blob_store.list("manifests/")} == {"manifests/m1", "manifests/m2"}
        assert list(blob_store.list("nothing/")) == []
        assert list(blob_store.list("packs/zz/")) == []

    def test_list_of_empty_store(self, blob_store: BlobStore) -> None:
        assert list(blob_store.list()) == []
        assert list(blob_store.list("packs/")) == []

    def test_list_many(self, blob_store: BlobStore) -> None:
        keys = [f"packs/{i % 7:02x}/many{i:05d}" for i in range(self.list_count)]
        self._run_threads(lambda k: blob_store.put(k, k.encode()), keys)
        blob_store.put("manifests/other", b"x")
        listed = [i.key for i in blob_store.list("packs/")]
        assert sorted(listed) == sorted(keys)
        assert len(listed) == len(set(listed)), "a key was listed twice"

    # deletes ---------------------------------------------------------------

    def test_delete(self, blob_store: BlobStore) -> None:
        blob_store.put("packs/ef/gone", b"data")
        blob_store.put("packs/ef/kept", b"data")
        blob_store.delete("packs/ef/gone")
        assert blob_store.size("packs/ef/gone") is None
        assert blob_store.size("packs/ef/kept") == 4
        with pytest.raises(BlobNotFoundError):
            blob_store.get("packs/ef/gone")
        assert [i.key for i in blob_store.list("packs/ef/")] == ["packs/ef/kept"]

    def test_delete_missing_is_not_an_error(self, blob_store: BlobStore) -> None:
        blob_store.delete("packs/ef/never-written")
        blob_store.put("packs/ef/twice", b"x")
        blob_store.delete("packs/ef/twice")
        blob_store.delete("packs/ef/twice")
        assert blob_store.size("packs/ef/twice") is None

    # keys ------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_are_refused(self, blob_store: BlobStore, key: str,
                                      tmp_path: Path) -> None:
        path = tmp_path / "f"
        path.write_bytes(b"x")
        calls: list[Callable[[], object]] = [
            lambda: blob_store.put(key, b"x"),
            lambda: blob_store.put_file(key, path),
            lambda: blob_store.get(key),
            lambda: blob_store.get_range(key, 0, 1),
            lambda: blob_store.size(key),
            lambda: blob_store.delete(key),
        ]
        for call in calls:
            with pytest.raises(InvalidNameError):
                call()
        assert list(blob_store.list()) == []

    # concurrency and lifecycle ---------------------------------------------

    def _run_threads(self, fn: Callable[[str], None], items: list[str]) -> None:
        errors: list[BaseException] = []
        lock = threading.Lock()
        chunks = [items[i::self.threads] for i in range(self.threads)]

        def work(mine: list[str]) -> None:
            for item in mine:
                try:
                    fn(item)
                except BaseException as exc:  # collected and re-raised below
                    with lock:
                        errors.append(exc)

        workers = [threading.Thread(target=work, args=(c,)) for c in chunks]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        if errors:
            raise errors[0]

    def test_concurrent_puts_and_gets(self, blob_store: BlobStore) -> None:
        shared = blob(50_000, seed=8)
        keys = [f"packs/{i:02x}/conc{i:03d}" for i in range(4 * self.threads)]

        def put_get(key: str) -> None:
            data = blob(20_000 + len(key), seed=sum(key.encode()))
            blob_store.put(key, data)
            blob_store.put("packs/00/shared", shared)  # every thread writes the same object
            assert blob_store.get(key) == data
            assert blob_store.get_range(key, 1_000, 500) == data[1_000:1_500]
            assert blob_store.size(key) == len(data)

        self._run_threads(put_get, keys)
        assert blob_store.get("packs/00/shared") == shared
        assert {i.key for i in blob_store.list("packs/")} == set(keys) | {"packs/00/shared"}

    def test_url_names_the_location(self, blob_store: BlobStore) -> None:
        assert isinstance(blob_store.url, str) and "://" in blob_store.url

    def test_close_is_idempotent(self, blob_store: BlobStore) -> None:
        blob_store.put("objects/before-close", b"x")
        blob_store.close()
        blob_store.close()
