"""A commit's chunks: where their bytes are, hashing and dedup, encoding and packing.

The middle of the commit pipeline (:mod:`casckpt.engine.write.commit`): extents are cut into
chunks and hashed in place (device tensors streamed through staging buffers), the chunks
the store holds are looked up (cache entries, then the catalog), and the new ones are
encoded (delta-coded where it pays) and packed. :class:`ChunkBytes` says where each
chunk's raw bytes are until they are written; owned copies let a background commit
free the caller's state early.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from casckpt.engine.context import EngineContext
from casckpt.engine.read.degraded import Shortfall, shortfalls
from casckpt.engine.versions.extents import ExtentSource
from casckpt.engine.write.encodepolicy import EncodePlan, plain_plan
from casckpt.engine.write.packer import Packer
from casckpt.format.chunks import aligned_chunk_size, chunk_spans
from casckpt.format.manifest import ExtentEntry
from casckpt.format.treeencode import Tree
from casckpt.storage.erasure import Redundancy
from casckpt.types import ProgressCallback


@dataclass(slots=True)
class ChunkBytes:
    """Where a chunk's raw bytes are: in this commit's state (first occurrence), or, when
    ``owned``, in a copy the commit made (the state may change meanwhile)."""

    view: memoryview
    start: int
    end: int
    align: int
    owned: bool = False
    node: bool = False  # a tree node (counted apart from tensor bytes)

    def data(self) -> memoryview:
        return self.view[self.start : self.end]


class Progress:
    """A phase's progress, reported to a :data:`ProgressCallback` as it advances."""

    def __init__(self, callback: ProgressCallback | None, phase: str, total: int) -> None:
        self.callback, self.phase, self.total, self.done = callback, phase, total, 0

    def advance(self, amount: int) -> None:
        """Count ``amount`` more done and report."""
        self.done += amount
        if self.callback is not None:
            self.callback(self.phase, self.done, self.total)


@dataclass(slots=True)
class Hashed:
    """Every chunk of a state: its extents' chunk lists, and where each chunk's bytes are.

    Streamed (staged) extents are classified while they stream, since their
    bytes do not stay on the host: ``known`` the chunks the store holds (no
    bytes kept); the new ones are copied out of the staging buffers.
    """

    extents: list[ExtentEntry]
    chunks: dict[bytes, ChunkBytes]
    known: set[bytes]
    reserved: int = 0  # bytes of streamed copies admitted into a background commit's budget


NOT_HELD = memoryview(b"")  # a streamed chunk the store holds: its bytes stayed on the device


Reserve = Callable[[int], bool]  # asked for the bytes to copy; False: do not copy (write from the views)


def hash_chunks(ctx: EngineContext, views: Sequence[memoryview]) -> list[bytes]:
    """The ids of chunks' bytes, hashed on the pool (the store's chunk ids: keyed in an
    encrypted store). Every tensor byte a commit hashes goes through here."""
    return list(ctx.pool.map(ctx.crypto.chunk_id, views))


def hash_extents(
    ctx: EngineContext, sources: Sequence[ExtentSource], progress: ProgressCallback | None,
    pending: Mapping[bytes, ChunkBytes] | None, reserve: Reserve | None = None, confirm: bool = False,
    reuse: Mapping[int, ExtentEntry] | None = None,
) -> Hashed:
    """Cut every extent into chunks and hash them in place, except the extents of ``reuse``
    (index -> the previous version's entry, see :mod:`casckpt.engine.write.hint`): their chunk
    ids are taken as they are, their bytes not read."""
    out = Hashed([], {}, set())
    bar = Progress(progress, "hash", sum(s.nbytes for s in sources))
    for index, source in enumerate(sources):
        size = aligned_chunk_size(ctx.config.chunk_size, source.align)
        phase = source.grid_offset % size
        reused = reuse.get(index) if reuse else None
        if reused is not None:
            _take_reused(source, reused, out)
            bar.advance(source.nbytes)
            continue
        if source.staged is not None and source.nbytes:
            flat = source.staged()
            head = min(size - phase, source.nbytes) if phase else 0
            ids = _hash_staged(ctx, flat[:head], source.align, head, out, pending, reserve, confirm) \
                if head else []
            if head < source.nbytes:
                ids += _hash_staged(ctx, flat[head:], source.align, size, out, pending, reserve, confirm)
        else:
            view = source.read() if source.nbytes else memoryview(b"")
            spans = list(chunk_spans(source.nbytes, size, phase))
            if source.digest is not None and spans == [(0, source.nbytes)]:
                ids = [source.digest]  # one chunk, hashed already
            else:
                ids = hash_chunks(ctx, [view[start:end] for start, end in spans])
            for cid, (start, end) in zip(ids, spans, strict=True):
                out.chunks.setdefault(cid, ChunkBytes(view, start, end, source.align))
        out.extents.append(ExtentEntry(source.nbytes, size, tuple(ids), phase, packed=source.packed))
        bar.advance(source.nbytes)
    return out


