"""The per-host LMDB index cache: which chunks the store holds, and where.

The cache is a hint, never the truth. A commit that finds a chunk here skips
encoding it, but the catalog transaction that makes the version visible
re-checks every referenced chunk, so a stale entry (a chunk GC removed, a
catalog restored from backup) costs a retry, never a broken version. The
cache records the store id it belongs to and wipes itself when opened against
another store. Any LMDB failure degrades to a cache miss.

LMDB forbids opening one environment twice in a process: closing either
handle drops the process's advisory lock, and the next process to open it
then resets the lock table under the feet of the others (writers deadlock).
py-lmdb refuses a second open, but not two threads opening at once. Every
:class:`IndexCache` of a process on one path therefore shares one
environment, opened under a lock and closed when the last of them closes. A
forked child must not use its parent's: it runs without a cache (py-lmdb
refuses to open the path again in it).
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

import lmdb

log = logging.getLogger(__name__)

_VALUE = struct.Struct("<32sQQQB")
_STORE_KEY = b"meta:store_id"
DEFAULT_MAP_SIZE = 8 << 30


def _refuse_special_files(path: Path) -> None:
    """LMDB opens ``data.mdb`` and ``lock.mdb`` with a plain open(): a FIFO there would block it
    forever, a device or a symlink could point anywhere. Either makes the cache unusable.

    Raises:
        OSError: one of them exists and is not a regular file.
    """
    for name in ("data.mdb", "lock.mdb"):
        try:
            mode = os.lstat(path / name).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise OSError(f"{path / name} is not a regular file")


class _SharedEnv:
    """One process's LMDB environment on one path, and how many caches use it."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.pid, self.env, self.users = os.getpid(), env, 1
        self.chunks = env.open_db(b"chunks")


_SHARED: dict[str, _SharedEnv] = {}
_SHARED_LOCK = threading.Lock()


def _acquire(path: Path, map_size: int) -> _SharedEnv:
    key = os.path.realpath(path)
    with _SHARED_LOCK:
        shared = _SHARED.get(key)
        if shared is not None and shared.pid == os.getpid():
            shared.users += 1
            return shared
        # none yet, or the parent's before a fork: a child must not use (nor close) that one
        # (py-lmdb then refuses the open: the child goes without a cache)
        path.mkdir(parents=True, exist_ok=True)
        _refuse_special_files(path)
        env = lmdb.open(str(path), map_size=map_size, max_dbs=2, max_readers=256)
        try:
            shared = _SHARED[key] = _SharedEnv(env)
        except BaseException:
            env.close()
            raise
        return shared


def _release(path: Path, shared: _SharedEnv) -> None:
    with _SHARED_LOCK:
        shared.users -= 1
        if shared.users == 0 and shared.pid == os.getpid():
            shared.env.close()
            key = os.path.realpath(path)
            if _SHARED.get(key) is shared:
                del _SHARED[key]


class IndexCache:
    """chunk id (32 bytes) -> (pack id, offset, stored_len, raw_len, codec).

    Thread-safe and multi-process safe (LMDB's own locking). The environment is opened
    on first use, not by the constructor: opening a store to query its catalog touches no
    LMDB file.
    """

    def __init__(self, path: Path, store_id: str, *, map_size: int = DEFAULT_MAP_SIZE) -> None:
        self.path = path
        self._store_id, self._map_size = store_id.encode(), map_size
        self._env: lmdb.Environment | None = None
        self._shared: _SharedEnv | None = None
        self._tried = False  # opened once, or failed once, or closed: never opened again
        self._opening = threading.Lock()

    @classmethod
    def unused(cls, path: Path, store_id: str) -> IndexCache:
        """A cache that holds nothing and never touches ``path``: every lookup misses, every
        update is dropped. A read-only store's: only commits use the cache, and the shared
        one on disk is the writers' (opening LMDB writes its lock file, and its entries bind
        to one store generation)."""
        cache = cls(path, store_id)
        cache.close()
        return cache

    def _opened(self) -> lmdb.Environment | None:
        """The environment, opened by the first caller (None: unusable or closed)."""
        if self._tried:
            return self._env
        with self._opening:
            if not self._tried:
                try:
                    self._shared = _acquire(self.path, self._map_size)
                    self._env, self._chunks = self._shared.env, self._shared.chunks
                    self._bind(self._env, self._store_id)
                except (lmdb.Error, OSError) as exc:
                    log.warning("index cache at %s unusable, continuing without it: %s", self.path, exc)
                    self._drop()
                finally:
                    self._tried = True
        return self._env

    def _bind(self, env: lmdb.Environment, store_id: bytes) -> None:
        with env.begin(write=True) as txn:
            if txn.get(_STORE_KEY) != store_id:
                txn.drop(self._chunks, delete=False)
                txn.put(_STORE_KEY, store_id)

    def get_many(self, ids: Iterable[bytes]) -> dict[bytes, tuple[str, int, int, int, int]]:
        """Return cached locations for the ids that have one."""
        env = self._opened()
        if env is None:
            return {}
        found = {}
        try:
            with env.begin(db=self._chunks) as txn:
                for cid in ids:
                    value = txn.get(cid)
                    if value is not None and len(value) == _VALUE.size:
                        pack, off, stored, raw, codec = _VALUE.unpack(value)
                        found[cid] = (pack.hex(), off, stored, raw, codec)
        except lmdb.Error as exc:
            log.warning("index cache read failed, treating as a miss: %s", exc)
            return {}
        return found

    def put_many(self, items: Iterable[tuple[bytes, str, int, int, int, int]]) -> None:
        """Record ``(chunk_id, pack_id, offset, stored_len, raw_len, codec)`` entries."""
        env = self._opened()
        if env is None:
            return
        try:
            with env.begin(write=True, db=self._chunks) as txn:
                for cid, pack, off, stored, raw, codec in items:
                    txn.put(cid, _VALUE.pack(bytes.fromhex(pack), off, stored, raw, codec))
        except lmdb.MapFullError:
            log.warning("index cache at %s is full; clearing it", self.path)
            self.clear()
        except lmdb.Error as exc:
            log.warning("index cache write failed, ignoring: %s", exc)

    def discard(self, ids: Iterable[bytes]) -> None:
        """Forget entries found to be stale."""
        env = self._opened()
        if env is None:
            return
        try:
            with env.begin(write=True, db=self._chunks) as txn:
                for cid in ids:
                    txn.delete(cid)
        except lmdb.Error as exc:
            log.warning("index cache delete failed, ignoring: %s", exc)

    def clear(self) -> None:
        """Drop every chunk entry."""
        env = self._opened()
        if env is None:
            return
        with env.begin(write=True) as txn:
            txn.drop(self._chunks, delete=False)

    def __len__(self) -> int:
        env = self._opened()
        if env is None:
            return 0
        with env.begin(db=self._chunks) as txn:
            return int(txn.stat(self._chunks)["entries"])

    def close(self) -> None:
        """Stop using the LMDB environment (closed once no cache of this process uses it)."""
        with self._opening:
            self._tried = True
            self._drop()

    def _drop(self) -> None:
        shared, self._shared, self._env = self._shared, None, None
        if shared is not None:
            _release(self.path, shared)
