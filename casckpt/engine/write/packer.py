"""Packs encoded chunks into pack objects and makes them durable.

A pack is written to a staging file (in the store's own staging directory,
see ``storage/scratch.py``, or the fast tier's when the pack is to be held
there and the tier's disk has room for it), finished (footer, trailer, id),
stored in the blob store (or held on the tier) under its content-addressed key, and only then recorded in the
catalog and the index cache. The staging file is written, and hashed for the pack id, on the
packer's :class:`~casckpt.engine.write.packsink.PackSink` thread, while the committing thread
encodes the next chunks. A crash at any point leaves at worst an object
or chunk rows no version references, which GC reclaims, and staging files
the next open reclaims. A staging disk that fills up raises StorageFullError.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

from casckpt.catalog import StoredPack
from casckpt.engine.context import EngineContext
from casckpt.engine.write.packsink import PackSink
from casckpt.errors import StorageError
from casckpt.format.pack import ENTRY_HEADER_SIZE, PACK_HEADER_SIZE, PackEntry, PackWriter
from casckpt.storage.erasure import Redundancy
from casckpt.storage.local import full_error

# fallocate refused by the file system itself, not for want of room
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)


_QUEUE_CHUNKS = 16  # chunks' bytes a packer's sink may hold queued (memory only for encoded payloads)


class Packer:
    """Accumulates chunks into packs of about ``config.pack_size`` bytes.

    Chunks are written to the staging file, and hashed for the pack id, on the packer's
    own sink thread, in the order added: a payload must stay unchanged until :meth:`finish`
    (or :meth:`abort`) returns. Finished packs are stored and recorded on the context's
    upload pool while the next pack fills. At most ``config.upload_workers`` packs are in
    flight (sealed, not yet stored and recorded) beside the one filling, each encoded by
    an erasure-coding worker of its own where the store has twice that many cores: the staging
    disk holds at most ``upload_workers + 1`` packs and, per pack in flight, its shard
    files; the workers at most one pack and its shards each. Call order: :meth:`add` any
    number of times, then :meth:`finish` (or :meth:`abort` after a failure). Not
    thread-safe.
    """

    def __init__(self, ctx: EngineContext, redundancy: Redundancy,
                 on_stored: Callable[[StoredPack], None] | None = None, *, fast: bool = False) -> None:
        """``on_stored`` records a stored pack (default: ``catalog.add_pack``). ``fast``: hold
        packs on the store's fast tier, when it has one, for the drain to store (a commit's
        packs); otherwise they go to the locations."""
        self._ctx = ctx
        self._tier = ctx.packs.tier if fast else None
        self._redundancy = redundancy
        self._record = on_stored or ctx.catalog.add_pack
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._held = False  # the open pack is filled on the fast tier, to be held there
        self._writer: PackWriter | None = None  # used on the sink thread only, once opened
        self._filled = 0  # bytes the open pack holds once the sink wrote what it was given
        self._sink: PackSink | None = None  # started with the first pack
        self._staged: dict[Path, BinaryIO] = {}  # staging files no upload took over yet
        self._staged_lock = threading.Lock()
        self._pending: deque[Future[StoredPack]] = deque()
        self._in_flight = max(1, ctx.config.upload_workers)  # packs pending beside the one filling
        self._opened = 0
        self.stored_bytes = 0
        self.packs: list[StoredPack] = []

    def add(self, cid: bytes, codec: int, raw_len: int, payload: bytes | memoryview,
            base_id: bytes | None = None) -> None:
        """Append one encoded chunk (a delta names its ``base_id``), closing the pack when it
        is full. The payload is written later, on the sink thread.

        Raises:
            StorageError: the staging file could not be opened, or an earlier chunk could
                not be written (StorageFullError when the staging disk is full).
        """
        size = len(payload)
        if self._writer is None or self._path is None or self._sink is None:
            try:
                writer, path, sink = self._open()
            except OSError as exc:
                raise self._write_error(exc, self._path, size) from exc
        else:
            writer, path, sink = self._writer, self._path, self._sink

        def write(error: BaseException | None) -> None:
            if error is None:
                try:
                    writer.add(cid, codec, raw_len, payload, base_id)
                except OSError as exc:
                    raise self._write_error(exc, path, writer.size + size) from exc

        sink.put(write, size)
        self.stored_bytes += size
        self._filled += ENTRY_HEADER_SIZE + size
        if self._filled >= self._ctx.config.pack_size:
            self._close()

    def _open(self) -> tuple[PackWriter, Path, PackSink]:
        """Open the next pack's staging file (and the sink, with the first): its writer, path
        and the sink that writes it."""
        # the encoding workers the packs in flight will need start while this one fills
        self._ctx.packs.coder.prepare(self._redundancy, min(self._opened + 1, self._in_flight))
        self._opened += 1
        sink = self._sink if self._sink is not None else PackSink(_QUEUE_CHUNKS * self._ctx.config.chunk_size)
        self._sink = sink
        reserved = self._on_tier()
        self._held = reserved is not None
        if reserved is None:
            path = self._ctx.staging.path() / f"{uuid.uuid4().hex}.pack"
            reserved = path, open(path, "wb")  # noqa: SIM115 - closed when sealed, or by abort()
        path, file = reserved
        self._path, self._file = path, file
        with self._staged_lock:
            self._staged[path] = file
        writer = self._writer = PackWriter(file)
        self._filled = PACK_HEADER_SIZE
        return writer, path, sink

    def _on_tier(self) -> tuple[Path, BinaryIO] | None:
        """The pack's staging file, opened on the fast tier with the room for a whole pack
        reserved, so it cannot find the disk full halfway (another process filling it
        meanwhile); None, with nothing left behind, without a tier or where its disk has no
        such room, whatever its budget says: the pack then goes to the locations, as without
        a tier, rather than failing the commit. A file system without ``fallocate`` is
        trusted with what :meth:`FastTier.room_for` saw."""
        tier = self._tier
        if tier is None or not tier.room_for(self._ctx.config.pack_size):
            return None
        try:
            path = tier.scratch.path() / f"{uuid.uuid4().hex}.pack"
            file = open(path, "wb")  # noqa: SIM115 - closed in _close()/abort(), or below
        except OSError:
            return None
        try:
            os.posix_fallocate(file.fileno(), 0, self._ctx.config.pack_size + self._ctx.config.chunk_size)
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE:
                file.close()
                path.unlink(missing_ok=True)
                return None
        return path, file

    def _write_error(self, exc: OSError, path: Path | None, size: int) -> StorageError:
        """A failed staging write of pack ``path`` (``size`` bytes with what was being
        written): StorageFullError naming the staging directory when it has no room (disk,
        quota, file-size limit), else StorageError. The caller aborts."""
        where = str(path.parent if path is not None else self._ctx.staging.base)
        return full_error(exc, "a staging pack", where, size,
                          elsewhere="open the store with a cache directory on a larger disk (cache=)")

    def _close(self) -> None:
        """Have the sink seal the open pack (footer, trailer, id) and hand it to the upload
        pool; wait while more than ``upload_workers`` packs are pending."""
        writer, file, path, held = self._writer, self._file, self._path, self._held
        if writer is None or file is None or path is None or self._sink is None:
            return
        self._writer, self._file, self._path, self._filled = None, None, None, 0
        stored: Future[StoredPack] = Future()

        def seal(error: BaseException | None) -> None:
            if error is not None:
                stored.set_exception(error)
                return
            try:
                try:
                    pack_id = writer.finish()
                    if held:
                        file.truncate()  # what was reserved and not filled
                    file.close()  # the blob store makes it durable (local: fsync + rename)
                except OSError as exc:
                    raise self._write_error(exc, path, writer.size) from exc
                with self._staged_lock:  # the upload removes it from here on
                    del self._staged[path]
                upload = self._ctx.uploads.submit(self._store, pack_id, writer.size, writer.entries,
                                                  path, held)
            except BaseException as exc:
                stored.set_exception(exc)
                raise
            upload.add_done_callback(lambda done: _settle(stored, done))

        self._sink.put(seal)
        self._pending.append(stored)
        while len(self._pending) > self._in_flight:
            self.packs.append(self._pending.popleft().result())

    def _store(self, pack_id: str, size: int, entries: Sequence[PackEntry], path: Path,
               held: bool) -> StoredPack:
        try:
            layout = (self._tier.write(pack_id, path, size, self._redundancy, self._ctx.config.backpressure)
                      if held and self._tier is not None else None)
            if layout is None:
                layout = self._ctx.packs.writer.write(pack_id, path, size, self._redundancy)
        finally:
            path.unlink(missing_ok=True)
        record = StoredPack(layout, entries)
        self._record(record)
        if layout.tier is None:  # a fast-tier pack is found through the catalog until it drained:
            # the cache is shared by every store handle of this host, whatever tier it uses
            self._ctx.cache.put_many([(e.chunk_id, record.id, e.offset, e.stored_len, e.raw_len, e.codec)
                                      for e in record.entries])
        return record

    def finish(self) -> list[StoredPack]:
        """Close the open pack and wait until every pack is durable and recorded.

        Raises the first storage or catalog error of any pack.
        """
        self._close()
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.stop()
        while self._pending:
            self.packs.append(self._pending.popleft().result())
        return self.packs

    def abort(self) -> None:
        """After a failure: stop the sink (dropping what it has not written yet), remove the
        staging files no upload took over, wait for uploads in flight (ignoring their errors;
        each removes its own staging file). Raises no OSError, so the failure that led here is
        the one the caller sees."""
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.stop(discard=True)
        self._writer, self._file, self._path = None, None, None
        with self._staged_lock:
            staged, self._staged = self._staged, {}
        for path, file in staged.items():
            with suppress(OSError):  # its last buffered write may fail again; the file goes anyway
                file.close()
            with suppress(OSError):
                path.unlink(missing_ok=True)
        for future in self._pending:
            future.exception()
        self._pending.clear()


def _settle(stored: Future[StoredPack], upload: Future[StoredPack]) -> None:
    """Pass an upload's outcome on to the future the packer waits on."""
    error = upload.exception()
    if error is not None:
        stored.set_exception(error)
    else:
        stored.set_result(upload.result())