def _take_reused(source: ExtentSource, extent: ExtentEntry, out: Hashed) -> None:
    """A hinted extent's chunks, from the previous version's entry: their bytes stay where
    they are (read only should publishing find a chunk gone, and then verified against its
    id; a device tensor's are not held)."""
    view = NOT_HELD if source.staged is not None or not source.nbytes else source.read()
    for cid, (start, end) in zip(extent.chunks, extent.spans(), strict=True):
        out.chunks.setdefault(cid, ChunkBytes(view, start, end, source.align) if view is not NOT_HELD
                              else ChunkBytes(NOT_HELD, 0, 0, source.align))
    out.extents.append(extent)


def _hash_staged(ctx: EngineContext, flat: torch.Tensor, align: int, size: int, out: Hashed,
                 pending: Mapping[bytes, ChunkBytes] | None, reserve: Reserve | None,
                 confirm: bool = False) -> list[bytes]:
    """Stream a device extent through the staging buffers: hash each window, look its chunks
    up, and copy out only the ones the store does not hold -- admitted into a background
    commit's budget window by window (a window larger than the whole budget is copied anyway:
    the bytes cannot stay on the device)."""
    ids: list[bytes] = []
    for _offset, view in ctx.device_buffers.stream(flat, size):
        spans = list(chunk_spans(len(view), size))
        window = hash_chunks(ctx, [view[start:end] for start, end in spans])
        fresh = [c for c in dict.fromkeys(window) if c not in out.chunks]
        known = known_chunks(ctx, fresh, confirm)
        known |= {c for c in fresh if pending is not None and c in pending}
        need = sum(end - start for cid, (start, end) in dict(zip(window, spans, strict=True)).items()
                   if cid in fresh and cid not in known)
        if reserve is not None and need and reserve(need):
            out.reserved += need
        for cid, (start, end) in zip(window, spans, strict=True):
            if cid in out.chunks:
                continue
            if cid in known:
                out.known.add(cid)
                held = pending.get(cid) if pending is not None else None
                out.chunks[cid] = held or ChunkBytes(NOT_HELD, 0, 0, align)
            else:
                out.chunks[cid] = owned_copy(ChunkBytes(view, start, end, align))
        ids.extend(window)
    return ids


def known_chunks(ctx: EngineContext, ids: Sequence[bytes], confirm: bool = False) -> set[bytes]:
    """The chunks among ``ids`` the store holds: the cache's entries, then the catalog (only the
    catalog with ``confirm``: for chunks whose writer could not write them again at publish)."""
    hinted = set() if confirm else set(ctx.cache.get_many(ids))
    unknown = [cid.hex() for cid in ids if cid not in hinted]
    if not unknown:  # no catalog round trip when the cache knows them all
        return hinted
    confirmed = {bytes.fromhex(h) for h in ctx.catalog.find_chunks(unknown)}
    return hinted | confirmed


Encoded = tuple[bytes, int, int, "bytes | memoryview", "bytes | None"]  # id, codec, raw length, payload, base


def _encoded(ctx: EngineContext, chunks: Mapping[bytes, ChunkBytes], ids: Sequence[bytes],
             plan: EncodePlan | None) -> Iterator[Encoded]:
    """``ids`` encoded on the pool in windows, in order, as ``plan`` chooses (None: a plan of no
    run, deltas and lessons: every chunk probed)."""
    window = 4 * ctx.config.workers
    plan = plan if plan is not None else plain_plan(ctx)

    def encode(cid: bytes) -> Encoded:
        chunk = chunks[cid]
        data = chunk.data()
        codec, payload, base = plan.encode(cid, data, chunk.align, chunk.owned)
        return cid, codec, len(data), payload, base

    for i in range(0, len(ids), window):
        yield from ctx.pool.map(encode, ids[i : i + window])


