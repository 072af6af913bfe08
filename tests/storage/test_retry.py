"""RetryingBlobStore against a fake inner store that fails on command."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from casckpt.errors import (
    BlobNotFoundError,
    InvalidArgumentError,
    InvalidNameError,
    OversizedObjectError,
    RetryableStorageError,
    StorageError,
)
from casckpt.storage import BlobInfo, BlobStore, RetryingBlobStore
from casckpt.storage.base import scatter


class FlakyStore:
    """An in-memory store whose next ``failures`` calls raise ``error``."""

    url = "mem://flaky"

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        self.objects: dict[str, bytes] = {"manifests/a": b"abc", "manifests/b": b"de"}
        self.failures = failures
        self.error = error if error is not None else RetryableStorageError("injected")
        self.calls: Counter[str] = Counter()
        self.closed = 0
        self.fail_list_after: int | None = None

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._enter("put")
        self.objects[key] = bytes(data)

    def put_file(self, key: str, path: Path) -> None:
        self._enter("put_file")
        self.objects[key] = path.read_bytes()

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        self._enter("get")
        if max_size is not None and len(self.objects[key]) > max_size:
            raise OversizedObjectError(f"{key} is larger than {max_size}")
        return self.objects[key]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self._enter("get_range")
        return self.objects[key][offset:offset + length]

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        self._enter("read_into")
        return scatter(self.objects[key][offset:offset + sum(len(b) for b in buffers)], buffers)

    def size(self, key: str) -> int | None:
        self._enter("size")
        return len(self.objects[key]) if key in self.objects else None

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        self._enter("list")
        for i, key in enumerate(sorted(self.objects)):
            if self.fail_list_after is not None and i == self.fail_list_after:
                raise RetryableStorageError("listing cut")
            if key.startswith(prefix):
                yield BlobInfo(key, len(self.objects[key]), 0.0)

    def delete(self, key: str) -> None:
        self._enter("delete")
        self.objects.pop(key, None)

    def close(self) -> None:
        self.closed += 1


def wrap(inner: FlakyStore, sleeps: list[float], **kwargs: Any) -> RetryingBlobStore:
    kwargs.setdefault("jitter", lambda: 1.0)
    return RetryingBlobStore(inner, sleep=sleeps.append, **kwargs)


OPERATIONS: dict[str, Callable[[BlobStore, Path], object]] = {
    "put": lambda s, p: s.put("manifests/c", b"new"),
    "put_file": lambda s, p: s.put_file("manifests/c", p),
    "get": lambda s, p: s.get("manifests/a"),
    "get_range": lambda s, p: s.get_range("manifests/a", 1, 5),
    "read_into": lambda s, p: s.read_into("manifests/a", 1, [memoryview(bytearray(3))]),
    "size": lambda s, p: s.size("manifests/a"),
    "list": lambda s, p: list(s.list("manifests/")),
    "delete": lambda s, p: s.delete("manifests/a"),
}


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    path = tmp_path / "staged"
    path.write_bytes(b"new")
    return path


def test_wrapper_is_a_blob_store_and_passes_url_and_close() -> None:
    inner = FlakyStore()
    store = RetryingBlobStore(inner)
    assert isinstance(store, BlobStore)
    assert store.url == "mem://flaky"
    store.close()
    assert inner.closed == 1


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_every_operation_retries_then_succeeds(op: str, staged: Path) -> None:
    inner, sleeps = FlakyStore(failures=3), []
    clean = OPERATIONS[op](FlakyStore(), staged)
    assert OPERATIONS[op](wrap(inner, sleeps, attempts=5), staged) == clean
    assert inner.calls[op] == 4
    assert sleeps == [0.05, 0.1, 0.2]


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_gives_up_after_attempts_with_the_last_error(op: str, staged: Path) -> None:
    error = RetryableStorageError("still throttled")
    inner, sleeps = FlakyStore(failures=100, error=error), []
    with pytest.raises(RetryableStorageError) as info:
        OPERATIONS[op](wrap(inner, sleeps, attempts=3), staged)
    assert info.value is error
    assert inner.calls[op] == 3
    assert len(sleeps) == 2


@pytest.mark.parametrize("error", [
    StorageError("access denied"), BlobNotFoundError("gone"), InvalidNameError("bad key"),
    ValueError("a bug"),
])
@pytest.mark.parametrize("op", ["put", "get", "size", "list", "delete"])
def test_other_errors_are_not_retried(op: str, error: Exception, staged: Path) -> None:
    inner, sleeps = FlakyStore(failures=1, error=error), []
    with pytest.raises(type(error)) as info:
        OPERATIONS[op](wrap(inner, sleeps), staged)
    assert info.value is error
    assert inner.calls[op] == 1
    assert sleeps == []


def test_backoff_grows_exponentially_up_to_max_delay() -> None:
    inner, sleeps = FlakyStore(failures=7), []
    wrap(inner, sleeps, attempts=8, base_delay=0.5, max_delay=3.0).get("manifests/a")
    assert sleeps == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


def test_full_jitter_scales_each_delay() -> None:
    draws = iter([0.5, 0.0, 0.25])
    inner, sleeps = FlakyStore(failures=3), []
    wrap(inner, sleeps, attempts=4, base_delay=1.0, max_delay=10.0,
         jitter=lambda: next(draws)).get("manifests/a")
    assert sleeps == [0.5, 0.0, 1.0]


def test_default_jitter_stays_under_the_ceiling() -> None:
    store = RetryingBlobStore(FlakyStore(), base_delay=0.1, max_delay=1.0)
    delays = [store.delay(n) for n in range(1, 8) for _ in range(50)]
    assert all(0 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 100, "delays are jittered"


def test_one_attempt_means_no_retry() -> None:
    inner, sleeps = FlakyStore(failures=1), []
    with pytest.raises(RetryableStorageError):
        wrap(inner, sleeps, attempts=1).get("manifests/a")
    assert inner.calls["get"] == 1 and sleeps == []


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_delay": -1}, {"max_delay": -1}])
def test_invalid_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        RetryingBlobStore(FlakyStore(), **kwargs)


def test_list_is_not_retried_after_it_has_yielded() -> None:
    inner, sleeps = FlakyStore(), []
    inner.fail_list_after = 1
    items = wrap(inner, sleeps).list()
    assert next(items).key == "manifests/a"
    with pytest.raises(RetryableStorageError, match="listing cut"):
        next(items)
    assert inner.calls["list"] == 1 and sleeps == []


def test_list_of_nothing_after_a_retry() -> None:
    inner, sleeps = FlakyStore(failures=1), []
    assert list(wrap(inner, sleeps).list("packs/")) == []
    assert inner.calls["list"] == 2


def test_put_file_is_not_retried_once_the_file_is_gone(tmp_path: Path) -> None:
    class Consuming(FlakyStore):
        def put_file(self, key: str, path: Path) -> None:
            path.unlink()
            super().put_file(key, path)

    path = tmp_path / "staged"
    path.write_bytes(b"x")
    inner, sleeps = Consuming(failures=5), []
    with pytest.raises(RetryableStorageError):
        wrap(inner, sleeps).put_file("manifests/c", path)
    assert inner.calls["put_file"] == 1 and sleeps == []


def test_retries_are_logged_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="casckpt.storage.retry")
    inner, sleeps = FlakyStore(failures=2, error=RetryableStorageError("S3 SlowDown")), []
    wrap(inner, sleeps).put("manifests/c", b"payload-bytes")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert "mem://flaky" in messages[0] and "put manifests/c" in messages[0]
    assert "S3 SlowDown" in messages[0] and "attempt 1 of 5" in messages[0]
    assert not any("payload-bytes" in m for m in messages)
