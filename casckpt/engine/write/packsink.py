"""The thread a :class:`~casckpt.engine.write.packer.Packer` writes its packs' bytes on.

Writing a staging pack and hashing it for the pack id cost what the bytes cost; done on
the committing thread, they ran in series with the encoding the pool does meanwhile.
A :class:`PackSink` runs them, in order, on a thread of its own (the file writes and
BLAKE3 of long buffers release the GIL), so the committing thread only hands buffers
over. The queue is bounded by bytes: a producer faster than the disk waits. The first
job that fails stops the rest, and its error is raised to the producer at its next call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

Job = Callable[[BaseException | None], None]
"""A unit of work. Called with None to do it; with the error that stopped the sink (or
:data:`ABORTED`) to only release what it holds, signal whoever waits on it, and do no I/O."""


class PackAborted(Exception):
    """What the jobs a :meth:`PackSink.stop` discards are given in place of a run."""


ABORTED = PackAborted("the packer was aborted")


class PackSink:
    """Runs jobs in order on one thread of its own, holding at most ``limit`` bytes queued.

    Call order: :meth:`put` any number of times, then :meth:`stop` once (from the thread
    that called :meth:`put`). Every job put is called exactly once, run or not. Not for
    several producer threads.
    """

    def __init__(self, limit: int, name: str = "casckpt-pack-sink") -> None:
        self._limit = limit
        self._jobs: deque[tuple[Job, int]] = deque()
        self._queued = 0  # bytes of the jobs put and not yet done (the running one included)
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Job, nbytes: int = 0) -> None:
        """Queue ``job`` (holding ``nbytes``), waiting while the queue holds ``limit`` bytes
        (a job larger than that waits for an empty queue).

        Raises:
            BaseException: the error of a job that failed (the job given is then not queued,
                nor called).
        """
        with self._cv:
            while self._queued and self._queued + nbytes > self._limit and self._error is None:
                self._cv.wait()
            self.raise_error()
            self._jobs.append((job, nbytes))
            self._queued += nbytes
            self._cv.notify_all()

    def raise_error(self) -> None:
        """Raise the error of the first job that failed, if one did."""
        if self._error is not None:
            raise self._error

    def stop(self, *, discard: bool = False) -> None:
        """Run the jobs queued (``discard``: call them with :data:`ABORTED` instead), then end
        the thread. Raises the first job error, unless ``discard``."""
        with self._cv:
            self._stopping = True
            if discard:
                dropped, self._jobs = list(self._jobs), deque()
            self._cv.notify_all()
        if discard:
            for job, _ in dropped:
                job(ABORTED)
        self._thread.join()
        if not discard:
            self.raise_error()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs.popleft()
                error = self._error
            try:
                job(error)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                error = exc
            with self._cv:
                if self._error is None and error is not None:
                    self._error = error
                self._queued -= nbytes
                self._cv.notify_all()
