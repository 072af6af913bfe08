"""Verifying a pack's shards: read each in full, check it, rebuild the pack from healthy ones.

Functions over a :class:`~casckpt.engine.packstore.PackStore` (kept apart so
each module stays one responsibility). A copy must hash to the pack id; a
shard's header must name its pack and index and its payload match the
BLAKE3 recorded in the header and the catalog; the rebuilt pack must hash
to its id. Health found is recorded in the catalog (repair's queue).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from casckpt.catalog import PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.errors import (
    BlobNotFoundError,
    CorruptPackError,
    OversizedObjectError,
    StorageError,
    UnsafeObjectError,
)
from casckpt.format.chunks import object_id
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header, payload_checksum
from casckpt.storage.erasure import DEFAULT_ALGORITHM

if TYPE_CHECKING:
    from casckpt.engine.packstore import PackStore

_SUBSETS_TRIED = 64  # K-subsets tried when shards pass their checksums yet do not decode


@dataclass(slots=True)
class ShardCheck:
    """What reading one pack's shards in full found."""

    healthy: list[int] = field(default_factory=list)
    damaged: dict[int, str] = field(default_factory=dict)  # index -> "missing" | "corrupt"
    notes: dict[int, str] = field(default_factory=dict)  # index -> what was wrong
    data: bytes | None = None  # the verified pack, when it could be rebuilt
    fragments: dict[int, bytes] = field(default_factory=dict)  # ec: healthy or rebuilt, by index


def _read_shard(store: PackStore, layout: PackLayout, sh: ShardRow) -> tuple[bytes | None, str, str]:
    """Read one shard in full and check it: (payload or None, state, note)."""
    loc = store.locations.get(sh.location_id)
    if loc is None or not loc.readable:
        return None, "missing", "its location is failed or unknown"
    try:
        data = loc.blobs.get(sh.key, max_size=expected_size(layout))
    except BlobNotFoundError:
        return None, "missing", f"object {sh.key} is missing from {loc.describe()}"
    except (OversizedObjectError, UnsafeObjectError) as exc:
        return None, "corrupt", f"object {sh.key} on {loc.describe()} is refused: {exc}"
    except StorageError as exc:
        return None, "missing", f"cannot read from {loc.describe()}: {exc}"
    if layout.scheme != "ec":
        if object_id(data) != layout.id:
            return None, "corrupt", f"copy on {loc.describe()} does not hash to the pack id"
        return data, "ok", ""
    where = f"shard {sh.index} of pack {layout.id} on {loc.describe()}"
    try:
        header = decode_shard_header(data, where)
    except CorruptPackError as exc:
        return None, "corrupt", str(exc)
    payload = memoryview(data)[SHARD_HEADER_SIZE:]
    if (header.pack_id, header.index) != (layout.id, sh.index) or len(payload) != header.payload_len:
        return None, "corrupt", f"{where} holds the wrong shard or is truncated"
    checksum = payload_checksum(payload)
    if checksum != header.checksum or (sh.checksum and checksum != sh.checksum):
        return None, "corrupt", f"{where} fails its checksum (bit rot?)"
    return bytes(payload), "ok", ""


def expected_size(layout: PackLayout) -> int:
    """The most bytes one object of this pack may hold: a copy is the whole pack; the shards of
    an erasure-coded pack are all one size (the largest recorded, as a row of a shard never
    written records 0)."""
    if layout.scheme != "ec":
        return layout.size
    return max((sh.size for sh in layout.shards), default=0)


