"""A copy's chunks: read from the source, verified, packed by the destination.

Chunks travel decoded: each is read through the source's verified reader (a delta-coded
chunk is decoded through its chain there), checked against its id by the destination's
chunk ids, then encoded and packed by the destination's own pipeline
(:func:`casckpt.engine.write.commitchunks.write_chunks`: its compression, pack size,
redundancy and locations; no delta coding, so every copied chunk is a keyframe the
destination decodes alone). Tree nodes travel as the plan read them (verified then).

A copy sends its chunks through one pipeline across its versions (:mod:`.copypipe`);
:func:`send` writes a few chunks on their own, a batch of about one pack at a time, each
stored and recorded before the next is read (what a publish finds swept by the
destination's gc meanwhile is sent again this way).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from casckpt.engine.context import EngineContext
from casckpt.engine.copying.copyplan import VersionPlan
from casckpt.engine.read.reader import read_chunks
from casckpt.engine.write.commitchunks import ChunkBytes, ChunkWrite, Progress, write_chunks
from casckpt.errors import CorruptChunkError, MissingDataError
from casckpt.storage.erasure import Redundancy

__all__ = ["Sent", "batches", "fetch", "send", "sizes_of"]


@dataclass(slots=True)
class Sent:
    """What a copy wrote at the destination: raw and stored bytes of tensor data (tree nodes
    apart, as commits count them), chunks (nodes included), and the packs below their
    redundancy."""

    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    degraded: int = 0

    def add(self, written: ChunkWrite, chunks: int) -> None:
        self.raw_bytes += written.raw_bytes
        self.stored_bytes += written.stored_bytes
        self.chunks += chunks
        self.degraded += len(written.degraded)


def send(source: EngineContext, dest: EngineContext, version: VersionPlan, ids: Sequence[bytes],
         redundancy: Redundancy, bar: Progress, sent: Sent) -> None:
    """Read ``ids`` (chunks and nodes of ``version``) from ``source``, verify them and write
    them to ``dest`` with ``redundancy``, a batch of about one pack at a time.

    Raises:
        MissingDataError: the source lacks a chunk (gc swept it, or its pack is lost).
        CorruptChunkError: a chunk failed verification on either side.
        StorageError: the destination could not store a pack.
    """
    sizes = sizes_of(source, version, ids)
    for batch in batches(ids, sizes, max(dest.config.pack_size, dest.config.chunk_size)):
        chunks = fetch(source, dest, version, batch, sizes)
        sent.add(write_chunks(dest, chunks, batch, redundancy, None), len(batch))
        bar.advance(sum(sizes[c] for c in batch))


def sizes_of(source: EngineContext, version: VersionPlan, ids: Sequence[bytes]) -> dict[bytes, int]:
    """Each chunk's raw length (nodes: the bytes the plan holds; chunks: the source's catalog)."""
    out = {i: len(version.nodes[i]) for i in ids if i in version.nodes}
    rest = [i.hex() for i in ids if i not in out]
    found = source.catalog.find_chunks(rest, live_only=False)
    for h in rest:
        if h not in found:
            raise MissingDataError(
                f"chunk {h[:16]} of version {version.row.id[:12]} ({version.row.run}@{version.row.step}) is "
                "not in the source's catalog (gc swept it while the copy ran, or the source is damaged): "
                "run `casckpt check` on the source, then copy again")
        out[bytes.fromhex(h)] = found[h].raw_len
    return out


def batches(ids: Sequence[bytes], sizes: Mapping[bytes, int], limit: int) -> Iterator[list[bytes]]:
    """``ids`` in order, cut into lists of at most ``limit`` raw bytes (or one chunk)."""
    batch: list[bytes] = []
    filled = 0
    for cid in ids:
        if batch and filled + sizes[cid] > limit:
            yield batch
            batch, filled = [], 0
        batch.append(cid)
        filled += sizes[cid]
    if batch:
        yield batch


def fetch(source: EngineContext, dest: EngineContext, version: VersionPlan, batch: Sequence[bytes],
           sizes: Mapping[bytes, int]) -> dict[bytes, ChunkBytes]:
    """``batch`` as chunks to write: nodes from the plan, the rest read (verified) from the
    source; every one then checked against its id by the destination's chunk ids."""
    buffers = {cid: bytearray(sizes[cid]) for cid in batch if cid not in version.nodes}
    if buffers:
        row = version.row
        read_chunks(source, {cid: [memoryview(buf)] for cid, buf in buffers.items()},
                    lambda cid: f"version {row.id[:12]} ({row.run}@{row.step})")
    chunks: dict[bytes, ChunkBytes] = {}
    for cid in batch:
        node = cid in version.nodes
        data = memoryview(version.nodes[cid] if node else buffers[cid])
        chunks[cid] = ChunkBytes(data, 0, len(data), 1 if node else version.aligns.get(cid, 1),
                                 owned=True, node=node)
    got = list(dest.pool.map(dest.crypto.chunk_id, (chunks[c].data() for c in batch)))
    for cid, hashed in zip(batch, got, strict=True):
        if hashed != cid:
            raise CorruptChunkError(
                f"chunk {cid.hex()[:16]} of version {version.row.id[:12]} read from the source does not "
                "match its id at the destination; nothing of this version was published. Run `casckpt "
                "check` on the source", chunk_id=cid.hex())
    return chunks
