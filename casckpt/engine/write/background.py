"""Background commits: copy on the caller's thread, hash, write and publish on a worker.

``Store.commit(..., block=False)`` validates and encodes the state, copies every tensor
into host staging kept across commits (:mod:`casckpt.engine.memory.hoststaging`: buffers
already faulted in, so the copy runs at memcpy speed, as DCP's cached staging does) and
returns; it reads nothing from the catalog. One worker thread (kept until the store closes)
then, in commit order, refuses a step the run already holds (``VersionExistsError``, raised
by the handle: only a step still in flight in this process is refused by ``commit``
itself), checks the run's redundancy can be written, snapshots the staged copy (hashing,
dedup, the manifest: the version id is known only now, so :attr:`CommitHandle.id` waits
for it), encodes, packs, uploads, writes the manifest and publishes. Once ``commit``
has returned, the caller may mutate its tensors.

With a change hint (``unchanged=`` / ``trust_versions=``, :mod:`casckpt.engine.write.hint`)
the hint is evaluated on the caller's thread, against the live tensors: a tensor it vouches
for is not copied when the staging set already holds its bytes (it was copied into that set
and vouched for at every commit since; an ``unchanged=`` promise alone does not count after
a blocking commit of the run, which may have stored other bytes), and costs a lookup: its
counter entry and its view of the staging are carried over. The worker reuses the
parent's chunk ids for vouched tensors as a blocking commit does; where it cannot (a packed
or shared tensor, a parent that is not the run's last commit in this process: it failed, or
was deleted) it hashes the staged bytes, which hold the tensor as it was at that last commit
and, as vouched, still is.

Bounds (documented backpressure): at most ``max_pending`` commits are in flight, and the
staging sets (one per run, a second only while the first is held by a pending commit)
and copies hold at most ``memory`` bytes; sets no commit holds are freed to make room.
When either bound is full a new commit waits (``backpressure="block"``, default) or raises
:class:`~casckpt.errors.CommitBackpressureError` (``"raise"``). A state whose staging alone
exceeds ``memory`` is snapshotted on the caller's thread instead (every chunk hashed in
place, only the chunks the store does not hold copied); one whose changed bytes exceed the
whole budget is written in the foreground, after the commits before it, without copying.

Failures are never silent: a background commit's error is raised by its
handle's :meth:`CommitHandle.wait`, and -- if nobody waited -- by the next
commit or by ``close()``. A failed commit leaves no visible version. The
exception is a catalog outage (``CatalogUnavailableError``): the handle
reports it and it is logged, but the next commit goes ahead rather than
raising it, so a restart of the database costs no commit after it is over. A
commit queued behind a failed one of the same run (submitted before the failure)
names the failed (never visible) version as its parent, and still becomes visible,
complete; one queued behind a commit refused or failed before its snapshot ignores its
change hint (it vouched for its tensors since that commit) and hashes every tensor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

from casckpt import collector
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.engine.context import EngineContext
from casckpt.engine.write.commithandle import CommitHandle
from casckpt.errors import (
    BackgroundCommitError,
    CatalogUnavailableError,
    CommitBackpressureError,
    InvalidArgumentError,
    VersionExistsError,
)
from casckpt.types import ProgressCallback, Version

if TYPE_CHECKING:  # the commit engine (and torch) load with the first commit, not at open
    from casckpt.engine.memory.hoststaging import HostStaging, Layout, Staged, StagingSet
    from casckpt.engine.write.commit import CommitRequest, Snapshot
    from casckpt.engine.write.commitchunks import ChunkBytes
    from casckpt.engine.write.hint import ChangeHint, Counters

log = logging.getLogger(__name__)

BACKPRESSURE = ("block", "raise")


@dataclass(slots=True)
class _Job:
    handle: CommitHandle
    request: CommitRequest
    snapshot: Snapshot | None  # None: staged, the worker snapshots ``staged``
    started: float
    progress: ProgressCallback | None
    created: float = 0.0
    staged: Staged | None = None
    hint: ChangeHint | None = None  # what the worker's snapshot may reuse (caller-checked)
    stall_s: float = 0.0


class BackgroundCommitter:
    """Runs background commits for one store, one at a time, in order. Thread-safe."""

    def __init__(self, ctx: EngineContext, *, max_pending: int, memory: int, backpressure: str) -> None:
        if backpressure not in BACKPRESSURE:
            raise InvalidArgumentError(f"backpressure must be 'block' or 'raise', got {backpressure!r}")
        self._ctx = ctx
        self.max_pending, self.memory, self.backpressure = max_pending, memory, backpressure
        self._cond = threading.Condition()
        self._submit = threading.Lock()  # one submission at a time: commits queue in call order
        self._queue: deque[_Job] = deque()
        self._pending: list[CommitHandle] = []
        self._staged = 0  # bytes of new chunks copied (the path for states over the budget)
        self.peak_staged = 0
        self.copied = 0  # bytes copied into staging so far (vouched tensors are not)
        self._host: HostStaging | None = None  # made with the first staged commit (torch)
        self._counters: dict[str, Counters] = {}  # run -> trusted counters of its last staging
        self._last: dict[str, str] = {}  # run -> version id of its newest pending commit
        self._staged_as: dict[str, str] = {}  # run -> version id hashed from its last staging
        self._inflight: dict[bytes, ChunkBytes] = {}  # chunk id -> copy a pending commit will write
        self._failed: list[CommitHandle] = []
        self._worker: threading.Thread | None = None
        self._exit_hook = False
        self._stopping = False  # the worker leaves once the queue is empty (closing, exiting)
        self._closed = False

    @property
    def staged(self) -> int:
        """Bytes pending background commits hold: their staging sets and copies of new chunks."""
        with self._cond:
            host = self._host
            return self._staged + (sum(s.nbytes for s in host.sets if s.held) if host is not None else 0)

    @property
    def kept(self) -> int:
        """Bytes of staging sets kept for reuse, held by a pending commit or not."""
        with self._cond:
            return self._host.allocated if self._host is not None else 0

    def _held(self) -> int:
        """What counts against ``memory``: every staging set, and copies of new chunks."""
        return self._staged + (self._host.allocated if self._host is not None else 0)

    # -- submitting ---------------------------------------------------------------

    def commit(self, state: object, req: CommitRequest, progress: ProgressCallback | None,
               hint: ChangeHint | None = None) -> CommitHandle:
        """Copy ``state`` into host staging now (``hint``: see :mod:`casckpt.engine.write.hint`);
        hash, write and publish it in the background. A state whose staging would not fit
        ``memory`` is snapshotted here instead (hashed in place, new chunks copied)."""
        from casckpt.engine.memory import hoststaging
        from casckpt.engine.write.hint import ChangeHint, skipped_samples, vouched
        from casckpt.format.state import encode_state

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
            with collector.paused():  # many small objects, no cycles
                root, leaves = encode_state(state)  # refuses an unsupported state here, before returning
                plan = hoststaging.layout(leaves)
            target = self._stage_set(req.run, plan)  # may wait for room: the collector runs
            if target is None:
                return self._snapshot_here(state, req, progress, hint, entered, started, created)
            with collector.paused():
                host = cast("HostStaging", self._host)
                queued = False
                try:
                    counted, counters = vouched(self._counters.get(req.run), hint, leaves)
                    staged = host.stage(target, root, leaves, plan, counted.__contains__)
                    self._counters[req.run] = counters
                    self.copied += staged.copied
                    handle = CommitHandle(req.run, req.step)
                    job = _Job(handle, req, None, started, progress, created, staged,
                               ChangeHint(unchanged=hint.unchanged, counted=counted.__contains__,
                                          sampled=skipped_samples(self._ctx, req.run, req.step, leaves,
                                                                  staged.skipped))
                               if hint is not None else None)
                    job.stall_s = time.monotonic() - entered
                    self._enqueue(job)
                    queued = True
                finally:
                    if not queued:  # the staging may be half-copied: copy all next time
                        with self._cond:
                            host.forget(req.run)
                            host.release(target)
                            self._cond.notify_all()
                        self._counters.pop(req.run, None)
            return handle

    def _stage_set(self, run: str, plan: Layout) -> StagingSet | None:
        """A staging set for ``run`` with room for ``plan`` within the budget (waiting for
        one to be released), or None when ``plan`` alone exceeds the budget."""
        if plan.nbytes > self.memory:
            log.info("background commit of %d bytes exceeds commit_memory (%d): hashed on the "
                     "caller's thread, only new chunks copied", plan.nbytes, self.memory)
            if self._host is not None:
                with self._cond:
                    self._host.forget(run)
            return None
        from casckpt.engine.memory.hoststaging import HostStaging

        with self._cond:
            if self._host is None:
                self._host = HostStaging()
            host = self._host

            def room() -> bool:
                found = host.idle(run)
                growth = plan.nbytes - (found.nbytes if found is not None else 0)
                if self._held() + growth > self.memory:
                    host.free_idle(found)
                return self._held() + growth <= self.memory

            if not room():
                if self.backpressure == "raise":
                    raise CommitBackpressureError(
                        f"{len(self._pending)} commits pending hold {self._held()} bytes of a "
                        f"{self.memory}-byte budget; wait on a CommitHandle, or open the store with "
                        "backpressure='block'")
                self._cond.wait_for(room)
            target = host.hold(host.idle(run), run)
            self.peak_staged = max(self.peak_staged, self._held() + plan.nbytes - target.nbytes)
            return target

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            self._pending.append(job.handle)
            self._queue.append(job)
            self._start_worker()
            self._cond.notify_all()

    def _snapshot_here(self, state: object, req: CommitRequest, progress: ProgressCallback | None,
                       hint: ChangeHint | None, entered: float, started: float, created: float,
                       ) -> CommitHandle:
        """A state over the staging budget: snapshot it on the caller's thread (hash in place,
        copy the new chunks), after every commit queued before it has been hashed (its parent)."""
        from casckpt.engine.write import commit as commit_engine

        reserved: list[int] = []

        def reserve(nbytes: int) -> bool:
            admitted = self._reserve(nbytes)
            if admitted:
                reserved.append(nbytes)
            return admitted

        with self._cond:
            self._cond.wait_for(lambda: all(h._hashed.is_set() for h in self._pending))  # noqa: SLF001
        self._counters.pop(req.run, None)
        try:
            # refused here, not on the worker: this snapshot names itself the parent of the
            # commits queued behind it, which must never be a version that was refused
            commit_engine.refuse_existing(self._ctx, req)
            parent = self._last.get(req.run) or commit_engine.parent_of(self._ctx, req.run)
            with self._cond:
                inflight = dict(self._inflight)
            snap = commit_engine.snapshot(self._ctx, state, req, created, parent=parent,
                                          reserve=reserve, progress=progress, pending=inflight,
                                          hint=hint)
            handle = CommitHandle(req.run, req.step, snap.version_id)
            job = _Job(handle, req, snap, started, progress)
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
            self._last[req.run] = snap.version_id
            for cid in snap.new_ids:  # later snapshots dedup against these copies
                self._inflight[cid] = snap.chunks[cid]
        self._enqueue(job)
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
        """Admit ``nbytes`` of copies into the budget (waiting for room, freeing staging no
        commit holds); False if they never fit."""
        if nbytes > self.memory:
            return False

        def room() -> bool:
            if self._held() + nbytes > self.memory and self._host is not None:
                self._host.free_idle(None)
            return self._held() + nbytes <= self.memory

        self._wait_for_room(room, "commits hold their bytes")
        with self._cond:
            self._staged += nbytes
            self.peak_staged = max(self.peak_staged, self._held())
        return True

    # -- the worker -----------------------------------------------------------------

    def foreground(self, run: Callable[[], Version], of: str | None = None) -> Version:
        """Run a blocking commit (of run ``of``) in order: after every pending background
        commit, before any submitted after it (so versions of a run appear in commit order)."""
        self.raise_unreported()
        with self._submit:
            self.wait_all()
            if of is not None:
                self.forget(of)
            return run()

    def forget(self, run: str) -> None:
        """A commit of ``run`` goes another way (blocking, a group): its next background
        commit's counters vouch for nothing, since they vouched for its tensors since the
        run's last staging, and that staging no longer made the parent; it copies all."""
        with self._cond:
            self._counters.pop(run, None)
            if self._host is not None:
                self._host.forget(run)

    def _wait_at_exit(self) -> None:
        """At interpreter exit, before thread pools shut down: finish pending commits (in this
        process: a forked child's copies of them are its parent's to finish)."""
        if os.getpid() != self._ctx.owner:
            return
        if self.pending():
            log.warning("finishing %d background commit(s) at exit; close the store to "
                        "control when", len(self.pending()))
            self.wait_all()
        self._stop_worker()
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
        """The worker: kept waiting between commits (starting a thread per commit cost the
        caller up to milliseconds on a busy machine) until the store closes or the
        interpreter exits (without the exit hook it leaves as soon as the queue is empty)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping or not self._exit_hook)
                if not self._queue:
                    self._worker = None
                    return
                job = self._queue.popleft()
            self._run(job)

    def _stop_worker(self) -> None:
        """Let the idle worker leave (once the queue is empty), and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()

    def _hash(self, job: _Job) -> Snapshot:
        """Snapshot a staged job on the worker: hash, dedup and plan it from its staging."""
        from casckpt.engine.write import commit as commit_engine

        run = job.request.run
        with self._cond:
            parent = self._last.get(run)
        if parent is None:
            parent = commit_engine.parent_of(self._ctx, run)
        staged = cast("Staged", job.staged)
        hint = job.hint
        if hint is not None and hint.counted is not None and parent != self._staged_as.get(run):
            # the counters vouched since the run's last staging, which did not make the parent
            # (another writer of the run came between): hash the staged bytes, which the
            # counters vouch are current, rather than reuse the parent's ids
            hint = replace(hint, counted=None, sampled=None)
        snap = commit_engine.snapshot(self._ctx, staged.mirror, job.request, job.created,
                                      parent=parent, progress=job.progress, hint=hint)
        snap.stall_s = job.stall_s
        with self._cond:
            self._last[run] = snap.version_id
            self._staged_as[run] = snap.version_id
            job.handle._hashed_as(snap.version_id)  # noqa: SLF001 - the handle's owner
            self._cond.notify_all()
        return snap

    def _run(self, job: _Job, foreground: bool = False) -> None:
        from casckpt.engine.write import commit as commit_engine

        outcome: Version | BaseException
        lease: str | None = None
        try:  # the checks that read the catalog, and the lease, run here, off the caller's thread
            commit_engine.refuse_existing(self._ctx, job.request)
            redundancy = self._ctx.packs.placement.redundancy_for(job.request.run)
            self._ctx.packs.placement.check_writable(redundancy)
            if job.snapshot is None:
                job.snapshot = self._hash(job)
            lease = begin_lease(self._ctx.catalog, job.snapshot.version_id)
            outcome = commit_engine.finish(self._ctx, job.request, job.snapshot, redundancy,
                                           job.started, lease, job.progress)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            outcome = exc
            log.warning("background commit %s@%s failed: %s", job.request.run, job.request.step, exc)
            if job.snapshot is None:  # refused or failed before its snapshot: a commit queued
                commit_engine.distrust_hint(self._ctx, job.request.run)  # behind it hashes all
        if lease is not None and isinstance(outcome, BaseException):  # publishing ends it otherwise
            release_lease(self._ctx.catalog, lease, f"commit {job.request.run}@{job.request.step}")
        run = job.request.run
        with self._cond:
            snap = job.snapshot
            if snap is not None:
                for cid in snap.new_ids:
                    if self._inflight.get(cid) is snap.chunks.get(cid):
                        del self._inflight[cid]
                snap.chunks.clear()  # drop the copies (views of staging) before admitting more
                self._staged -= snap.owned
            if job.staged is not None:
                cast("HostStaging", self._host).release(job.staged.held)
                if snap is None:  # not hashed: whether its copies are current is unknown
                    cast("HostStaging", self._host).forget(run)
                    self._counters.pop(run, None)
                job.staged = None
            if job.handle in self._pending:
                self._pending.remove(job.handle)
            # a commit of the run queued behind this one names it as parent, even if it failed
            hashed_as = job.handle._version_id  # noqa: SLF001 - None: it failed before hashing
            if (hashed_as is not None and self._last.get(run) == hashed_as
                    and not any(j.request.run == run for j in self._queue)):
                del self._last[run]
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
        self._stop_worker()
        with self._cond:
            if self._host is not None:  # the staging sets' memory goes back with the store
                self._host.close()
            self._host = None
            self._counters.clear()  # nor are the trusted tensors held any longer
        self.raise_unreported()

