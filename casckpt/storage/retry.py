"""Retry any BlobStore's transient failures with exponential backoff.

A pure wrapper, in the style of restic's backend wrappers: it knows nothing of
S3 or files, only that :class:`~casckpt.errors.RetryableStorageError` may
succeed if tried again and every other error will not. Puts are safe to
retry because keys are content-addressed (the same key always gets the same
bytes) and every backend writes atomically.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from casckpt.errors import InvalidArgumentError, RetryableStorageError
from casckpt.storage.base import BlobInfo, BlobStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class RetryingBlobStore:
    """Wraps ``inner``, retrying each operation that raises RetryableStorageError.

    Attempt ``n`` (1-based) that fails waits ``uniform(0, min(max_delay,
    base_delay * 2**(n-1)))`` seconds ("full jitter") before attempt ``n+1``;
    after ``attempts`` tries the last error is re-raised unchanged. Other
    errors (permanent ``StorageError``, ``BlobNotFoundError``,
    ``InvalidNameError``) pass through at once. Each retry is logged at
    WARNING with the store URL, operation, key and error message (which
    backends keep free of credentials).

    ``list()`` is retried only while it has yielded nothing: a failure after
    the first item propagates, because restarting would yield items twice.
    ``put_file()`` is retried only while ``path`` still exists, since a
    backend may consume the file.

    Thread-safe if ``inner`` is: the wrapper keeps no per-call state.

    Args:
        inner: the store to wrap (any BlobStore).
        attempts: tries per operation in all (1 = no retry).
        base_delay: the backoff ceiling after the first failure, in seconds.
        max_delay: the largest backoff ceiling, in seconds.
        sleep: called with each delay (tests pass a recorder).
        jitter: returns a float in [0, 1) scaling each delay (default: a private
            ``random.Random``).
    """

    def __init__(self, inner: BlobStore, *, attempts: int = 5, base_delay: float = 0.05,
                 max_delay: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                 jitter: Callable[[], float] | None = None) -> None:
        if attempts < 1 or base_delay < 0 or max_delay < 0:
            raise InvalidArgumentError(
                f"RetryingBlobStore needs attempts >= 1 and delays >= 0, not "
                f"attempts={attempts}, base_delay={base_delay}, max_delay={max_delay}"
            )
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._sleep = sleep
        self._jitter = jitter if jitter is not None else random.Random().random

    def __repr__(self) -> str:
        return f"RetryingBlobStore({self.inner!r}, attempts={self.attempts})"

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th consecutive failure."""
        ceiling = min(self._max_delay, self._base_delay * 2.0 ** (failures - 1))
        return ceiling * self._jitter()

    def _retry(self, op: str, key: str, fn: Callable[[], T],
               may_retry: Callable[[], bool] = lambda: True) -> T:
        failures = 0
        while True:
            try:
                return fn()
            except RetryableStorageError as exc:
                failures += 1
                if failures >= self.attempts or not may_retry():
                    log.warning("%s: %s %s failed %d time(s), giving up: %s",
                                self.url, op, key, failures, exc)
                    raise
                wait = self.delay(failures)
                log.warning("%s: %s %s failed (attempt %d of %d), retrying in %.3fs: %s",
                            self.url, op, key, failures, self.attempts, wait, exc)
                self._sleep(wait)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._retry("put", key, lambda: self.inner.put(key, data))

    def put_file(self, key: str, path: Path) -> None:
        self._retry("put_file", key, lambda: self.inner.put_file(key, path),
                    may_retry=Path(path).exists)

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        return self._retry("get", key, lambda: self.inner.get(key, max_size=max_size))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._retry("get_range", key, lambda: self.inner.get_range(key, offset, length))

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        return self._retry("read_into", key, lambda: self.inner.read_into(key, offset, buffers))

    def size(self, key: str) -> int | None:
        return self._retry("size", key, lambda: self.inner.size(key))

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        def first_item() -> tuple[Iterator[BlobInfo], BlobInfo | None]:
            items = iter(self.inner.list(prefix))
            return items, next(items, None)

        items, first = self._retry("list", prefix, first_item)
        if first is None:
            return
        yield first
        yield from items

    def delete(self, key: str) -> None:
        self._retry("delete", key, lambda: self.inner.delete(key))

    def close(self) -> None:
        self.inner.close()
