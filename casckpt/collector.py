"""Python's cyclic garbage collector, paused while casckpt makes many small objects at once.

A commit's snapshot (a state of 10^5 tensors makes a few objects per leaf) and a listing of
10,000 versions (rows, tuples, ``Version`` values) make no reference cycles, but each 700
allocations start a collection, and so many survivors set off full collections that walk
every object of the process: a third of an unchanged commit's time at 10^5 tensors
(docs/perf/many-tensors.md), a third of a tensor history's and a quarter of ``log``'s
(docs/perf/history3.md). Memory is still freed by reference counting while paused.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()
_pauses = 0  # blocks running with the collector paused, in every thread
_resume = False  # whether the collector ran before the first of them came in
_epoch = 0  # bumped in a forked child, whose copies of the parent's blocks never end there


@contextmanager
def paused() -> Iterator[None]:
    """The collector paused over the block. Process-wide: blocks of several threads at once
    share the pause, and the last one out resumes the collector if it ran before the first
    one came in (a collector the program paused stays paused; a ``gc.disable()`` another
    thread makes meanwhile is undone then). Another thread's cycles wait for the end. A
    process forked meanwhile starts with the collector as it was before the pause (its
    copies of the other threads' blocks never end).

    On resuming, the objects made meanwhile are moved to the oldest generation
    (:func:`_promote_young`) rather than walked by the young collection the next allocation
    would start."""
    global _pauses, _resume
    with _LOCK:
        epoch = _epoch
        if not _pauses:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _LOCK:
            if epoch == _epoch:  # else this block was forked into a child that resumed already
                _pauses -= 1
                if not _pauses and _resume:
                    _promote_young()
                    gc.enable()


def _after_fork_in_child() -> None:
    global _pauses, _epoch, _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    if _pauses and _resume:
        gc.enable()
    _pauses, _epoch = 0, _epoch + 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _promote_young() -> None:
    """Move every object the collector tracks to its oldest generation, without walking them
    (``gc.freeze`` then ``gc.unfreeze``: two list splices). What the block made lives on
    (memos, returned values) or is freed by reference counting (no cycles); a cycle another
    thread made meanwhile is collected by the next full collection instead of a young one.
    Skipped when the program froze objects itself (``gc.freeze``): unfreezing would undo that."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
