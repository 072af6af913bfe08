"""Erasure coding in worker processes, so encoding a pack never holds this process's GIL.

pyeclib keeps the GIL for the whole of an encode (~150 ms per 64 MiB pack),
stalling every hashing and compression thread of a commit meanwhile.
:class:`EncodePool` hands each pack *file* to a worker process
(:mod:`casckpt.storage.ecworker`), which reads it, encodes it and writes
its shard objects as files beside it; the caller then stores those files
(a local location renames them into place), so no pack or shard byte
passes through this process at all.

Workers are fresh interpreters (``python -m casckpt.storage.ecworker``,
started through ``subprocess``: no fork of a process that holds torch's
threads, and no re-import of the user's main module as ``multiprocessing``'s
spawn and forkserver contexts do). They start on first use, one per
concurrent caller up to the pool's size, and exit when the pool closes or
when this process dies (their requests come down a pipe; they stop at its
end).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from casckpt.errors import EncodeWorkerError, InvalidArgumentError, StorageError, StorageFullError
from casckpt.storage.ecworker import MALLOC_ENV

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the casckpt package
_CLOSE_WAIT_S = 5.0
_WHAT_TO_DO = ("nothing was published; commit again (a fresh worker starts). If workers keep "
               "dying, look for the out-of-memory killer or a process limit")


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One shard object a worker wrote: its index, file, length and fragment checksum."""

    index: int
    path: Path
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class EncodedPack:
    """A pack encoded by a worker: its stripe, data offset and shard files, by index."""

    stripe: int
    offset: int
    shards: tuple[ShardFile, ...]


class WorkersUnavailableError(EncodeWorkerError):
    """No worker process could be started here (no usable ``sys.executable``, or the worker
    failed as it started); the caller may encode in this process instead."""


class _Died(Exception):
    """The worker's pipe ended: it is gone."""


