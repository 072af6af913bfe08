"""A host's fast tier directory: packs committed at local-disk speed, kept as a cache after
they drain to the store's locations (the engine side is :mod:`casckpt.engine.tiering.tier`).

Layout under ``<dir>/<store id>/`` (one directory can serve several stores)::

    casckpt-tier            this tier's identity: JSON {"tier", "store", "created_at"}
    packs/<2 hex>/<id>      whole packs, as the packer wrote them (plain: no shards, no sealing)
    manifests/<version id>  manifests of versions committed here
    tmp/, staging/          objects being written, packs being filled (scratch, see scratch.py)
    drain.lock              flock held by the one process draining this tier at a time
    drain-stats             what every drain moved and how long it took (the drain rate)

Packs are written by rename after fsync (:class:`LocalBlobStore`), read by range, and kept
in least-recently-used order by their mtime: a read touches it (at most every
:data:`TOUCH_S` per pack and process), eviction removes the oldest first. Every process of
the host using this directory shares it: the identity is created once (first writer wins,
by hard link), one process drains at a time (``drain.lock``), and a pack evicted under a
reader is read from the locations instead (it is drained, or it would not be evicted).

A drain reads a pack straight from ``packs/`` (:meth:`FastTierDir.read_verified`): it needs
no room on the tier, so a tier whose disk is full still drains. :meth:`FastTierDir.disk`
says how large that disk is and how much of it is free, whatever the budget says.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from casckpt.errors import (
    BlobNotFoundError,
    CorruptPackError,
    InvalidArgumentError,
    OversizedObjectError,
    StorageError,
    UnsafeObjectError,
)
from casckpt.format import objectnames
from casckpt.format.chunks import object_hasher
from casckpt.localfs import fsync_dir
from casckpt.storage.local import LocalBlobStore

IDENTITY = "casckpt-tier"
_STATS = "drain-stats"  # JSON: bytes and seconds of every drain so far (the drain rate)
TOUCH_S = 10.0  # a pack read more often than this is touched once (its mtime is its LRU age)


@dataclass(frozen=True, slots=True)
class Disk:
    """The file system holding a tier directory: its size and the bytes free to this user."""

    total: int
    free: int


@dataclass(frozen=True, slots=True)
class Resident:
    """A pack held by the fast tier."""

    pack_id: str
    size: int
    used_at: float  # mtime: written, or last read


class FastTierDir:
    """The fast tier directory of one store on this host. Thread-safe."""

    def __init__(self, base: Path | str, store_id: str) -> None:
        """Opens (creating) ``<base>/<store_id>``; :attr:`created` says whether its identity
        record was made now (a new tier, or one whose earlier contents were wiped).

        Raises:
            InvalidArgumentError: ``base`` exists and is not a directory, or its identity
                record names another store or is damaged.
            StorageError: the directory cannot be made or written.
        """
        base = Path(base).expanduser()
        if base.exists() and not base.is_dir():
            raise InvalidArgumentError(f"fast_tier={str(base)!r} is not a directory; give a directory "
                                       "on a fast local disk (it is made if missing)")
        self.root = (base / store_id).resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot make the fast tier directory {self.root}: {exc}") from exc
        self.store_id = store_id
        self.blobs = LocalBlobStore(self.root)
        self.staging = self.root / "staging"
        self.tier_id, self.created = self._identity()
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FastTierDir({str(self.root)!r})"

    # -- identity -------------------------------------------------------------

    def _identity(self) -> tuple[str, bool]:
        path = self.root / IDENTITY
        for _ in range(2):
            found = self._read_identity(path)
            if found is not None:
                return found, False
            record = json.dumps({"tier": uuid.uuid4().hex, "store": self.store_id,
                                 "created_at": time.time()}, sort_keys=True).encode()
            tmp = self.root / f".{IDENTITY}.{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(record)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)  # first writer wins: a link fails if the name exists
                except FileExistsError:
                    continue
                fsync_dir(self.root)
                return str(json.loads(record)["tier"]), True
            except OSError as exc:
                raise StorageError(f"cannot write the fast tier identity {path}: {exc}") from exc
            finally:
                with suppress(OSError):
                    tmp.unlink()
        raise StorageError(f"the fast tier identity {path} keeps changing; is another process "
                           "removing it?")

    def _read_identity(self, path: Path) -> str | None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot read the fast tier identity {path}: {exc}") from exc
        try:
            record = json.loads(raw)
            tier, store = record["tier"], record["store"]
        except (ValueError, KeyError, TypeError):
            raise InvalidArgumentError(
                f"the fast tier identity {path} is damaged; if nothing in this directory is still "
                "to drain (`casckpt tier status` on this host), remove the directory and open "
                "again") from None
        if store != self.store_id or not isinstance(tier, str) or len(tier) != 32:
            raise InvalidArgumentError(f"the fast tier identity {path} belongs to store {store!r}, "
                                       f"not {self.store_id}; give this store its own fast_tier")
        return tier

    # -- packs ----------------------------------------------------------------

    def pack_path(self, pack_id: str) -> Path:
        """Where the pack is (or would be) held."""
        return self.root / objectnames.pack_name(pack_id)

    def holds(self, pack_id: str) -> bool:
        """The pack is here (a cheap stat)."""
        return self.pack_path(pack_id).is_file()

    def put_pack(self, pack_id: str, path: Path) -> None:
        """Make the finished pack file ``path`` durable here (fsync, rename; consumes it).
        Its mtime (its age for eviction) is made now first: a pack that waited for room keeps
        the time it was written, and eviction would take it for an orphan (held, unknown to
        the catalog, old) in the moment before the commit records it."""
        try:
            now = time.time()  # this host's clock, explicitly: the eviction compares with it
            os.utime(path, (now, now))
        except OSError as exc:
            raise StorageError(f"cannot put pack {pack_id} on the fast tier: {exc}") from exc
        self.blobs.put_file(objectnames.pack_name(pack_id), path)

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Read pack bytes from ``offset`` (see :meth:`LocalBlobStore.read_into`).

        Raises:
            BlobNotFoundError: the pack is not here (evicted meanwhile).
        """
        got = self.blobs.read_into(objectnames.pack_name(pack_id), offset, buffers)
        self._touch(pack_id)
        return got

    def get(self, pack_id: str) -> bytes:
        """The whole pack (unverified: the caller checks it)."""
        data = self.blobs.get(objectnames.pack_name(pack_id))
        self._touch(pack_id)
        return data

    def _touch(self, pack_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(pack_id, -TOUCH_S) < TOUCH_S:
                return
            self._touched[pack_id] = now
            if len(self._touched) > 100_000:
                self._touched.clear()
        with suppress(OSError):  # evicted meanwhile: nothing to age
            os.utime(self.pack_path(pack_id))

    def read_verified(self, pack_id: str, size: int) -> bytes:
        """The whole pack, read straight from the tier and checked against its id while
        reading: the bytes are about to become the durable copy, so bytes damaged on this
        disk must never be stored under the pack's id. Nothing is written here, so a tier
        whose disk is full drains all the same.

        Raises:
            BlobNotFoundError: the pack is not here.
            CorruptPackError: the copy here is damaged: its bytes do not hash to its id, or it is
                not a regular file of the catalog's size.
            StorageError: the pack cannot be read.
        """
        try:  # a regular file, at most the catalog's size (invariant 10)
            data = self.blobs.get(objectnames.pack_name(pack_id), max_size=size)
        except BlobNotFoundError:
            raise BlobNotFoundError(f"pack {pack_id} is not on the fast tier {self.root}") from None
        except (OversizedObjectError, UnsafeObjectError) as exc:  # its bytes are not the pack's
            raise CorruptPackError(f"pack {pack_id} on the fast tier {self.root} is damaged ({exc}) "
                                   "and has not drained: it is lost") from exc
        hasher = object_hasher()
        hasher.update(data)
        if len(data) != size or hasher.hexdigest() != pack_id:
            raise CorruptPackError(f"pack {pack_id} on the fast tier {self.root} is damaged (its "
                                   "bytes do not hash to its id) and has not drained: it is lost")
        return data

    def disk(self) -> Disk | None:
        """The file system holding this directory now (None: it cannot be asked)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return Disk(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)

    def evict(self, pack_id: str) -> int:
        """Remove a held pack; returns the bytes freed (0: it was not here)."""
        path = self.pack_path(pack_id)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StorageError(f"cannot evict pack {pack_id} from the fast tier: {exc}") from exc
        return size

    def resident(self) -> list[Resident]:
        """Every pack held here, least recently used first."""
        out: list[Resident] = []
        packs = self.root / objectnames.PACKS.rstrip("/")
        if not packs.is_dir():
            return out
        for folder in packs.iterdir():
            if not folder.is_dir() or folder.is_symlink():
                continue
            for entry in os.scandir(folder):
                found = objectnames.pack_of(f"{objectnames.PACKS}{folder.name}/{entry.name}")
                if not entry.is_file(follow_symlinks=False) or found is None or found[1] is not None:
                    continue
                with suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    out.append(Resident(entry.name, st.st_size, st.st_mtime))
        out.sort(key=lambda r: (r.used_at, r.pack_id))
        return out

    # -- manifests ------------------------------------------------------------

    def put_manifest(self, version_id: str, data: bytes) -> None:
        """Keep a version's manifest here (fsync'd)."""
        self.blobs.put(objectnames.manifest_name(version_id), data)

    def manifest(self, version_id: str) -> bytes | None:
        """A manifest kept here (None: not here, or not readable: the catalog has it too)."""
        try:
            return self.blobs.get(objectnames.manifest_name(version_id))
        except StorageError:
            return None

    def drop_manifest(self, version_id: str) -> None:
        """Forget a manifest once the version is durable."""
        with suppress(StorageError):
            self.blobs.delete(objectnames.manifest_name(version_id))

    # -- draining -------------------------------------------------------------

    @contextmanager
    def drain_lock(self, *, wait: bool) -> Iterator[bool]:
        """Hold this tier's drain lock (one drainer per tier on the host); yields False at once
        when another process holds it and ``wait`` is False. The directory is made again if it
        was removed under the store (the drain then finds its packs gone: lost).

        Raises:
            StorageError: the lock file cannot be made.
        """
        path = self.root / "drain.lock"
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot open the fast tier's drain lock {path}: {exc}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def note_drain(self, nbytes: int, seconds: float) -> None:
        """Add a drain's bytes and time to ``drain-stats`` (call holding the drain lock): the
        tier's drain rate, for every process of the host."""
        totals = self.drain_totals()
        record = {"bytes": totals[0] + nbytes, "seconds": totals[1] + seconds, "last_at": time.time(),
                  "last_bytes": nbytes, "last_seconds": seconds}
        with suppress(StorageError):  # statistics: never worth failing a drain over
            self.blobs.put(_STATS, json.dumps(record, sort_keys=True).encode())

    def drain_totals(self) -> tuple[int, float]:
        """(bytes, seconds) every drain of this tier recorded."""
        try:
            record = json.loads(self.blobs.get(_STATS, max_size=4096))
            return int(record["bytes"]), float(record["seconds"])
        except (StorageError, ValueError, KeyError, TypeError):
            return 0, 0.0

    def close(self) -> None:
        """Release the scratch directory."""
        self.blobs.close()
