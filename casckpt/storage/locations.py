"""A store's blob locations, their failure domains, and where each pack's shards go.

Placement is deterministic in the pack id: the active failure domains are
rotated by the id, so shards of successive packs spread over every domain
and a pack's shards land on distinct domains (losing one domain costs each
pack at most one shard). Small metadata objects (manifests, refs) are
replicated to every usable location, so any one surviving location can
rebuild the catalog.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from threading import Lock

from casckpt.errors import CasckptError, StorageError, StorageFullError
from casckpt.storage.base import BlobInfo, BlobStore
from casckpt.storage.redact import redact_url

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Location:
    """One blob location: a directory or bucket/prefix in a failure domain.

    ``state``: ``active`` (read and written), ``retiring`` (read; repair moves
    its shards off), ``failed`` (never touched; repair re-creates its shards).
    """

    id: int
    name: str
    domain: str
    state: str
    blobs: BlobStore

    @property
    def readable(self) -> bool:
        """Whether reads may go here."""
        return self.state != "failed"

    @property
    def remote(self) -> bool:
        """Whether reaching it costs a network round trip (read local copies first)."""
        return not self.blobs.url.startswith("file:")

    def describe(self) -> str:
        """``name (url)`` for messages, credentials redacted."""
        return f"{self.name} ({redact_url(self.blobs.url)})"


class LocationSet:
    """The locations of one store. Thread-safe (immutable after construction)."""

    def __init__(self, locations: Sequence[Location]) -> None:
        if not locations:
            raise ValueError("a store needs at least one blob location")
        self.all = tuple(locations)
        self._by_id = {loc.id: loc for loc in locations}

    def get(self, location_id: int) -> Location | None:
        """The location with this id, if this process knows it."""
        return self._by_id.get(location_id)

    def active(self) -> list[Location]:
        """Locations new shards may be written to."""
        return [loc for loc in self.all if loc.state == "active"]

    def domains(self) -> list[str]:
        """Failure domains with at least one active location."""
        return sorted({loc.domain for loc in self.active()})

    def placement(self, pack_id: str) -> list[Location]:
        """One active location per failure domain, in this pack's rotated order.

        The first K+M take the pack's shards; the rest are spares for shards
        whose first choice refuses the write.
        """
        domains = self.domains()
        if not domains:
            return []
        start = int(pack_id[:8], 16) % len(domains)
        pick = int(pack_id[8:16], 16)
        order = domains[start:] + domains[:start]
        chosen = []
        for domain in order:
            members = [loc for loc in self.active() if loc.domain == domain]
            chosen.append(members[pick % len(members)])
        return chosen

    def read_order(self) -> list[Location]:
        """Readable locations, local before remote."""
        return sorted((loc for loc in self.all if loc.readable), key=lambda loc: (loc.remote, loc.id))

    # -- small replicated objects (manifests, refs) -------------------------

    def put_everywhere(self, key: str, data: bytes) -> int:
        """Write ``data`` to every active location; returns how many took it.

        Raises:
            StorageFullError: no location took it, each for want of room.
            StorageError: no location took it.
            AccessDeniedError: a location refused it for want of a right (see
                :class:`~casckpt.storage.base.BlobStore`): no other location is tried.
        """
        written, failures = 0, []
        for loc in self.active():
            try:
                loc.blobs.put(key, data)
                written += 1
            except StorageError as exc:
                log.warning("could not write %s to location %s: %s", key, loc.describe(), exc)
                failures.append(exc)
        if not written:
            raise refused(key, failures)
        return written

    def exists_anywhere(self, key: str) -> bool:
        """Whether some readable location holds ``key``."""
        for loc in self.read_order():
            try:
                if loc.blobs.size(key) is not None:
                    return True
            except StorageError:
                continue
        return False

    def delete(self, objects: Sequence[tuple[int, str]], *,
               progress: Callable[[int, int], None] | None = None) -> list[tuple[int, str]]:
        """Delete objects, each named by (location id, key): the one path every deletion of
        an object on a location takes (gc's sweep and orphans, a pack write below quorum,
        shards a repair wrote for a pack gc removed meanwhile).

        Deciding *what* may go is the caller's job (for gc: :mod:`casckpt.engine.maintenance.gcguard`,
        DESIGN.md invariant 8); this only carries it out. Idempotent: an object already
        absent counts as deleted (``BlobStore.delete`` of a missing key succeeds). An object
        on a failed or unknown location is never touched and does not count. A location that
        refuses (unreachable, permission) is logged at WARNING and does not count; nothing is
        raised, as whatever is left behind is an orphan a later gc removes. Thread-safe.

        Args:
            objects: (location id, key) pairs, deleted in order.
            progress: called after each object with (objects deleted so far, len(objects)).

        Returns:
            The objects deleted (or found absent), in order.
        """
        done: list[tuple[int, str]] = []
        for location_id, key in objects:
            loc = self._by_id.get(location_id)
            if loc is not None and loc.readable:  # a failed location is never touched
                try:
                    loc.blobs.delete(key)
                    done.append((location_id, key))
                except CasckptError as exc:
                    log.warning("could not delete %s from %s: %s (a later gc removes it)",
                                key, loc.describe(), exc)
            if progress is not None:
                progress(len(done), len(objects))
        return done

    def list_all(self, prefix: str) -> Iterator[tuple[Location, BlobInfo]]:
        """Every object under ``prefix`` on every readable location.

        Raises:
            StorageError: a location cannot be listed (callers that delete
                based on a listing must stop).
        """
        for loc in self.all:
            if loc.readable:
                for info in loc.blobs.list(prefix):
                    yield loc, info

    def close(self) -> None:
        """Close every location's blob store."""
        for loc in self.all:
            loc.blobs.close()


class CurrentLocations:
    """The store's current :class:`LocationSet`, replaced as a whole when locations change.

    A ``LocationSet`` never changes; adding, retiring, failing or re-reading
    locations builds a new one and :meth:`swap` s it in. An operation that must see
    one consistent set (a pack write: placement, quorum, clean-up) calls :meth:`get`
    once at its start and uses that set throughout; operations already running keep
    the set they took. Thread-safe.
    """

    def __init__(self, initial: LocationSet) -> None:
        self._lock = Lock()
        self._current = initial

    def get(self) -> LocationSet:
        """The set in force now (a snapshot: later swaps do not change it)."""
        with self._lock:
            return self._current

    def swap(self, new: LocationSet) -> LocationSet:
        """Make ``new`` the current set; returns the one it replaced. The blob stores are
        not closed: the new set usually shares them, and running operations may hold the old."""
        with self._lock:
            old, self._current = self._current, new
            return old


def refused(what: str, failures: Sequence[StorageError]) -> StorageError:
    """The error when no location took ``what``: StorageFullError (naming every location and
    the size) when each refused it for want of room, else StorageError with the last reason."""
    if not failures:
        return StorageError(f"no active blob location to write {what} to; see `casckpt location list`")
    last = failures[-1]
    if all(isinstance(f, StorageFullError) for f in failures):
        full = [f for f in failures if isinstance(f, StorageFullError)]
        places = ", ".join(str(f.location) for f in full)
        needed = full[-1].needed
        size = f" ({needed} bytes)" if needed is not None else ""
        error: StorageError = StorageFullError(
            f"no blob location has room for {what}{size} (full: {places}); {last}",
            location=places, needed=needed)
    else:
        error = StorageError(f"no blob location accepted {what}: {last}")
    error.__cause__ = last
    return error
