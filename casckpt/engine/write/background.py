"""Background commits: snapshot on the caller's thread, write and publish on a worker.

``Store.commit(..., block=False)`` runs the snapshot (tree encoding, hashing
every chunk in place, dedup, and a copy of the chunks the store does not
hold) before it returns, then hands the rest -- encoding, packing, uploads,
the manifest, the publishing transaction -- to one worker thread, in commit
order. Once it has returned, the caller may mutate its tensors.

Bounds (documented backpressure): at most ``max_pending`` commits are in
flight, and the copies of their new chunks hold at most ``memory`` bytes.
When either is full a new commit waits (``backpressure="block"``, default)
or raises :class:`~casckpt.errors.CommitBackpressureError` (``"raise"``). A
single commit whose changed bytes exceed the whole budget is written in the
foreground, after the commits before it, without copying.

Failures are never silent: a background commit's error is raised by its
handle's :meth:`CommitHandle.wait`, and -- if nobody waited -- by the next
commit or by ``close()``. A failed commit leaves no visible version. The
exception is a catalog outage (``CatalogUnavailableError``): the handle
reports it and it is logged, but the next commit goes ahead rather than
raising it, so a restart of the database costs no commit after it is over. A
version's parent is fixed when it is snapshotted (it is part of the version
id), so a commit queued behind a failed one of the same run still becomes
visible, complete, naming the failed (never visible) version as its parent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from casckpt.catalog.leases import begin_lease
from casckpt.engine.context import EngineContext
from casckpt.errors import (
    BackgroundCommitError,
    CatalogUnavailableError,
    CommitBackpressureError,
    CommitTimeoutError,
    InvalidArgumentError,
    VersionExistsError,
)
from casckpt.types import ProgressCallback, Version

if TYPE_CHECKING:  # the commit engine (and torch) load with the first commit, not at open
    from casckpt.engine.write.commit import CommitRequest, Snapshot
    from casckpt.engine.write.commitchunks import ChunkBytes
    from casckpt.engine.write.hint import ChangeHint
    from casckpt.storage.erasure import Redundancy

log = logging.getLogger(__name__)

BACKPRESSURE = ("block", "raise")


class CommitHandle:
    """A commit running in the background. Thread-safe.

    ``id`` (the version id), ``run`` and ``step`` are known at once; the
    version becomes visible when the commit succeeds.
    """

    def __init__(self, version_id: str, run: str, step: int) -> None:
        self.id, self.run, self.step = version_id, run, step
        self._done = threading.Event()
        self._outcome: Version | BaseException | None = None  # set once, with _done
        self._reported = False

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "visible")
        return f"<CommitHandle {self.run}@{self.step} {self.id[:12]} {state}>"

    def done(self) -> bool:
        """True once the commit has succeeded or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Version:
        """Block until the commit is visible and return its version.

        Raises:
            CommitTimeoutError: ``timeout`` seconds passed first (the commit goes on).
            CasckptError: why the commit failed (no version is visible then).
        """
        if not self._done.wait(timeout):
            raise CommitTimeoutError(
                f"commit {self.run}@{self.step} still running after {timeout} s; wait again"
            )
        self._reported = True
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return cast(Version, self._outcome)  # _done is set only together with the outcome

    def result(self) -> Version:
        """Same as :meth:`wait` without a timeout."""
        return self.wait()

    def exception(self) -> BaseException | None:
        """The commit's error once done (None while running or on success); counts as reported."""
        if not self._done.is_set():
            return None
        self._reported = True
        return self._error

    @property
    def _error(self) -> BaseException | None:
        return self._outcome if isinstance(self._outcome, BaseException) else None

    def _settle(self, outcome: Version | BaseException) -> None:
        self._outcome = outcome
        self._done.set()


@dataclass(slots=True)
class _Job:
    handle: CommitHandle
    request: CommitRequest
    snapshot: Snapshot
    redundancy: Redundancy
    started: float
    progress: ProgressCallback | None


