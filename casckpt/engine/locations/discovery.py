"""What the blob locations hold, found by listing them, and pack bytes read without the catalog.

Catalog rebuild, GC's orphan pass and ``check`` need to know packs the
catalog may not: a whole pack object (``packs/<xx>/<id>``) is a copy; an
erasure-coded shard (``<id>.s<i>``) names its pack, index and scheme in
its header. :func:`pack_layout` turns what a listing found into a
:class:`PackLayout`; :func:`read_footer` reads a pack's index through any
layout (copies or data shards, by range, nothing rebuilt or healed).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from casckpt.catalog import PackLayout, ShardRow
from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    CasckptError,
    CorruptPackError,
    MissingDataError,
    OversizedObjectError,
    StorageError,
    UnsafeObjectError,
)
from casckpt.format import objectnames
from casckpt.format.pack import TRAILER_SIZE, PackEntry, parse_footer, parse_trailer
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header
from casckpt.storage import BlobInfo
from casckpt.storage.locations import Location, LocationSet

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FoundPack:
    """The objects of one pack a listing found."""

    copies: list[tuple[Location, str, int]] = field(default_factory=list)  # (location, key, size)
    shards: dict[int, tuple[Location, str, int]] = field(default_factory=dict)


def scan_packs(listing: Iterable[tuple[Location, BlobInfo]]) -> dict[str, FoundPack]:
    """Group listed ``packs/`` objects by pack."""
    found: dict[str, FoundPack] = defaultdict(FoundPack)
    for loc, info in listing:
        named = objectnames.pack_of(info.key)
        if named is None:
            continue
        pack_id, index = named
        if index is None:
            found[pack_id].copies.append((loc, info.key, info.size))
        else:
            found[pack_id].shards.setdefault(index, (loc, info.key, info.size))
    return found


def pack_layout(pack_id: str, found: FoundPack) -> PackLayout | None:
    """The pack's layout as its objects describe it (None: nothing usable).

    Shards are read by their headers (a small ranged read each); a shard
    whose header is damaged or names another pack is left out.
    """
    if found.copies:
        size = found.copies[0][2]
        rows = tuple(ShardRow(i, loc.id, key, sz) for i, (loc, key, sz) in enumerate(found.copies))
        scheme = "none" if len(rows) == 1 else "replicate"
        return PackLayout(pack_id, objectnames.pack_name(pack_id), size, scheme, 1, len(rows) - 1,
                          shards=rows)
    headers = {}
    for index, (loc, key, size) in sorted(found.shards.items()):
        try:
            head = loc.blobs.get_range(key, 0, SHARD_HEADER_SIZE)
            header = decode_shard_header(head, f"{key} on {loc.describe()}")
        except AccessDeniedError:
            raise  # refused, not damaged or missing: stop, naming the right
        except CasckptError as exc:
            log.warning("skipping shard %s: %s", key, exc)
            continue
        if header.pack_id == pack_id and header.index == index:
            headers[index] = (header, loc, key, size)
    if not headers:
        return None
    first = next(iter(headers.values()))[0]
    code = (first.k, first.m, first.algorithm, first.pack_len)
    rows = tuple(ShardRow(i, loc.id, key, size, h.checksum) for i, (h, loc, key, size) in headers.items()
                 if (h.k, h.m, h.algorithm, h.pack_len) == code)
    return PackLayout(pack_id, objectnames.pack_name(pack_id), first.pack_len, "ec", first.k, first.m,
                      first.algorithm, first.stripe, first.data_offset, rows)


_GONE = (BlobNotFoundError, UnsafeObjectError, OversizedObjectError)  # no read will ever succeed


def read_range(locations: LocationSet, layout: PackLayout, offset: int, length: int) -> bytes:
    """Pack bytes ``[offset, offset + length)`` from a whole copy or the data shards holding
    them, as the layout says; nothing is rebuilt, healed or recorded.

    Raises:
        MissingDataError: no copy, or a data shard needed, exists (or is a file that can be read
            at all: a FIFO, a symlink out, an object larger than recorded).
        StorageError: a read failed in a way that may not last (an I/O error, a timeout): the
            caller must not conclude the bytes are gone.
        CorruptPackError: an object is shorter than the layout says.
    """
    if offset < 0 or length < 0 or offset + length > layout.size:
        raise CorruptPackError(
            f"pack {layout.id}: range {offset}+{length} is outside its {layout.size} bytes")
    if layout.scheme != "ec":
        last: Exception | None = None
        transient: StorageError | None = None
        for sh in layout.shards:
            loc = locations.get(sh.location_id)
            if loc is None or not loc.readable:
                continue
            try:
                data = loc.blobs.get_range(sh.key, offset, length)
            except _GONE as exc:
                last = exc
                continue
            except StorageError as exc:
                last = transient = exc
                continue
            if len(data) == length:
                return data
            last = CorruptPackError(f"{sh.key} on {loc.describe()} is shorter than its pack")
        if transient is not None:
            raise transient
        raise MissingDataError(f"no readable copy of pack {layout.id} ({last})")
    stripe, base = layout.stripe or 0, SHARD_HEADER_SIZE + (layout.data_offset or 0)
    if stripe <= 0:
        raise CorruptPackError(f"pack {layout.id} records no stripe size")
    pieces, pos, end = [], offset, offset + length
    while pos < end:
        index = pos // stripe
        take = min(stripe * (index + 1), end) - pos
        row = layout.shard(index)
        loc = locations.get(row.location_id) if row is not None else None
        if row is None or loc is None or not loc.readable:
            raise MissingDataError(f"data shard {index} of pack {layout.id} is not readable")
        try:
            data = loc.blobs.get_range(row.key, base + pos - index * stripe, take)
        except _GONE as exc:
            raise MissingDataError(f"data shard {index} of pack {layout.id}: {exc}") from exc
        if len(data) != take:
            raise CorruptPackError(f"data shard {index} of pack {layout.id} is truncated")
        pieces.append(data)
        pos += take
    return b"".join(pieces)


def read_footer(locations: LocationSet, layout: PackLayout) -> list[PackEntry]:
    """The entries of a pack's footer index, read by range (see :func:`read_range`).

    Raises:
        MissingDataError: the bytes cannot be read.
        CorruptPackError: the trailer or footer is damaged.
    """
    tail = read_range(locations, layout, layout.size - TRAILER_SIZE, TRAILER_SIZE) \
        if layout.size >= TRAILER_SIZE else b""
    footer_len = parse_trailer(tail, layout.size)
    footer = read_range(locations, layout, layout.size - TRAILER_SIZE - footer_len, footer_len)
    return parse_footer(footer, tail, layout.size)
