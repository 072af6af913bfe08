"""Reads chunks out of packs into destination buffers, verifying every byte: the entry point
of every restore, check and repack read (:func:`read_chunks`).

Plain chunks (keyframes, RAW or encoded) are read in coalesced ranged reads, each chunk
verified as it lands (:mod:`~casckpt.engine.read.chunkreads`); delta-coded chunks through
their chains (:mod:`~casckpt.engine.read.deltachains`, which decodes each node with
:mod:`~casckpt.engine.read.deltadecode`). Every record the catalog gives is checked before a
byte is allocated or read for it, and a pack that vanished mid-read is located again once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from casckpt.catalog import ChunkLocation
from casckpt.engine.context import EngineContext
from casckpt.engine.read.chunkreads import Destination, PackGone, locate, read_located
from casckpt.engine.read.deltachains import DeltaReader
from casckpt.errors import CorruptChunkError
from casckpt.format.codecs import lookup
from casckpt.types import ProgressCallback

__all__ = ["Destination", "read_chunks"]


def read_chunks(
    ctx: EngineContext,
    wanted: Mapping[bytes, list[Destination]],
    describe: Callable[[bytes], str],
    progress: ProgressCallback | None = None,
    *, heal: bool = True,
) -> int:
    """Fill every destination of every wanted chunk (id -> byte views) with its verified raw
    bytes; returns the bytes read from the blob store. ``describe`` names what a chunk belongs
    to, for error messages.

    A pack that vanished mid-read (GC repacked it: its chunks now live in a
    new pack) is handled by locating the chunks again and reading once more.

    Raises:
        MissingDataError: a chunk is unknown to the catalog, or its pack is gone.
        CorruptChunkError: stored bytes fail verification.
    """
    try:
        return _read_all(ctx, wanted, describe, progress, heal=heal)
    except PackGone:
        return _read_all(ctx, wanted, describe, progress, last_try=True, heal=heal)


def _check_sizes(wanted: Mapping[bytes, list[Destination]], locations: Mapping[bytes, ChunkLocation],
                 describe: Callable[[bytes], str]) -> None:
    """Every destination of a chunk is as long as the catalog says the chunk is."""
    for cid, destinations in wanted.items():
        raw_len = locations[cid].raw_len
        if any(len(d) != raw_len for d in destinations):
            raise CorruptChunkError(
                f"the catalog records chunk {cid.hex()} of {describe(cid)} as {raw_len} bytes, but the "
                f"version's manifest needs {len(destinations[0])}: the catalog is damaged. Run "
                "`casckpt check` and restore another version.", chunk_id=cid.hex())


def _read_all(ctx: EngineContext, wanted: Mapping[bytes, list[Destination]],
              describe: Callable[[bytes], str], progress: ProgressCallback | None,
              last_try: bool = False, heal: bool = True) -> int:
    locations = locate(ctx, wanted, describe)
    _check_sizes(wanted, locations, describe)
    plain = {cid: dsts for cid, dsts in wanted.items() if not lookup(locations[cid].codec).is_delta}
    done = read_located(ctx, plain, locations, describe, progress, last_try, heal)
    deltas = [cid for cid in wanted if cid not in plain]
    if deltas:
        reader = DeltaReader(ctx, locations, describe, last_try, heal)
        done += reader.read({c: wanted[c] for c in deltas})
    return done
