"""Commits of DeepSpeed saves off the training thread (``install(engine, background=True)``).

``save_checkpoint`` returns once every tensor of this rank's files is copied to host memory
(``snapshot``); the group commit of the copy runs on a thread of its own, over a gloo process
group of its own (``new_group``, made on every rank by ``install``): a rank-by-rank commit is a
sequence of collectives, and the training's process group is busy with the next steps meanwhile.
One commit is in flight at a time, in save order: the next save, a load and ``close`` wait for
it first, and raise its failure there (on every rank; nothing of it is visible then).

DeepSpeed writes ``DIR/latest`` as soon as ``save_checkpoint`` returns, before the version is
published: a job killed in between resumes from the catalog, whose last version is then the
previous save (:meth:`CasckptCheckpointEngine.prepare_load` falls back to it), and the
markers of a tag are written only once its version is visible.

A script that ends with a commit in flight (no ``close()``) waits for it when the main thread
finishes, before Python stops the thread pools the commit writes with: the commit completes
(its failure is logged, as nobody can catch it there), rather than failing at shutdown.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from casckpt.types import Version

log = logging.getLogger(__name__)


def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory (what training mutates next is not read)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [snapshot(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(value) for value in obj)
    return obj


class BackgroundCommits:
    """One thread and one gloo process group for a rank's background commits.

    Args:
        group: the process group whose ranks save together (None: the world); every rank of
            the world must construct this at the same point (``new_group`` is a collective).
    """

    def __init__(self, group: Any = None) -> None:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="casckpt-deepspeed")
        self._pending: concurrent.futures.Future[Version] | None = None
        _wait_at_exit(self)

    def submit(self, publish: Callable[[], Version]) -> None:
        """Run ``publish`` on the commit thread, after the commit in flight (its failure raised here)."""
        self.wait()
        self._pending = self._thread.submit(publish)

    def wait(self) -> Version | None:
        """The version of the commit in flight once it is published (None: none in flight).

        Raises:
            CasckptError: why it failed (GroupCommitError where another rank did).
        """
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Wait for the commit in flight (raising its failure), then stop the thread and
        release the process group."""
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
            if dist.is_initialized():
                dist.destroy_process_group(self.group)

    def _at_exit(self) -> None:
        pending = self._pending
        if pending is None or pending.done() and pending.exception() is None:
            return
        log.warning("casckpt: the process is ending with a DeepSpeed checkpoint commit in flight; "
                    "waiting for it (call close() on the checkpoint engine to wait where its "
                    "failure can be caught)")
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - nobody is left to raise it to
            log.exception("casckpt: the DeepSpeed checkpoint committed in the background as the "
                          "process ended failed: it was not saved")


def _wait_at_exit(commits: BackgroundCommits) -> None:
    """Wait for ``commits``' commit in flight when the main thread finishes. Python stops
    accepting work in every thread pool then (``concurrent.futures``' own hook, registered
    when it was imported, before this one) and runs these hooks last registered first; the
    commit's writes need those pools, so this must run first (``atexit`` would run after).
    Held for the process's life: an engine dropped with its commit in flight still waits."""
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+: threading's own hooks
    if register is None:  # pragma: no cover - another interpreter: the commit may fail at exit
        import atexit

        atexit.register(commits._at_exit)
        return
    register(commits._at_exit)
