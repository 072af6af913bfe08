"""A copy's chunks in one pipeline across its versions: read ahead, packed, uploaded.

Every chunk a copy sends goes through ONE :class:`~casckpt.engine.write.packer.Packer` per
redundancy for the whole copy (the destination's own writer: packs of its size across
versions, uploads in flight while the next chunks are read and encoded), fed in batches of
a quarter pack, each batch of one version only. The next :data:`AHEAD` batches are read
from the source (and verified, :func:`.copychunks.fetch`) on threads of their own while this
one is encoded and packed: memory holds at most ``AHEAD + 1`` batches of raw bytes beside
the packer's own bound.

A pack is recorded in the destination's catalog as its upload lands (resumable: a copy
killed midway leaves its recorded chunks held there); :meth:`Pipeline.recorded_upto` says when
every chunk a version sent is recorded, so the copy publishes it then -- not before, and
without waiting for the packs of the versions after it. Chunks a publish finds swept by the
destination's gc go through the same packers (:meth:`Pipeline.resend`), which then store
what they hold at once: the publish waits for those chunks alone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from casckpt.catalog import StoredPack
from casckpt.engine.context import EngineContext
from casckpt.engine.copying.copychunks import Sent, batches, fetch, sizes_of
from casckpt.engine.copying.copyplan import VersionPlan
from casckpt.engine.read.degraded import shortfalls
from casckpt.engine.write.commitchunks import ChunkBytes, ChunkWrite, Progress, pack_chunks
from casckpt.engine.write.packer import Packer
from casckpt.storage.erasure import Redundancy

__all__ = ["AHEAD", "Batch", "Pipeline", "plan_batches"]

AHEAD = 3  # batches read from the source ahead of the one being packed
_BATCH_SHARE = 4  # a batch is about 1/_BATCH_SHARE of the destination's pack size


@dataclass(frozen=True, slots=True)
class Batch:
    """Chunks of one version to send together."""

    version: VersionPlan
    ids: list[bytes]
    sizes: dict[bytes, int]


def plan_batches(source: EngineContext, dest: EngineContext, version: VersionPlan,
                 ids: Sequence[bytes]) -> list[Batch]:
    """``ids`` (chunks and nodes of ``version``) cut into batches of about a quarter pack.

    Raises:
        MissingDataError: the source's catalog lacks one of them.
    """
    sizes = sizes_of(source, version, ids)
    limit = max(dest.config.pack_size // _BATCH_SHARE, dest.config.chunk_size)
    return [Batch(version, batch, {c: sizes[c] for c in batch}) for batch in batches(ids, sizes, limit)]


class Pipeline:
    """Reads ``work`` ahead on threads, packs it with one packer per redundancy and
    records which chunks landed. Call :meth:`next_batch` for each batch in order, then
    :meth:`pack` it; :meth:`finish` at the end, :meth:`abort` after a failure."""

    def __init__(self, source: EngineContext, dest: EngineContext, work: Sequence[Batch]) -> None:
        self._source, self._dest, self._work = source, dest, work
        self._packers: dict[Redundancy, Packer] = {}
        self._recorded: set[bytes] = set()
        self._lock = threading.Lock()
        self._readers = ThreadPoolExecutor(AHEAD, thread_name_prefix="casckpt-copy-read")
        self._reads: dict[int, Future[dict[bytes, ChunkBytes]]] = {}
        self._next = 0

    def next_batch(self) -> tuple[Batch, dict[bytes, ChunkBytes]]:
        """The next batch and its chunks, read and verified (the reads of the batches after it
        are started first)."""
        index = self._next
        self._next += 1
        for ahead in range(index, min(index + AHEAD + 1, len(self._work))):
            if ahead not in self._reads:
                batch = self._work[ahead]
                self._reads[ahead] = self._readers.submit(fetch, self._source, self._dest, batch.version,
                                                          batch.ids, batch.sizes)
        return self._work[index], self._reads.pop(index).result()

    def pack(self, batch: Batch, chunks: dict[bytes, ChunkBytes], redundancy: Redundancy) -> ChunkWrite:
        """Encode ``batch`` and add it to the copy's packer for ``redundancy`` (returns without
        waiting for its packs: see :meth:`recorded_upto`); its raw and stored tensor bytes."""
        packer = self._packers.get(redundancy)
        if packer is None:
            packer = self._packers[redundancy] = Packer(self._dest, redundancy, self._record)
        before = packer.stored_bytes
        bar = Progress(None, "copy", 0)
        nodes, node_stored = pack_chunks(self._dest, packer, chunks, batch.ids, None, bar)
        return ChunkWrite(bar.done - nodes, packer.stored_bytes - before - node_stored)

    def _record(self, pack: StoredPack) -> None:
        """On an upload thread: record a stored pack, then count its chunks as landed."""
        record_pack(self._dest, pack)
        with self._lock:
            self._recorded.update(e.chunk_id for e in pack.entries)

    def recorded_upto(self, ids: Sequence[bytes], start: int) -> int:
        """How many of ``ids`` (sent by this pipeline, in order), from ``start`` on, are stored
        and recorded: the index of the first that is not (``len(ids)``: all). Callers keep the
        index, so each id is looked at about once while upload threads wait on the lock."""
        with self._lock:
            end = start
            while end < len(ids) and ids[end] in self._recorded:
                end += 1
            return end

    def resend(self, version: VersionPlan, ids: Sequence[bytes], redundancy: Redundancy, sent: Sent,
               bar: Progress | None = None) -> int:
        """Read ``ids`` (chunks of ``version`` the destination's gc swept after they were found
        held) on this thread, pack them with the copy's packer for ``redundancy`` and wait until
        they are stored and recorded (the packer's open pack is stored then, with whatever of
        the next versions it holds); counted in ``sent`` and in the copy's progress ``bar``
        (its total grows by what is sent again).

        Raises:
            MissingDataError, CorruptChunkError: a chunk could not be read whole from the source.
            StorageError, CatalogError: a pack could not be stored or recorded.
        """
        read = 0
        planned = plan_batches(self._source, self._dest, version, ids)
        if bar is not None:
            bar.total += sum(sum(b.sizes.values()) for b in planned)
        for batch in planned:
            chunks = fetch(self._source, self._dest, version, batch.ids, batch.sizes)
            sent.add(self.pack(batch, chunks, redundancy), len(batch.ids))
            read += sum(batch.sizes.values())
            del chunks
            if bar is not None:
                bar.advance(sum(batch.sizes.values()))
        self._store(redundancy, sent)
        return read

    def finish(self, sent: Sent) -> None:
        """Wait until every pack is stored and recorded; counts the degraded ones in ``sent``.
        A :meth:`resend` may follow (a publish after the last batch).

        Raises the first storage or catalog error of any pack.
        """
        self._readers.shutdown()
        for redundancy in list(self._packers):
            self._store(redundancy, sent)

    def _store(self, redundancy: Redundancy, sent: Sent) -> None:
        """Finish the packer for ``redundancy`` (its open pack stored too) and wait until its
        packs are recorded; counts in ``sent`` those below their redundancy. The next chunk
        of that redundancy starts a packer of its own."""
        packer = self._packers.pop(redundancy)
        try:
            packs = packer.finish()
        except BaseException:
            packer.abort()
            raise
        stored = (p.layout for p in packs if p.layout.tier is None)
        sent.degraded += shortfalls(self._dest, stored)

    def abort(self) -> None:
        """After a failure: stop reading ahead, drop what is not stored (see
        :meth:`Packer.abort`)."""
        self._readers.shutdown(cancel_futures=True)
        for packer in self._packers.values():
            packer.abort()


def record_pack(dest: EngineContext, pack: StoredPack) -> None:
    """Record a pack the copy stored in the destination's catalog (tests hook this)."""
    dest.catalog.add_pack(pack)
