"""Scratch directories: where a process writes files that are not objects yet, and how
the files of a process that died are told apart from a live one's and reclaimed.

A :class:`ScratchDir` is ``<base>/<token>/`` (``token``: 32 hex digits, new per
claim). Its owner holds an exclusive ``flock`` on ``<base>/<token>.lock`` from
before the directory exists until after it is removed, so the kernel itself
says whether the owner lives: a lock that can be taken belongs to a process
that died (or forgot to close). :func:`reclaim` removes exactly those
directories, never a live owner's (in this process or another, on this host
or, where the file system shares ``flock``, another), plus loose regular files
older than a grace period (left by casckpt versions that wrote straight into
``<base>``, whose writers cannot be asked).

Used for ``<location>/tmp`` (objects being written, :mod:`.local`) and
``<cache>/staging`` (packs being filled, the engine's packer).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

DEFAULT_GRACE = 3600.0  # seconds a loose file without an owner's lock is left alone
LOCK_SUFFIX = ".lock"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_LOOSE = re.compile(r"^[0-9a-f]{32}\.(part|pack)$")  # what casckpt wrote before scratch directories
# flock cannot be taken here at all (some FUSE and network file systems): the owner writes
# into <base> itself, and its files are reclaimed by age like a pre-token writer's
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What a reclaim removed: files (counting each removed directory's files) and their bytes."""

    files: int = 0
    nbytes: int = 0

    def __add__(self, other: Reclaimed) -> Reclaimed:
        return Reclaimed(self.files + other.files, self.nbytes + other.nbytes)


