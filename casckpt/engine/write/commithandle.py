"""The handle of a background commit (``Store.commit(..., block=False)``): what the caller
holds while :class:`~casckpt.engine.write.background.BackgroundCommitter` hashes, writes and
publishes the state on its worker.

The committer is the handle's owner: it sets the version id once the worker has hashed the
state (``_hashed_as``) and the outcome once the commit has succeeded or failed
(``_settle``), and reads whether the caller has seen a failure (``_reported``, ``_error``).
The caller only waits and reads. A forked child's copy of a handle refuses every call: no
worker in the child finishes it.
"""

from __future__ import annotations

import os
import threading
from typing import cast

from casckpt.errors import CommitTimeoutError, refuse_forked
from casckpt.types import Version


class CommitHandle:
    """A commit running in the background. Thread-safe.

    ``run`` and ``step`` are known at once. ``id`` (the version id) is a hash of the
    state, which the worker computes from the staged copy: reading it waits until the
    worker has hashed the state (raising why the commit failed if it failed before). The
    version becomes visible when the commit succeeds.
    """

    def __init__(self, run: str, step: int, version_id: str | None = None) -> None:
        self.run, self.step = run, step
        self._owner = os.getpid()  # a forked child's copy waits on no worker: refused
        self._version_id = version_id
        self._hashed = threading.Event()  # set with the version id, or with a failure
        if version_id is not None:
            self._hashed.set()
        self._done = threading.Event()
        self._outcome: Version | BaseException | None = None  # set once, with _done
        self._reported = False

    @property
    def id(self) -> str:
        """The version id; waits until the worker has hashed the state.

        Raises:
            CasckptError: why the commit failed, when it failed before its id was known.
        """
        refuse_forked(self._owner)
        self._hashed.wait()
        if self._version_id is None:
            self._reported = True
            raise cast(BaseException, self._outcome)
        return self._version_id

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "visible")
        ident = self._version_id[:12] if self._version_id is not None else "(not hashed yet)"
        return f"<CommitHandle {self.run}@{self.step} {ident} {state}>"

    def done(self) -> bool:
        """True once the commit has succeeded or failed."""
        refuse_forked(self._owner)  # never, in a forked child: its worker is the parent's
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Version:
        """Block until the commit is visible and return its version.

        Raises:
            CommitTimeoutError: ``timeout`` seconds passed first (the commit goes on).
            CasckptError: why the commit failed (no version is visible then).
        """
        refuse_forked(self._owner)
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
        refuse_forked(self._owner)
        if not self._done.is_set():
            return None
        self._reported = True
        return self._error

    @property
    def _error(self) -> BaseException | None:
        return self._outcome if isinstance(self._outcome, BaseException) else None

    def _hashed_as(self, version_id: str) -> None:
        self._version_id = version_id
        self._hashed.set()

    def _settle(self, outcome: Version | BaseException) -> None:
        self._outcome = outcome
        self._done.set()
        self._hashed.set()
