"""A thread of the training job running one mirror again and again
(:meth:`casckpt.store_mirrors.Mirrors.start`): at once, after commits, every interval and on
:meth:`MirrorWorker.wake`, until it is stopped, the store closes or the mirror is removed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from casckpt.catalog.mirrors import MirrorRow
from casckpt.errors import CasckptError
from casckpt.mirror_rules import MirrorReport
from casckpt.storage import redact_url

log = logging.getLogger(__name__)

BackgroundRun = Callable[[str, float, Callable[[], bool]], "MirrorReport | None"]
"""``(mirror name, its generation, stopping) -> the run's report``; None: the mirror was
removed (the worker then stops). ``stopping`` is read between versions."""

Latest = Callable[[], object]
"""What a new commit changes (each run's latest version); None: the catalog could not say."""


class MirrorWorker(threading.Thread):
    """A thread running one mirror again and again (:meth:`casckpt.store_mirrors.Mirrors.start`).

    Attributes:
        mirror: the mirror's name.
        interval: seconds between runs.
        poll: seconds between checks for new commits (None: none).
        runs: runs finished (failed ones too).
        last_report: the last run's report (None: none finished).
        last_error: the error of the last run that failed (None: the last one did not).
    """

    def __init__(self, row: MirrorRow, interval: float, poll: float | None, *, run: BackgroundRun,
                 latest: Latest) -> None:
        super().__init__(name=f"casckpt-mirror-{row.name}", daemon=True)
        self._run_once, self._latest = run, latest
        self.mirror, self.interval, self.poll = row.name, interval, poll
        self._generation = row.created_at
        self._stop_event, self._wake = threading.Event(), threading.Event()
        self.runs = 0
        self.last_report: MirrorReport | None = None
        self.last_error: BaseException | None = None

    def run(self) -> None:  # the thread's body
        while not self._stop_event.is_set():
            self._wake.clear()
            seen = self._latest() if self.poll is not None else None
            try:
                report = self._run_once(self.mirror, self._generation, self._stop_event.is_set)
                if report is None:
                    log.info("mirror %s was removed: its worker stops", self.mirror)
                    return
                self.last_report, self.last_error = report, None
            except Exception as exc:  # any: ENOSPC, a driver's error; the thread must live on
                self.last_error = exc
                log.warning("mirror %s: the run failed (%s: %s); the next one tries again",
                            self.mirror, type(exc).__name__, redact_url(str(exc)),
                            exc_info=not isinstance(exc, CasckptError))
            self.runs += 1
            self._until_due(seen, time.monotonic() + self.interval)

    def _until_due(self, seen: object, deadline: float) -> None:
        """Wait for a wake, a stop, the interval's end or (polling) a new commit."""
        while not self._stop_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.wait(left if self.poll is None else min(left, self.poll)):
                return
            if self.poll is not None and self._latest() not in (None, seen):
                return

    def wake(self) -> None:
        """Run the mirror now (once the run in progress, if any, is over)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the version being sent, and wait for the thread (at most ``timeout``
        seconds). Idempotent."""
        self._stop_event.set()
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
