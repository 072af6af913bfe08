"""Location health, measured: one real request per location, within a deadline.

A location is *reachable* when it answers a read of its identity record
(:mod:`casckpt.engine.locations.identity`) within the deadline and that record names
this store. Every location carries one (written when the store or the
location is created), so the read proves more than that a client could be
built: the directory or bucket exists, the credentials may read it, the
endpoint answers, and it is still this store's. A location that answers
without the record (a directory removed, emptied or replaced by an empty
one) is not reachable either: whatever it holds now is not what the catalog
records there.

Probes run in parallel, one thread each, so the whole answer takes at most
the deadline. A request the deadline cut short is not abandoned: its thread
runs on until the backend gives up (S3: its own connect and read timeouts
and retries), and the next probe of that location joins it instead of
starting another, so a hung endpoint holds one thread, never more. The
threads are daemons: a probe still waiting never delays the interpreter's exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from casckpt.engine.locations import identity
from casckpt.format.identity import IDENTITY_NAME, StoreIdentity
from casckpt.storage import BlobStore
from casckpt.storage.locations import Location
from casckpt.storage.redact import redact_text

_REASON_CHARS = 300  # a reason is one line of a table, not a traceback


@dataclass(frozen=True, slots=True)
class Probe:
    """What probing one location found.

    Attributes:
        reachable: it answered within the deadline with this store's identity record.
        reason: why not (None when reachable): short, credentials redacted.
        seconds: how long the probe took (the deadline, when it did not answer in time).
    """

    reachable: bool
    reason: str | None
    seconds: float


class _Request:
    """One probe request in flight on its own thread."""

    def __init__(self, name: str, blobs: BlobStore) -> None:
        self.name, self.blobs = name, blobs
        self.started = time.monotonic()
        self.finished: float | None = None
        self.survey: identity.Survey | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.survey = identity.survey(self.name, self.blobs)  # storage errors are in the survey
        except Exception as exc:  # noqa: BLE001 - anything else is this probe's answer too
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.finished = time.monotonic()
            self.done.set()


class LocationProber:
    """Probes blob locations (see the module docstring). Thread-safe; one per store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[int, _Request] = {}  # id() of a blob store -> its unfinished probe

    def probe(self, locations: Sequence[Location], mine: StoreIdentity | None,
              timeout: float) -> list[Probe]:
        """Probe every location at once; returns one result per location, in order, after at
        most ``timeout`` seconds (plus thread start-up). ``mine``: the identity a location's
        record must name (None: any record will do, e.g. before a catalog rebuild adopts them)."""
        deadline = time.monotonic() + timeout
        requests = [self._start(loc) for loc in locations]
        results = []
        for request in requests:
            answered = request.done.wait(max(0.0, deadline - time.monotonic()))
            results.append(_verdict(request, mine, timeout) if answered else Probe(
                False, f"no answer within {timeout:g} s (the request was sent "
                f"{time.monotonic() - request.started:.1f} s ago)", timeout))
        return results

    def _start(self, loc: Location) -> _Request:
        with self._lock:
            running = self._in_flight.get(id(loc.blobs))
            if running is not None and running.blobs is loc.blobs and not running.done.is_set():
                return running
            request = self._in_flight[id(loc.blobs)] = _Request(loc.name, loc.blobs)
        thread = threading.Thread(target=self._run, args=(request,), daemon=True,
                                  name=f"casckpt-probe-{loc.name}")
        thread.start()
        return request

    def _run(self, request: _Request) -> None:
        try:
            request.run()
        finally:
            with self._lock:
                if self._in_flight.get(id(request.blobs)) is request:
                    del self._in_flight[id(request.blobs)]


def _verdict(request: _Request, mine: StoreIdentity | None, timeout: float) -> Probe:
    seconds = min((request.finished or time.monotonic()) - request.started, timeout)
    found = request.survey
    if found is None:
        return Probe(False, _short(request.error or "the probe failed"), seconds)
    if found.unreachable is not None:
        return Probe(False, _short(found.unreachable), seconds)
    if found.damaged is not None:
        return Probe(False, _short(f"its identity record is damaged: {found.damaged}"), seconds)
    if found.record is None:
        return Probe(False, f"it answers but holds no identity record ({IDENTITY_NAME}): "
                     "its directory or bucket was removed, emptied or replaced", seconds)
    if mine is not None and found.record.store_id != mine.store_id:
        return Probe(False, f"it holds another store's identity record ({found.record.describe()})",
                     seconds)
    if mine is not None and found.record.location != request.name:
        return Probe(False, f"it is the same storage as location {found.record.location!r}", seconds)
    return Probe(True, None, seconds)


def _short(text: str) -> str:
    line = " ".join(redact_text(text).split())
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."