@dataclass(frozen=True, slots=True)
class ChunkWrite:
    """What :func:`write_chunks` wrote: raw and stored bytes of tensor data (tree nodes, the
    body of a tree manifest, are not counted: manifests never were), and the packs it could
    not place as their redundancy asks (see :mod:`.degraded`)."""

    raw_bytes: int
    stored_bytes: int
    degraded: tuple[Shortfall, ...] = ()


def write_chunks(
    ctx: EngineContext, chunks: Mapping[bytes, ChunkBytes], ids: Sequence[bytes],
    redundancy: Redundancy, progress: ProgressCallback | None, delta: EncodePlan | None = None,
    *, fast: bool = False,
) -> ChunkWrite:
    """Encode (delta-coding where ``delta`` says it pays) and pack ``ids`` (``fast``: onto the
    store's fast tier, when it has one: see :class:`Packer`)."""
    packer = Packer(ctx, redundancy, fast=fast)
    bar = Progress(progress, "write", sum(chunks[c].end - chunks[c].start for c in ids))
    try:
        nodes, node_stored = pack_chunks(ctx, packer, chunks, ids, delta, bar)
        packs = packer.finish()
    except BaseException:
        packer.abort()
        raise
    return ChunkWrite(bar.done - nodes, packer.stored_bytes - node_stored,
                      tuple(shortfalls(ctx, (p.layout for p in packs if p.layout.tier is None))))


def pack_chunks(ctx: EngineContext, packer: Packer, chunks: Mapping[bytes, ChunkBytes], ids: Sequence[bytes],
                delta: EncodePlan | None, bar: Progress) -> tuple[int, int]:
    """Encode ``ids`` on the pool (delta-coded where ``delta`` says it pays, else compressed
    where that pays) and add them to ``packer`` in order: every chunk any writer stores goes
    through here. Returns the raw and stored bytes of the tree nodes among them."""
    nodes = node_stored = 0
    for cid, codec, raw_len, payload, base in _encoded(ctx, chunks, ids, delta):
        packer.add(cid, codec, raw_len, payload, base)
        bar.advance(raw_len)
        if chunks[cid].node:
            nodes, node_stored = nodes + raw_len, node_stored + len(payload)
    return nodes, node_stored


def held_elsewhere(ids: Iterable[bytes]) -> dict[bytes, ChunkBytes]:
    """Chunks a snapshot references whose bytes this process does not hold (other ranks wrote
    them): publishing can re-check them, not write them again."""
    return {cid: ChunkBytes(NOT_HELD, 0, 0, 1) for cid in ids}


def hash_and_dedup(
    ctx: EngineContext, sources: Sequence[ExtentSource], progress: ProgressCallback | None,
    *, confirm: bool = False,
) -> tuple[list[ExtentEntry], dict[bytes, ChunkBytes], list[bytes]]:
    """Chunk and hash extents in place; returns their entries, every chunk, and the ids of the
    chunks the store does not hold (to be written from the views, which must not change).
    ``confirm``: trust only the catalog, not this host's cache (see :func:`known_chunks`)."""
    hashed = hash_extents(ctx, sources, progress, None, confirm=confirm)
    known = hashed.known | known_chunks(ctx, [c for c in hashed.chunks if c not in hashed.known], confirm)
    return hashed.extents, hashed.chunks, [c for c in hashed.chunks if c not in known]


def owned_copy(chunk: ChunkBytes) -> ChunkBytes:
    """An owned copy of a chunk's bytes (numpy copies release the GIL: the pool copies in parallel)."""
    copy = np.frombuffer(chunk.data(), dtype=np.uint8).copy()
    return ChunkBytes(memoryview(copy), 0, len(copy), chunk.align, owned=True,  # type: ignore[arg-type]
                  node=chunk.node)


def node_chunks(tree: Tree) -> dict[bytes, ChunkBytes]:
    """The nodes of a tree as chunks to write (a node is a chunk: stored in packs, kept by gc)."""
    return {node_id: ChunkBytes(memoryview(raw), 0, len(raw), 1, owned=True, node=True)
            for node_id, raw in tree.nodes.items()}