class ScratchDir:
    """A directory under ``base`` that only this object writes in, for as long as it is open.

    Created on first :meth:`path` (a store that only reads leaves no trace);
    claimed afresh, under a new token, when something removed it underneath
    (a wiped location, a cleared cache). :meth:`close` removes it. Files in
    it are never objects: callers rename them into place or delete them.
    Thread-safe. A forked child inherits the parent's lock (the directory
    stays live while either process does) but never removes the parent's
    directory: writing, it claims one of its own.
    """

    def __init__(self, base: Path, *, parents: bool = True) -> None:
        """``parents``: make ``base``'s missing parents too (else only ``base`` itself: a
        location whose directory vanished, say an unmounted disk, is not re-created)."""
        self.base = Path(base)
        self._parents = parents
        self._mutex = threading.Lock()
        self._dir: Path | None = None
        self._lock_fd: int | None = None
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"ScratchDir({str(self.base)!r})"

    def path(self) -> Path:
        """The directory, made (or made again) if it does not exist.

        Raises:
            OSError: ``base`` cannot be created or written.
        """
        with self._mutex:
            if self._dir is not None and self._pid == os.getpid() and self._dir.is_dir():
                return self._dir
            self._release()
            self._dir, self._pid = self._claim(), os.getpid()
            return self._dir

    def _claim(self) -> Path:
        """Make a new token's lock (held) and directory; returns the directory."""
        self.base.mkdir(parents=self._parents, exist_ok=True)
        token = uuid.uuid4().hex
        fresh = self.base / f".{token}.new"  # a loose file until renamed: reclaimed by age
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                log.warning("%s does not support flock: files written there are reclaimed only "
                            "when older than %.0f s", self.base, DEFAULT_GRACE)
                os.close(fd)
                fresh.unlink(missing_ok=True)
                return self.base
            # the lock is held before its name appears, so no reclaim can take it from us
            os.replace(fresh, self.base / f"{token}{LOCK_SUFFIX}")
            directory = self.base / token
            directory.mkdir()
        except BaseException:
            os.close(fd)
            fresh.unlink(missing_ok=True)
            (self.base / f"{token}{LOCK_SUFFIX}").unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        return directory

    def _release(self) -> None:
        """Remove the directory, then its lock (in that order: see :func:`reclaim`)."""
        directory, fd = self._dir, self._lock_fd
        self._dir, self._lock_fd = None, None
        if fd is None or directory is None:
            return
        if self._pid != os.getpid():  # a forked child: the directory is its parent's
            os.close(fd)
            return
        try:
            shutil.rmtree(directory, ignore_errors=True)
            (directory.parent / f"{directory.name}{LOCK_SUFFIX}").unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove scratch directory %s: %s (the next open reclaims it)",
                        directory, exc)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Remove the directory and release the lock. Idempotent; never raises OSError."""
        with self._mutex:
            self._release()


def reclaim(base: Path, *, grace: float = DEFAULT_GRACE, now: float | None = None) -> Reclaimed:
    """Remove the scratch directories under ``base`` whose owner is gone, and loose files
    older than ``grace`` seconds. Never touches a live owner's directory.

    Only what casckpt itself makes there is considered: ``<token>/`` with its
    ``<token>.lock``, and regular files named as older casckpt versions named
    theirs (``<32 hex>.part``, ``<32 hex>.pack``). Anything else (a FIFO, a
    symlink, another file or directory: a location may share a directory with
    other users' files) is left alone and never opened; so is a ``base`` that is
    a symlink. Errors are
    logged, never raised: a reclaim is housekeeping.
    """
    now = time.time() if now is None else now
    try:
        if stat.S_ISLNK(os.lstat(base).st_mode):  # a symlinked tmp/ may lead anywhere: not ours
            log.warning("not reclaiming leftovers under %s: it is a symlink", base)
            return Reclaimed()
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot list %s to reclaim leftovers: %s", base, exc)
        return Reclaimed()
    done = Reclaimed()
    for entry in entries:
        try:
            done += _reclaim_entry(Path(base), entry, grace, now)
        except OSError as exc:
            log.warning("could not reclaim %s: %s", entry.path, exc)
    if done.files:
        log.info("reclaimed %d leftover file(s), %d bytes, under %s", done.files, done.nbytes, base)
    return done


def _reclaim_entry(base: Path, entry: os.DirEntry[str], grace: float, now: float) -> Reclaimed:
    name = entry.name
    if name.endswith(LOCK_SUFFIX) and _TOKEN.match(name[: -len(LOCK_SUFFIX)]):
        if entry.is_file(follow_symlinks=False):
            return _reclaim_locked(base, name[: -len(LOCK_SUFFIX)])
        return Reclaimed()
    if _TOKEN.match(name) and entry.is_dir(follow_symlinks=False):
        # its owner makes the lock before the directory and removes it after: a directory
        # without a lock was left by a reclaim or a close that did not finish
        if not os.path.lexists(base / f"{name}{LOCK_SUFFIX}"):
            return remove_tree(base / name)
        return Reclaimed()
    if _LOOSE.match(name) and entry.is_file(follow_symlinks=False):
        st = entry.stat(follow_symlinks=False)
        if now - st.st_mtime >= grace:
            os.unlink(entry.path)
            return Reclaimed(1, st.st_size)
    return Reclaimed()


def _reclaim_locked(base: Path, token: str) -> Reclaimed:
    return reclaim_if_dead(base / f"{token}{LOCK_SUFFIX}", base / token)


def reclaim_if_dead(lock: Path, work: Path) -> Reclaimed:
    """Remove directory ``work`` and then ``lock`` if ``lock`` (a regular file, never followed)
    can be ``flock``'d: its owner died. A held lock, or one this process may not open for
    writing (a reader cannot clean up here), leaves both in place.

    Raises:
        OSError: the lock cannot be opened for another reason.
    """
    try:  # for writing: an exclusive lock over NFS needs it
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return Reclaimed()  # its owner closed, or another reclaim got there first
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ELOOP):
            log.debug("cannot reclaim %s: %s", lock, exc)
            return Reclaimed()
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Reclaimed()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return Reclaimed()  # held: the owner lives (or the lock cannot be tested: leave it)
        done = remove_tree(work) if work.is_dir() and not work.is_symlink() else Reclaimed()
        lock.unlink(missing_ok=True)
        return done
    finally:
        os.close(fd)


def remove_tree(path: Path) -> Reclaimed:
    """Remove directory ``path``, making its directories writable first (a checkout applies
    read-only modes before its rename); symlinks in it are removed, never followed. Returns
    what it held."""
    files = nbytes = 0
    for dirpath, dirs, names in os.walk(path):
        for name in dirs:
            sub = os.path.join(dirpath, name)
            if not os.path.islink(sub):
                os.chmod(sub, 0o700)
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            files += 1
            nbytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
    shutil.rmtree(path, ignore_errors=True)
    return Reclaimed(files, nbytes)


@runtime_checkable
class TempReclaimer(Protocol):
    """A blob store that writes temporary files it can reclaim (the local one)."""

    def reclaim_temp(self, grace: float = DEFAULT_GRACE) -> Reclaimed:
        """Remove the temporary files of writers that are gone; never raises."""
