"""A copy's chunks: read from the source, verified, packed by the destination.

Chunks travel decoded: each is read through the source's verified reader (a delta-coded
chunk is decoded through its chain there), checked against its id by the destination's
chunk ids, then encoded and packed by the destination's own pipeline
(:func:`casckpt.engine.write.commitchunks.pack_chunks`: its compression, pack size,
redundancy and locations; no delta coding, so every copied chunk is a keyframe the
destination decodes alone). Tree nodes travel as the plan read them (verified then).

A copy sends its chunks through one pipeline across its versions (:mod:`.copypipe`),
chunks a publish finds swept by the destination's gc included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from casckpt.engine.context import EngineContext
from casckpt.engine.copying.copynodes import node_size
from casckpt.engine.copying.copyplan import VersionPlan
from casckpt.engine.read.degraded import Shortfall
from casckpt.engine.read.reader import read_chunks
from casckpt.engine.write.commitchunks import ChunkBytes, ChunkWrite
from casckpt.errors import CorruptChunkError, MissingDataError

__all__ = ["Sent", "batches", "fetch", "sizes_of"]


@dataclass(slots=True)
class Sent:
    """What a copy wrote at the destination: raw and stored bytes of tensor data (tree nodes
    apart, as commits count them), chunks (nodes included), and the packs below their
    redundancy (found as the pipeline stores them)."""

    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    degraded: list[Shortfall] = field(default_factory=list)

    def add(self, written: ChunkWrite, chunks: int) -> None:
        self.raw_bytes += written.raw_bytes
        self.stored_bytes += written.stored_bytes
        self.chunks += chunks


def sizes_of(source: EngineContext, version: VersionPlan, ids: Sequence[bytes]) -> dict[bytes, int]:
    """Each chunk's raw length (nodes: the sizes the plan holds; chunks: the source's catalog)."""
    out = {i: node_size(version.nodes, i) for i in ids if i in version.nodes}
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
