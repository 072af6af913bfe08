"""One node of a delta chain decoded: the step both ways of decoding a chain share.

A decoded chunk is held as a :data:`Rep`, (group width, its bytes in that grouped order):
XOR commutes with byte grouping, so a chain of dense deltas is applied in the deltas'
grouped byte order (``codecs.delta_planes``, ``byteplanes.regroup``) and ungrouped once, straight into
the destination of the chunk that ends it. A sparse delta (codec 9) is applied in element
order, patching only its changed blocks.

:func:`decode_keyframe` and :func:`decode_delta` decode one node from its slot (header and
payload as read by :func:`~casckpt.engine.read.chunkreads.read_located`) and, for a delta,
its base's Rep. A node with destinations gets its bytes in element order written to each
of them, checked against its id; with ``verify``, a node without destinations is checked
too. The delta chain reader (:mod:`~casckpt.engine.read.deltachains`) calls them without
``verify`` on its fast path (every wanted chunk checked once, at the end of its chain) and
with it on its verifying pass (every node checked at its level, so the damaged one is
named).

Thread-safety: functions of their arguments only; a base passed as ``own`` is patched in
place, so its caller must hold the only reference to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from casckpt.engine.read.chunkreads import Destination, Slot, decode_slot
from casckpt.errors import CorruptChunkError
from casckpt.format.byteplanes import regroup, ungroup_into
from casckpt.format.chunks import ChunkIds
from casckpt.format.codecs import Delta, apply_sparse, delta_planes, lookup, sparse_planes
from casckpt.format.pack import check_entry_header

Rep = tuple[int, np.ndarray]  # a decoded chunk: (group width, its bytes in that grouped order; 1: plain)


def decode_keyframe(ids: ChunkIds, slot: Slot, *, verify: bool) -> Rep:
    """A keyframe's chunk, decoded into its slot's first destination when it has one (then
    copied to the others), checked against its id if ``verify``.

    Raises:
        CorruptChunkError: its header or payload is damaged, or (``verify``) its bytes do not
            match its id.
    """
    destinations = slot.destinations
    raw = decode_slot(ids, slot, destinations[0] if destinations else None, verify=verify)
    data = np.frombuffer(raw, dtype=np.uint8)
    _copy_out(raw, data, destinations)
    return 1, data


def decode_delta(ids: ChunkIds, slot: Slot, base: Rep, destinations: Sequence[Destination], *,
                 end: bool, own: bool = False, verify: bool = False) -> Rep:
    """A delta's chunk, in the delta's grouped order: its slot's XOR planes applied to ``base``.

    With ``destinations``, its bytes in element order are written to each of them (an ``end``
    of chain -- no delta of this pass is coded against it -- is decoded straight into the
    first) and checked against its id; with ``verify``, a chunk without destinations is
    ungrouped and checked too. A base the delta ``own`` s (no one else needs it) is patched or
    XORed in place.

    Raises:
        CorruptChunkError: its header or payload is damaged, its base is not as long as it,
            or its decoded bytes do not match its id.
    """
    sparse = lookup(slot.entry.codec).delta is Delta.SPARSE
    into = destinations[0] if destinations and end and (base[0] == 1 or sparse) else None
    rep = _apply(slot, base, into, own)
    if destinations or verify:
        raw = _ungrouped(rep, destinations)
        if ids(raw) != slot.entry.chunk_id:
            raise _chain_mismatch(slot)
        _copy_out(raw, np.frombuffer(raw, dtype=np.uint8), destinations)
    return rep


def _copy_out(raw: memoryview | bytes, data: np.ndarray, destinations: Sequence[Destination]) -> None:
    """``raw`` (whose array is ``data``) written to each destination, but the first where the
    chunk was decoded into it."""
    for i, dst in enumerate(destinations):
        if i or not _same_bytes(dst, data):
            dst[:] = raw


def _ungrouped(rep: Rep, destinations: Sequence[Destination]) -> memoryview:
    """A decoded chunk's bytes in element order -- written straight into its first destination."""
    width, data = rep
    if width == 1:
        return memoryview(data)  # type: ignore[arg-type]  # numpy exports the buffer
    out = np.frombuffer(destinations[0], dtype=np.uint8) if destinations else np.empty(data.nbytes, np.uint8)
    return memoryview(ungroup_into(data, width, out))  # type: ignore[arg-type]


def _apply(slot: Slot, base: Rep, into: Destination | None = None, own: bool = False) -> Rep:
    """A delta slot's chunk in the delta's grouped order: its XOR planes applied to its base.

    With ``into`` (the chunk ends its chain and its base is in element order), the result lands
    in ``into`` in element order: a dense delta's planes are ungrouped straight into it and the
    base XORed there (one pass fewer than regrouping); a sparse delta patches only its changed
    blocks, in element order. A base this delta ``own``s (no one else needs it) is patched or
    XORed in place.
    """
    entry = slot.entry
    check_entry_header(slot.header, entry, slot.pack_id)
    sparse = lookup(entry.codec).delta is Delta.SPARSE
    try:
        if sparse:
            index, blocks = sparse_planes(slot.payload, entry.raw_len)
        else:
            width, planes = delta_planes(entry.codec, slot.payload, entry.raw_len)
    except CorruptChunkError as exc:
        raise CorruptChunkError(f"chunk {entry.chunk_id.hex()} in pack {slot.pack_id} is corrupt: {exc}",
                                pack_id=slot.pack_id, chunk_id=entry.chunk_id.hex()) from exc
    if base[1].nbytes != entry.raw_len:
        raise _chain_mismatch(slot)
    if sparse:
        return _apply_sparse(base, index, blocks, into, own)
    if into is not None and not _same_bytes(into, base[1]):
        out = np.frombuffer(into, dtype=np.uint8)
        if width == 1:
            np.bitwise_xor(planes, base[1], out=out)
        else:
            np.bitwise_xor(ungroup_into(planes, width, out), base[1], out=out)
        return 1, out
    grouped = regroup(base[1], base[0], width)
    mine = (own or grouped is not base[1]) and grouped.flags.writeable
    return width, np.bitwise_xor(planes, grouped, out=grouped if mine else None)


def _apply_sparse(base: Rep, index: np.ndarray, blocks: np.ndarray, into: Destination | None,
                  own: bool) -> Rep:
    plain = regroup(base[1], base[0], 1)
    if into is not None:
        out = np.frombuffer(into, dtype=np.uint8)
        if not _same_bytes(into, plain):  # else the chain was decoded where it ends
            out[:] = plain
    elif (own or plain is not base[1]) and plain.flags.writeable:
        out = plain  # the base is this delta's alone (or a fresh regrouped copy): patch it in place
    else:
        out = plain.copy()
    return 1, apply_sparse(out, index, blocks)


def _same_bytes(view: Destination, data: np.ndarray) -> bool:
    """Whether ``data`` is ``view``'s memory (a chunk decoded into its destination, or a keyframe
    into the destination of the chain it starts)."""
    return data.nbytes == len(view) and bool(data.ctypes.data == np.frombuffer(view, np.uint8).ctypes.data)


def _chain_mismatch(slot: Slot) -> CorruptChunkError:
    cid = slot.entry.chunk_id.hex()
    return CorruptChunkError(
        f"chunk {cid} in pack {slot.pack_id}, decoded through its delta chain, does not match its id: "
        "it or one of its bases is corrupt. Run `casckpt check --read-data`, restore another version, "
        "or `casckpt repair`.", pack_id=slot.pack_id, chunk_id=cid)