class _Worker:
    """One worker process and its two pipes. Used by one thread at a time."""

    def __init__(self) -> None:
        if not sys.executable:
            raise WorkersUnavailableError("no Python executable (sys.executable) to start an "
                                          "erasure-coding worker with")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
        env.update(MALLOC_ENV)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "casckpt.storage.ecworker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env, close_fds=True, text=True, encoding="utf-8")
        except OSError as exc:
            raise WorkersUnavailableError(f"cannot start an erasure-coding worker: {exc}") from exc
        self.requests: IO[str] = self.process.stdin  # type: ignore[assignment]
        self.replies: IO[str] = self.process.stdout  # type: ignore[assignment]
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, request: dict[str, Any]) -> None:
        try:
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise _Died() from exc

    def receive(self) -> dict[str, Any]:
        try:
            line = self.replies.readline()
        except (OSError, ValueError) as exc:
            raise _Died() from exc
        if not line:
            raise _Died()
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):  # not our worker talking (a foreign sys.executable?)
            raise _Died()
        return reply

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply (the first call waits for "ready" too)."""
        if not self.ready:
            try:
                self.receive()
            except _Died:
                raise WorkersUnavailableError(
                    f"the erasure-coding worker exited as it started ({self.stopped()}); see its "
                    "messages on stderr") from None
            self.ready = True
        self.send(request)
        return self.receive()

    def stopped(self) -> str:
        """Reap the process; how it ended, in words."""
        self.kill()
        code = self.process.returncode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close_pipes()

    def close(self) -> None:
        """Ask the worker to finish (end of input) and reap it; kill it if it lingers."""
        try:
            self.requests.close()
        except OSError:
            pass
        try:
            self.process.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.requests, self.replies):
            try:
                pipe.close()
            except OSError:
                pass


class EncodePool:
    """Encodes pack files in up to ``size`` worker processes. Thread-safe.

    Call order: :meth:`encode` any number of times from any threads (each
    call has a worker to itself; callers beyond ``size`` wait), then
    :meth:`close`. A process forked from this one starts its own workers.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise InvalidArgumentError(f"an encoding pool needs at least one worker, got {size}")
        self._size = size
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._started = 0
        self._closed = False
        self._owner = os.getpid()

    def encode(self, pack: Path, pack_id: str, size: int, k: int, m: int, algorithm: str,
               out: Sequence[Path]) -> EncodedPack:
        """Encode the finished pack file ``pack`` (``size`` bytes, id ``pack_id``) with
        ``ec:k+m``, writing shard ``i`` to the new file ``out[i]``.

        The shard files hold exactly what :meth:`ErasureCode.shards` gives. On any
        error the files this call created are gone (or were never made).

        Raises:
            WorkersUnavailableError: no worker could be started here.
            EncodeWorkerError: the worker died while encoding (killed, out of memory).
            StorageFullError: no room for the shard files.
            StorageError: the pack file could not be read, or the encode failed.
            InvalidArgumentError: pyeclib refuses ``algorithm`` or ``k``, ``m``.
        """
        request = {"pack": os.fspath(pack), "id": pack_id, "size": size, "k": k, "m": m,
                   "algorithm": algorithm, "out": [os.fspath(p) for p in out]}
        worker = self._acquire()
        try:
            reply = worker.ask(request)
        except _Died:
            how = worker.stopped()
            self._release(None)
            raise EncodeWorkerError(
                f"the erasure-coding worker (pid {worker.pid}) died while encoding pack {pack_id} "
                f"({how}): {_WHAT_TO_DO}") from None
        except BaseException:  # not answered (interrupted, or it never started): never reuse it
            worker.kill()
            self._release(None)
            raise
        self._release(worker)
        if "error" in reply:
            raise _error(reply)
        return EncodedPack(int(reply["stripe"]), int(reply["offset"]), tuple(
            ShardFile(int(i), Path(out[int(i)]), int(n), str(c)) for i, n, c in reply["shards"]))

    def warm(self, count: int = 1) -> None:
        """Start a worker now if fewer than ``count`` (at most the pool's size) are running,
        so it starts while the caller fills a pack instead of when that pack is handed over.
        Never raises: where no worker can start, :meth:`encode` says so."""
        with self._cond:
            self._adopt()
            if self._started >= min(count, self._size) or self._closed:
                return
            self._started += 1
        try:
            worker = _Worker()
        except WorkersUnavailableError:
            self._release(None)
            return
        except BaseException:  # an interrupt while starting it: the slot is free again
            self._release(None)
            raise
        self._release(worker)

    def pids(self) -> list[int]:
        """The process ids of the idle workers (busy ones are not listed)."""
        with self._cond:
            return [w.pid for w in self._idle]

    def close(self) -> None:
        """Stop every idle worker and refuse new calls. Idempotent; call once no call runs."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        if os.getpid() == self._owner:
            for worker in idle:
                worker.close()

    def _acquire(self) -> _Worker:
        with self._cond:
            self._adopt()
            while not self._idle and self._started >= self._size and not self._closed:
                self._cond.wait()
            if self._closed:
                raise StorageError("the store is closed: its erasure-coding workers are stopped")
            while self._idle:
                worker = self._idle.pop()
                if worker.process.poll() is None:
                    return worker
                worker.kill()  # died while idle (the OOM killer, say): a fresh one replaces it
                self._started -= 1
            self._started += 1
        try:
            return _Worker()
        except BaseException:
            self._release(None)
            raise

    def _adopt(self) -> None:
        """In a process forked from the owner, forget the owner's workers and pipes (the lock
        is held)."""
        if os.getpid() != self._owner:
            self._owner, self._idle, self._started = os.getpid(), [], 0

    def _release(self, worker: _Worker | None) -> None:
        """Give ``worker`` back, or (None) forget one that is gone."""
        with self._cond:
            if worker is None or self._closed:
                self._started -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()
        if worker is not None and self._closed:
            worker.close()


def _error(reply: dict[str, Any]) -> StorageError | InvalidArgumentError:
    message, kind = str(reply["error"]), reply.get("kind")
    if kind == "full":
        return StorageFullError(message, location=reply.get("location"), needed=reply.get("needed"))
    if kind == "invalid":
        return InvalidArgumentError(message)
    return StorageError(message)
