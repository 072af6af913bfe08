"""The temporary directory a checkout writes into, and the reclaim of those a killed one left.

A checkout writes into ``.<target>.checkout-<token>/`` beside its target and renames it onto
the target at the end. Its owner holds an exclusive ``flock`` on
``.<target>.checkout-<token>.lock`` (beside it) from before the directory exists until after
it is renamed or removed, so the kernel says whether the owner lives (as for scratch
directories, :mod:`casckpt.storage.scratch`): a lock that can be taken belongs to a process
that died. :func:`reclaim` removes exactly those directories under one parent, never a live
checkout's (in this process or another). The next checkout into the same parent reclaims
there; ``gc`` reclaims every parent this store's checkouts on this host used, which each
checkout records in ``<registry>/<token>`` (the lock's path) until it ends.

Directories made by casckpt versions before the lock (``.<target>.checkout-<8 chars>``,
no lock) are removed once older than a grace period: their writers cannot be asked.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from casckpt.storage.scratch import DEFAULT_GRACE, LOCK_SUFFIX, Reclaimed, reclaim_if_dead, remove_tree

log = logging.getLogger(__name__)

_LOCKED = re.compile(r"^\..+\.checkout-[0-9a-f]{32}$")
_UNLOCKED = re.compile(r"^\..+\.checkout-[a-z0-9_]{8}$")  # tempfile.mkdtemp's, before the lock


@dataclass(slots=True)
class WorkDir:
    """A claimed checkout directory: :attr:`path` is written, then renamed or removed, then
    :meth:`release` drops the lock (never before: the directory would look abandoned)."""

    path: Path
    lock: Path
    entry: Path | None
    fd: int

    def release(self) -> None:
        """Remove the lock and the registry entry, then close the lock. Idempotent."""
        if self.fd < 0:
            return
        self.lock.unlink(missing_ok=True)
        if self.entry is not None:
            self.entry.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def claim(parent: Path, name: str, registry: Path | None) -> WorkDir:
    """Make and lock a new checkout directory for target ``name`` under ``parent`` (mode 0700),
    recorded in ``registry`` when given (best effort: a registry that cannot be written only
    leaves the directory to the next checkout into ``parent``).

    Raises:
        OSError: ``parent`` cannot be written.
    """
    stem = f".{name}.checkout-{uuid.uuid4().hex}"
    lock, path = parent / f"{stem}{LOCK_SUFFIX}", parent / stem
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # no flock here (some network file systems): reclaimed by age
            log.debug("cannot lock %s (%s): a killed checkout's directory is left in place", lock, exc)
        os.mkdir(path, 0o700)
    except BaseException:
        os.close(fd)
        lock.unlink(missing_ok=True)
        raise
    return WorkDir(path, lock, _register(registry, stem, lock), fd)


def _register(registry: Path | None, stem: str, lock: Path) -> Path | None:
    if registry is None:
        return None
    entry = registry / stem.rsplit("-", 1)[1]
    try:
        registry.mkdir(parents=True, exist_ok=True)
        entry.write_text(str(lock), encoding="utf-8")
    except OSError as exc:
        log.debug("cannot record checkout %s in %s: %s", lock, registry, exc)
        return None
    return entry


def reclaim(parent: Path, *, grace: float = DEFAULT_GRACE, now: float | None = None) -> Reclaimed:
    """Remove the checkout directories under ``parent`` whose checkout was killed. Never raises
    (housekeeping: errors are logged) and never touches a live checkout's directory, nor
    anything not named as a checkout's (a symlink or other file type is never followed)."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(parent))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot list %s to reclaim killed checkouts: %s", parent, exc)
        return Reclaimed()
    done = Reclaimed()
    for entry in entries:
        try:
            if entry.name.endswith(LOCK_SUFFIX) and _LOCKED.match(entry.name[: -len(LOCK_SUFFIX)]):
                done += _reclaim_locked(Path(entry.path))
            elif _UNLOCKED.match(entry.name) and entry.is_dir(follow_symlinks=False) and \
                    now - entry.stat(follow_symlinks=False).st_mtime >= grace:
                done += remove_tree(Path(entry.path))
        except OSError as exc:
            log.warning("could not reclaim %s: %s", entry.path, exc)
    if done.files:
        log.info("reclaimed %d file(s), %d bytes, of killed checkouts under %s", done.files, done.nbytes,
                 parent)
    return done


def registry(staging: Path) -> Path:
    """Where a store's checkouts on this host record their directories for ``gc``, under the
    store's staging directory ``staging``."""
    return staging / "checkouts"


def reclaim_registered(registry: Path) -> Reclaimed:
    """:func:`reclaim` in every parent a recorded checkout used; drops the records of those that
    ended. Never raises."""
    try:
        entries = [e for e in os.scandir(registry) if e.is_file(follow_symlinks=False)]
    except OSError:
        return Reclaimed()
    done = Reclaimed()
    for entry in entries:
        try:
            lock = Path(Path(entry.path).read_text(encoding="utf-8"))
            if _LOCKED.match(lock.name[: -len(LOCK_SUFFIX)]):
                done += reclaim(lock.parent)
            if not os.path.lexists(lock):
                os.unlink(entry.path)
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("could not reclaim the checkout recorded in %s: %s", entry.path, exc)
    return done


def _reclaim_locked(lock: Path) -> Reclaimed:
    return reclaim_if_dead(lock, lock.with_name(lock.name[: -len(LOCK_SUFFIX)]))
