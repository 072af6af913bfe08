"""Which locations get which shard of a pack, and the redundancy policy that decides how many.

Placement (:meth:`LocationSet.placement`) gives each pack one active location
per failure domain, rotated by the pack id; shard ``i`` goes to the ``i``-th,
the rest are spares tried when a location refuses. With fewer active domains
than shards, erasure-coded shards double up on the least-used domains rather
than stop training; ``repair`` spreads them once domains return.

Write quorum: a pack counts as durable once ``quorum`` of its shards are
(default: one more than a read needs, see :meth:`Redundancy.default_quorum`),
counting the failure domain holding the most of them as one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from casckpt.catalog import Catalog, PackLayout, ShardRow
from casckpt.catalog.settings import REDUNDANCY
from casckpt.engine.packlayer.packcoding import ShardPayload, object_key
from casckpt.errors import InvalidArgumentError, StorageError
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import CurrentLocations, Location, LocationSet

log = logging.getLogger(__name__)


class Placement:
    """Redundancy policy and shard placement over the store's current locations.

    ``io`` writes shards in parallel; it must not be a pool whose tasks call
    into this object. Thread-safe. Methods that take ``locations`` use that
    snapshot, so one operation sees one set however the store's changes.
    """

    def __init__(self, catalog: Catalog, locations: CurrentLocations, io: ThreadPoolExecutor,
                 quorum: int | None = None) -> None:
        self._catalog = catalog
        self._locations = locations
        self._io = io
        self._quorum = quorum

    # -- policy ---------------------------------------------------------------

    def check_redundancy(self, redundancy: Redundancy) -> None:
        """Refuse a scheme the active failure domains cannot hold.

        Raises:
            InvalidArgumentError: fewer active failure domains than shards.
        """
        domains = self._locations.get().domains()
        if redundancy.shards > len(domains):
            raise InvalidArgumentError(
                f"redundancy {redundancy} puts each pack on {redundancy.shards} failure domains, "
                f"but the store has {len(domains)} with an active location ({', '.join(domains)}); "
                "add locations (`casckpt location add`) or choose a smaller scheme"
            )

    def redundancy_for(self, run: str | None) -> Redundancy:
        """The scheme new packs of ``run`` get: the run's own, else the store's (default none)."""
        spec = REDUNDANCY.own(self._catalog, run) if run is not None else None
        return Redundancy.parse(spec or REDUNDANCY.stored(self._catalog) or "none")

    def check_writable(self, redundancy: Redundancy, locations: LocationSet | None = None) -> None:
        """Refuse to write when fewer failure domains are active than the write quorum.

        With fewer active domains than shards (a location failed or is
        retiring) but at least the quorum, packs are still written: the
        shards that lack a domain of their own double up on others, and a
        warning says so. ``repair`` spreads them again once locations return.

        Raises:
            StorageError: fewer active failure domains than the quorum.
        """
        domains = (locations or self._locations.get()).domains()
        if len(domains) < self.quorum(redundancy):
            raise StorageError(
                f"redundancy {redundancy} needs {self.quorum(redundancy)} active failure domains to "
                f"store a pack durably (its write quorum), but only {len(domains)} are active "
                f"({', '.join(domains) or 'none'}); see `casckpt location list`"
            )
        if len(domains) < redundancy.shards:
            log.warning("only %d failure domains are active for %s: some shards of new packs share a "
                        "domain until locations are added or restored", len(domains), redundancy)

    def quorum(self, redundancy: Redundancy) -> int:
        """Shards that must be durable before a pack counts as stored."""
        wanted = self._quorum or redundancy.default_quorum()
        return max(redundancy.needed, min(wanted, redundancy.shards))

    @staticmethod
    def durable(rows: Sequence[ShardRow], locations: LocationSet) -> int:
        """Written shards, counting the failure domain holding the most of them as one.

        With a shard per domain this is the number written; when shards
        share a domain (too few were active), losing that one domain must
        not take the pack below what the quorum promises.
        """
        per_domain = Counter(loc.domain for sh in rows
                             if sh.state == "ok" and (loc := locations.get(sh.location_id)) is not None)
        if not per_domain:
            return 0
        return sum(per_domain.values()) - max(per_domain.values()) + 1

    # -- placing --------------------------------------------------------------

    def place(self, layout: PackLayout, payloads: dict[int, ShardPayload], order: Sequence[Location],
              failures: list[StorageError] | None = None) -> list[ShardRow]:
        """Write payload ``i`` to ``order[i]`` (distinct failure domains), using spares on refusal.

        With fewer domains than payloads, erasure-coded shards double up (in
        placement order); copies of a pack share one key, so they never do.
        Never raises for a refusal (a ``StorageError``), but for a request refused for want of
        a right (``AccessDeniedError``), which stops the write: shards already written are
        orphans a later gc removes.

        Returns:
            One row per payload: ``ok`` where written, else ``missing``; each
            refusal is appended to ``failures``.
        """
        slots = list(order)
        while layout.scheme == "ec" and slots and len(slots) < len(payloads):
            slots += slots[: len(payloads) - len(slots)]
        first, spares = slots[: len(payloads)], slots[len(payloads) :]

        def write(index: int, loc: Location) -> bool:
            try:
                payloads[index].put(loc.blobs, object_key(layout, index))
                return True
            except StorageError as exc:
                log.warning("pack %s shard %d: location %s refused it: %s",
                            layout.id, index, loc.describe(), exc)
                if failures is not None:
                    failures.append(exc)
                return False

        results = list(self._io.map(write, range(len(first)), first))
        rows: list[ShardRow] = []
        for index, payload in sorted(payloads.items()):
            loc = first[index] if index < len(first) else None
            ok = results[index] if index < len(first) else False
            while not ok and spares:
                loc = spares.pop(0)
                ok = write(index, loc)
            nominal = loc or order[0]  # a shard never written still names where it belongs
            rows.append(ShardRow(index, nominal.id, object_key(layout, index), payload.size,
                                 payload.checksum, "ok" if ok else "missing"))
        return rows

    @staticmethod
    def place_one(layout: PackLayout, index: int, payload: ShardPayload, order: Sequence[Location],
                  taken: set[str]) -> ShardRow | None:
        """Write one shard again: to a failure domain the pack does not use yet (not in
        ``taken``) if there is one, else (too few domains left) to any active location in
        ``order``, least used by this pack first.

        Returns:
            The shard's new row, or None when every location refused (each logged).
        """
        key = object_key(layout, index)
        fresh = [loc for loc in order if loc.state == "active" and loc.domain not in taken]
        used = Counter(sh.location_id for sh in layout.shards)
        holding = {sh.location_id for sh in layout.shards if sh.key == key and sh.index != index}
        doubled = sorted((loc for loc in order if loc.state == "active" and loc.domain in taken
                          and loc.id not in holding),  # copies share a key: one per location
                         key=lambda loc: used[loc.id])
        for loc in [*fresh, *doubled]:
            if loc.domain in taken:
                log.warning("pack %s shard %d shares failure domain %s with another shard: no "
                            "unused domain is active", layout.id, index, loc.domain)
            try:
                payload.put(loc.blobs, key)
            except StorageError as exc:
                log.warning("pack %s shard %d: %s refused it: %s", layout.id, index, loc.describe(), exc)
                continue
            return ShardRow(index, loc.id, key, payload.size, payload.checksum, "ok", time.time())
        return None

    @staticmethod
    def doubled(layout: PackLayout, bad: Sequence[int], locations: LocationSet) -> list[int]:
        """Healthy shards sharing a failure domain with another, as many as free domains can take."""
        seen: set[str] = set()
        extra: list[int] = []
        for sh in layout.shards:
            loc = locations.get(sh.location_id)
            if sh.index in bad or loc is None:
                continue
            if loc.domain in seen:
                extra.append(sh.index)
            seen.add(loc.domain)
        free = [d for d in locations.domains() if d not in seen]
        return extra[: len(free)]
