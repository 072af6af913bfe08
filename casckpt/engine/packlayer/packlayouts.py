"""Packs' layouts as the catalog records them (cached), and the shard health readers find.

Only evidence changes a shard's health: its location answering that the object does not
exist (``missing``), or something at its key that is not the shard (``corrupt``, found here
or by verification). A location that could not be reached -- a dropped connection, a
timeout, throttling, an access denial -- says nothing about the shard: it is *unreachable*
and left as it was (:func:`shard_state_of`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from threading import Lock

from casckpt.catalog import Catalog, PackLayout
from casckpt.catalog import shards as sql
from casckpt.errors import BlobNotFoundError, OversizedObjectError, StorageError, UnsafeObjectError

log = logging.getLogger(__name__)

_LAYOUT_CACHE = 4096


def shard_state_of(exc: StorageError) -> str | None:
    """What a failed read of a shard or copy proves: ``missing`` (no such object), ``corrupt``
    (its bytes are there but refused: not a regular file, larger than recorded, or, in an
    encrypted store, failing authentication: altered or swapped), or None:
    the location could not be reached, which proves nothing about the shard."""
    if isinstance(exc, BlobNotFoundError):
        return "missing"
    if isinstance(exc, (OversizedObjectError, UnsafeObjectError)):
        return "corrupt"
    return None


class Layouts:
    """Where each pack's shards are and how healthy the catalog believes them.

    Layouts are cached (least recently used dropped past a bound); a reader
    that finds a shard damaged records it (:meth:`mark_damaged`), which also
    drops the cached layout. Thread-safe.
    """

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._cache: OrderedDict[str, PackLayout] = OrderedDict()
        self._lock = Lock()

    def get(self, pack_id: str, *, fresh: bool = False) -> PackLayout | None:
        """The pack's layout (cached; ``fresh`` re-reads the catalog); None: not in the catalog."""
        with self._lock:
            cached = None if fresh else self._cache.get(pack_id)
        if cached is not None:
            return cached
        found = sql.layouts(self._catalog, [pack_id]).get(pack_id)
        with self._lock:
            if found is None:
                self._cache.pop(pack_id, None)
            else:
                self._cache[pack_id] = found
                self._cache.move_to_end(pack_id)
                while len(self._cache) > _LAYOUT_CACHE:
                    self._cache.popitem(last=False)
        return found

    def require(self, pack_id: str, *, fresh: bool = False) -> PackLayout:
        """Like :meth:`get`, for a pack that must exist.

        Raises:
            BlobNotFoundError: the pack is not in the catalog (GC removed it).
        """
        layout = self.get(pack_id, fresh=fresh)
        if layout is None:
            raise BlobNotFoundError(f"pack {pack_id} is not in the catalog (removed by GC?)")
        return layout

    def forget(self, pack_id: str) -> None:
        """Drop a cached layout (after the catalog changed it). Idempotent."""
        with self._lock:
            self._cache.pop(pack_id, None)

    def mark_damaged(self, layout: PackLayout, states: dict[int, str], why: str) -> None:
        """Queue shards for repair (``states``: index -> ``missing`` | ``corrupt``) and drop
        the cached layout.

        Only rows still pointing where ``layout`` looked are marked, so a reader
        holding a stale layout never marks a shard another process moved. A pack
        without redundancy is not marked: there is nothing to reconstruct it from,
        and the reader reports it.
        """
        self.forget(layout.id)
        if layout.scheme == "none":
            return
        log.warning("pack %s: shard(s) %s %s (%s); queued for repair", layout.id,
                    sorted(states), "/".join(sorted(set(states.values()))), why)
        rows = {i: (state, row.location_id, row.key) for i, state in states.items()
                if (row := layout.shard(i)) is not None}
        sql.mark_shards(self._catalog, layout.id, rows)