class BackgroundCommitter:
    """Runs background commits for one store, one at a time, in order. Thread-safe."""

    def __init__(self, ctx: EngineContext, *, max_pending: int, memory: int, backpressure: str) -> None:
        if backpressure not in BACKPRESSURE:
            raise InvalidArgumentError(f"backpressure must be 'block' or 'raise', got {backpressure!r}")
        self._ctx = ctx
        self.max_pending, self.memory, self.backpressure = max_pending, memory, backpressure
        self._cond = threading.Condition()
        self._submit = threading.Lock()  # one snapshot at a time: parents chain in commit order
        self._queue: deque[_Job] = deque()
        self._pending: list[CommitHandle] = []
        self._staged = 0  # bytes of new chunks copied and not yet written
        self.peak_staged = 0
        self._last: dict[str, str] = {}  # run -> version id of its newest pending commit
        self._inflight: dict[bytes, ChunkBytes] = {}  # chunk id -> copy a pending commit will write
        self._failed: list[CommitHandle] = []
        self._worker: threading.Thread | None = None
        self._exit_hook = False
        self._closed = False

    @property
    def staged(self) -> int:
        """Bytes of new chunks copied out of pending commits' states and not yet written."""
        with self._cond:
            return self._staged

    # -- submitting ---------------------------------------------------------------

    def commit(self, state: object, req: CommitRequest, progress: ProgressCallback | None,
               hint: ChangeHint | None = None) -> CommitHandle:
        """Snapshot ``state`` now (``hint``: see :mod:`casckpt.engine.write.hint`); write and publish
        it in the background."""
        from casckpt.engine.write import commit as commit_engine

        entered = time.monotonic()  # the caller's stall runs from here (waits for room included)
        self.raise_unreported()
        with self._submit:
            if self._closed:
                raise InvalidArgumentError("the store is closed; open it again to commit")
            self._wait_for_room(lambda: len(self._pending) < self.max_pending, "commits pending")
            if any(h.run == req.run and h.step == req.step for h in self._pending):
                raise VersionExistsError(
                    f"run {req.run!r} already has a commit at step {req.step} in flight; "
                    "commit with another step")
            started, created = time.monotonic(), time.time()
            commit_engine.refuse_existing(self._ctx, req)
            redundancy = self._ctx.packs.placement.redundancy_for(req.run)
            self._ctx.packs.placement.check_writable(redundancy)
            reserved: list[int] = []

            def reserve(nbytes: int) -> bool:
                admitted = self._reserve(nbytes)
                if admitted:
                    reserved.append(nbytes)
                return admitted

            try:
                parent = self._last.get(req.run) or commit_engine.parent_of(self._ctx, req.run)
                with self._cond:
                    inflight = dict(self._inflight)
                snap = commit_engine.snapshot(self._ctx, state, req, created, parent=parent,
                                              reserve=reserve, progress=progress, pending=inflight,
                                              hint=hint)
                handle = CommitHandle(snap.version_id, req.run, req.step)
                job = _Job(handle, req, snap, redundancy, started, progress)
                if snap.foreground:  # too big to copy: write it now, after the others
                    self.wait_all()
            except BaseException:
                self._release(sum(reserved))
                raise
            if snap.foreground:  # written in the caller's thread: its wall time is the stall
                with self._cond:
                    self._pending.append(handle)
                self._run(job, foreground=True)
                return handle
            snap.stall_s = time.monotonic() - entered
            with self._cond:
                self._pending.append(handle)
                self._last[req.run] = snap.version_id
                for cid in snap.new_ids:  # later snapshots dedup against these copies
                    self._inflight[cid] = snap.chunks[cid]
                self._queue.append(job)
                self._start_worker()
                self._cond.notify_all()
            return handle

    def _wait_for_room(self, ready: Callable[[], bool], what: str) -> None:
        with self._cond:
            if ready():
                return
            if self.backpressure == "raise":
                raise CommitBackpressureError(
                    f"{len(self._pending)} {what} ({self._staged} bytes staged of a {self.memory}-byte "
                    "budget); wait on a CommitHandle, or open the store with backpressure='block'")
            self._cond.wait_for(ready)

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._staged -= nbytes
            self._cond.notify_all()

    def _reserve(self, nbytes: int) -> bool:
        """Admit ``nbytes`` of copies into the budget (waiting for room); False if they never fit."""
        if nbytes > self.memory:
            return False
        self._wait_for_room(lambda: self._staged + nbytes <= self.memory, "commits hold their bytes")
        with self._cond:
            self._staged += nbytes
            self.peak_staged = max(self.peak_staged, self._staged)
        return True

    # -- the worker -----------------------------------------------------------------

    def foreground(self, run: Callable[[], Version]) -> Version:
        """Run a blocking commit in order: after every pending background commit, before
        any submitted after it (so versions of a run appear in commit order)."""
        self.raise_unreported()
        with self._submit:
            self.wait_all()
            return run()

    def _wait_at_exit(self) -> None:
        """At interpreter exit, before thread pools shut down: finish pending commits."""
        if self.pending():
            log.warning("finishing %d background commit(s) at exit; close the store to "
                        "control when", len(self.pending()))
            self.wait_all()
        with self._cond:
            failed = [h for h in self._failed if not h._reported]  # noqa: SLF001
        for handle in failed:
            log.error("background commit %s@%s failed and was never waited on: %s",
                      handle.run, handle.step, handle._error)  # noqa: SLF001

    def _start_worker(self) -> None:
        if not self._exit_hook:
            try:  # runs before concurrent.futures shuts its pools down (hooks run in reverse)
                threading._register_atexit(self._wait_at_exit)  # type: ignore[attr-defined]
                self._exit_hook = True
            except RuntimeError:  # the interpreter is already shutting down
                pass
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="casckpt-commit", daemon=False)
            self._worker.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._worker = None
                    return
                job = self._queue.popleft()
            self._run(job)

    def _run(self, job: _Job, foreground: bool = False) -> None:
        from casckpt.engine.write import commit as commit_engine

        outcome: Version | BaseException
        lease: str | None = None
        try:  # the lease begins here, off the caller's thread: the snapshot wrote nothing
            lease = begin_lease(self._ctx.catalog, job.snapshot.version_id)
            outcome = commit_engine.finish(self._ctx, job.request, job.snapshot, job.redundancy,
                                           job.started, lease, job.progress)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            outcome = exc
            log.warning("background commit %s@%s failed: %s", job.request.run, job.request.step, exc)
        if lease is not None and isinstance(outcome, BaseException):  # publishing ends it otherwise
            commit_engine.release_lease(self._ctx, lease, f"{job.request.run}@{job.request.step}")
        with self._cond:
            for cid in job.snapshot.new_ids:
                if self._inflight.get(cid) is job.snapshot.chunks.get(cid):
                    del self._inflight[cid]
            job.snapshot.chunks.clear()  # drop the copies before admitting more
            self._staged -= job.snapshot.owned
            if job.handle in self._pending:
                self._pending.remove(job.handle)
            if self._last.get(job.request.run) == job.handle.id:
                del self._last[job.request.run]
            if isinstance(outcome, BaseException):
                self._failed.append(job.handle)
            job.handle._settle(outcome)  # noqa: SLF001 - the handle's owner
            self._cond.notify_all()
        if foreground and isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # Ctrl-C while writing in the caller's thread stops the caller

    # -- waiting and errors ---------------------------------------------------------

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every pending commit has finished; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def pending(self) -> list[CommitHandle]:
        """Commits not finished yet, oldest first."""
        with self._cond:
            return list(self._pending)

    def raise_unreported(self) -> None:
        """Raise the first background failure nobody has seen through its handle yet.

        Catalog outages are left to their handles and the log: the commit
        after one must not fail for it once the database is back.
        """
        with self._cond:
            failed = [h for h in self._failed if not h._reported  # noqa: SLF001
                      and not isinstance(h._error, CatalogUnavailableError)]  # noqa: SLF001
            self._failed = []
        if failed:
            first = failed[0]
            first._reported = True  # noqa: SLF001
            others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise BackgroundCommitError(
                f"background commit {first.run}@{first.step} failed{others}: {first._error}; "  # noqa: SLF001
                "its version is not visible. Commit it again"
            ) from first._error  # noqa: SLF001

    def close(self) -> None:
        """Finish every pending commit, then report a failure nobody saw. Idempotent."""
        with self._submit:
            self._closed = True
        self.wait_all()
        self.raise_unreported()