def examine(store: PackStore, pack_id: str, *, read_all: bool = True) -> ShardCheck:
    """Read shards in full, verify each, and rebuild the pack from healthy ones.

    ``read_all`` reads every shard (a scrub); otherwise reading stops
    once enough healthy shards are in hand (a recovery). Shard health
    found is recorded in the catalog (damaged shards join repair's queue).
    """
    layout = store._must_layout(pack_id)
    result = ShardCheck()
    order = sorted(layout.shards, key=lambda sh: (sh.index >= layout.k, sh.index))
    payloads: dict[int, bytes] = {}
    def read(sh: ShardRow) -> tuple[ShardRow, tuple[bytes | None, str, str]]:
        return sh, _read_shard(store, layout, sh)

    if read_all:
        checks = list(store._io.map(read, order))
    else:  # K at a time, in parallel, until K are healthy
        checks, queue = [], list(order)
        while queue:
            missing = layout.k - sum(1 for _, (p, _s, _n) in checks if p is not None)
            if missing <= 0:
                break
            batch, queue = queue[:missing], queue[missing:]
            checks.extend(store._io.map(read, batch))
    for sh, (payload, state, note) in checks:
        if payload is None:
            result.damaged[sh.index] = state
            result.notes[sh.index] = note
        else:
            result.healthy.append(sh.index)
            payloads[sh.index] = payload
    result.data, inconsistent = _rebuild(store, layout, payloads, result.fragments)
    if result.data is None and read_all and layout.scheme == "ec" and len(payloads) >= layout.k:
        inconsistent = set(payloads)  # no K of them decode to the pack
    for index in inconsistent:  # checksums match, content does not: damaged before it was hashed
        result.healthy.remove(index)
        result.damaged[index] = "corrupt"
        result.notes[index] = "shard is intact on disk but inconsistent with the other shards"
    now_damaged = {i: st for i, st in result.damaged.items()
                   if (row := layout.shard(i)) is not None and row.state != st}
    if now_damaged:
        store._damaged(layout, now_damaged, "; ".join(result.notes[i] for i in now_damaged))
    if result.healthy:
        # a pack rebuilt and verified against its id counts as verified even when some
        # shards were damaged (those are queued for repair): scrubs then move on to others
        sql.mark_verified(store.catalog, pack_id, result.healthy, whole_pack=read_all)
    elif read_all:
        sql.mark_verified(store.catalog, pack_id, [], whole_pack=True)  # scrubs move on to others
    if read_all:  # a lost pack's chunks stop counting for dedup, so commits write them again
        (sql.mark_pack_found if result.data is not None else sql.mark_pack_lost)(store.catalog, pack_id)
    return result

def read_detached(store: PackStore, layout: PackLayout) -> tuple[bytes | None, dict[int, str]]:
    """Read a pack the catalog does not know yet (catalog rebuild): every shard in full,
    verified, and the pack rebuilt and checked against its id.

    Returns (the pack or None, each shard's state: ok / missing / corrupt).
    """
    checks = list(store._io.map(lambda sh: (sh.index, _read_shard(store, layout, sh)), layout.shards))
    payloads = {index: p for index, (p, _state, _note) in checks if p is not None}
    states = {index: state for index, (_p, state, _note) in checks}
    data, inconsistent = _rebuild(store, layout, payloads, {})
    states.update({index: "corrupt" for index in inconsistent})
    return data, states

def _rebuild(store: PackStore, layout: PackLayout, payloads: dict[int, bytes],
             fragments: dict[int, bytes]) -> tuple[bytes | None, set[int]]:
    """Rebuild the pack from verified payloads: (pack or None, payloads inconsistent with it).

    Fast path: the data fragments at hand, plus the missing ones
    reconstructed (kept in ``fragments`` with the healthy ones, for
    healing). Payloads are checked against their checksums, but one
    damaged before it was hashed would still pass; so when that does
    not give the pack id, all of them are decoded together, then subsets
    of K, and the payloads the winning pack does not re-encode to are reported.
    """
    if not payloads:
        return None, set()
    if layout.scheme != "ec":
        return next(iter(payloads.values())), set()
    if len(payloads) < layout.k:
        return None, set()
    code = store._code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
    fragments.update(payloads)
    try:
        fragments.update(code.reconstruct(
            payloads, [i for i in range(layout.k) if i not in payloads], f"pack {layout.id}"))
        start, stripe = layout.data_offset or 0, layout.stripe or 0
        data = b"".join(memoryview(fragments[i])[start : start + stripe]
                        for i in range(layout.k))[: layout.size]
        if object_id(data) == layout.id:
            return data, set()
    except CorruptPackError:
        pass
    fragments.clear()

    def attempt(subset: dict[int, bytes]) -> bytes | None:
        try:
            data = code.decode(subset, layout.size, f"pack {layout.id}")
        except CorruptPackError:
            return None
        return data if object_id(data) == layout.id else None

    whole = attempt(payloads)
    if whole is not None:
        return whole, set()
    for combo in itertools.islice(itertools.combinations(sorted(payloads), layout.k), _SUBSETS_TRIED):
        whole = attempt({i: payloads[i] for i in combo})
        if whole is not None:
            encoded, _, _ = code.encode(whole)
            return whole, {i for i, p in payloads.items() if p != encoded[i]}
    return None, set()

