"""Writing a directory snapshot back, byte-identical (``Store.checkout``).

The whole listing is validated first (:func:`casckpt.format.dirsnap.read_listing`: plain
relative names, parents that are directories of the snapshot, parts that add up), so a forged
manifest is refused before anything is created. Everything is then written into a new
temporary sibling of the target (mode 0700, so nobody else can plant links in it; locked
while it runs, so a killed checkout's is reclaimed: :mod:`casckpt.engine.read.checkoutwork`), file by
file in bounded batches of verified chunk reads, each file hashed as it is written and
compared with the BLAKE3 recorded by ``add_dir``; modes are applied last and the directory is
renamed onto the target (which must be absent or an empty directory). On any failure the
temporary directory is removed: the target is never left half written.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from casckpt.engine.context import EngineContext
from casckpt.engine.read import checkoutwork as work_dir
from casckpt.engine.read.restore import read_ranges
from casckpt.errors import (
    CasckptError,
    CheckoutTargetError,
    FileHashMismatchError,
    NotADirectorySnapshotError,
)
from casckpt.format.dirsnap import DIR_KEY, DirEntry, is_snapshot, read_listing
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, TensorEntry
from casckpt.format.state import decode_state
from casckpt.storage.scratch import remove_tree
from casckpt.types import ProgressCallback

if TYPE_CHECKING:
    import torch

BATCH_BYTES = 64 << 20
"""Bytes read per batch of chunk reads (a segment larger than this is read in pieces). One
batch is read while the one before it is hashed and written: at most two are held."""
BATCH_FILES = 256  # files open at once, at most, while a batch is written

Piece = tuple[int, int, int]  # (extent, start, end) of a manifest
APPLIED_MODE = 0o1777
"""Mode bits checkout applies: permissions and the sticky bit. setuid and setgid are recorded
but not applied (as ``tar`` does for other users): a store must not be able to plant a
set-user-id program by way of a checkout run as root."""


def listing(manifest: Manifest) -> list[DirEntry]:
    """The validated entries of a directory snapshot version (parts: its tensor entries).

    Raises:
        NotADirectorySnapshotError: the version was stored by ``commit``, not ``add_dir``.
        CorruptManifestError: the listing is malformed or names an unsafe path.
    """
    keys = manifest.root.get("k") if manifest.root.get("t") == "dict" else None
    state = decode_state(manifest.root, lambda i, _: manifest.tensors[i]) \
        if isinstance(keys, list) and DIR_KEY in keys else None
    if not is_snapshot(state):
        raise NotADirectorySnapshotError(
            f"{manifest.run}@{manifest.step} is not a directory snapshot (it was stored with commit, "
            "not add_dir); read it with restore() or load_tensor(), or `casckpt export` it"
        )
    return read_listing(state, _nbytes)


def _nbytes(part: object) -> int:
    if not isinstance(part, TensorEntry) or part.is_shard or part.stride is not None:
        return -1  # not a part add_dir writes: the entry is refused as malformed
    return part.numel * element_size(part.kind, part.dtype)


def check_target(target: Path) -> None:
    """Refuse a target that exists and is not an empty directory (nothing is touched).

    Raises:
        CheckoutTargetError: it is a file, a link, or a directory with something in it.
    """
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise CheckoutTargetError(f"{str(target)!r} exists and is not a directory; checkout writes "
                                  "into a new or empty directory. Pick another path.")
    if target.is_dir() and holds_entries(target):
        raise CheckoutTargetError(f"{str(target)!r} is not empty; checkout writes into a new or "
                                  "empty directory (it never mixes a snapshot with other files). "
                                  "Pick another path or empty it.")


def holds_entries(directory: Path) -> bool:
    """Whether ``directory`` has any entry (its listing closed at once)."""
    with os.scandir(directory) as entries:  # closed at once: any() stops at the first entry
        return any(entries)


def checkout(ctx: EngineContext, manifest: Manifest, target: Path,
             progress: ProgressCallback | None = None) -> Path:
    """Write the snapshot ``manifest`` holds to ``target``; returns the absolute target path.

    Raises:
        NotADirectorySnapshotError, CorruptManifestError: see :func:`listing`.
        CheckoutTargetError: ``target`` exists and is not an empty directory, or writing next to
            it failed (no space, no permission; the temporary directory is removed).
        CorruptChunkError, MissingDataError: stored data is damaged or gone.
        FileHashMismatchError: a file's bytes do not hash to the recorded BLAKE3.
    """
    entries = listing(manifest)
    target = Path(os.path.abspath(target))
    check_target(target)
    made = [d for d in target.parents if not d.exists()]  # removed again if the checkout fails
    work_dir.reclaim(target.parent)  # what killed checkouts left here
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # a store opened read-only is written nothing: the next checkout into the parent reclaims
        claimed = work_dir.claim(target.parent, target.name,
                                 None if ctx.catalog.read_only else work_dir.registry(ctx.staging.base))
    except OSError as exc:
        _unmake(made)
        raise CheckoutTargetError(f"cannot write next to {str(target)!r}: {exc.strerror or exc}; "
                                  "pick a place you can write to. Nothing was written.") from exc
    work = claimed.path
    try:
        _Writer(ctx, manifest, work, entries, progress).write()
        os.chmod(work, 0o777 & ~_umask())
        os.rename(work, target)  # replaces an empty directory atomically
    except CasckptError:  # the store's own errors (StorageError is an OSError too) as they are
        _abandon(claimed, made)
        raise
    except OSError as exc:
        _abandon(claimed, made)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR) \
                and exc.filename == str(work):
            raise CheckoutTargetError(f"{str(target)!r} was filled while the checkout ran; "
                                      "nothing was written there. Pick another path.") from exc
        raise CheckoutTargetError(
            f"could not write the checkout of {manifest.run}@{manifest.step} next to {str(target)!r}: "
            f"{exc.strerror or exc} ({exc.filename or 'the target'}); nothing was left at the "
            "target. Free space or fix permissions, then check out again."
        ) from exc
    except BaseException:
        _abandon(claimed, made)
        raise
    claimed.release()
    return target


def _abandon(claimed: work_dir.WorkDir, made: list[Path]) -> None:
    """A failed checkout: remove its directory, then its lock, then the parents it made."""
    remove_tree(claimed.path)
    claimed.release()
    _unmake(made)


def _unmake(made: list[Path]) -> None:
    """Remove the missing parents a failed checkout created (deepest first; only if empty)."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


@dataclass(slots=True)
class _Open:
    fd: int
    entry: DirEntry
    hasher: blake3.blake3
    written: int = 0


@dataclass(slots=True)
class _Writer:
    ctx: EngineContext
    manifest: Manifest
    root: Path
    entries: list[DirEntry]
    progress: ProgressCallback | None
    total: int = 0
    done: int = 0
    batch: list[tuple[int, Piece]] = field(default_factory=list)
    batch_bytes: int = 0
    open: dict[int, _Open] = field(default_factory=dict)
    reading: tuple[list[tuple[int, Piece]], Future[list[torch.Tensor]]] | None = None
    reader: ThreadPoolExecutor = field(  # its thread starts with the first read
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="casckpt-checkout"))

    def write(self) -> None:
        self.total = sum(e.size for e in self.entries)
        try:
            for index, entry in enumerate(self.entries):
                where = self.root / entry.path
                if entry.kind == "dir":
                    os.mkdir(where, 0o700)
                elif entry.kind == "link":
                    os.symlink(entry.target or "", where)
                else:
                    self._start(index, entry, where)
            self._flush()
            self._flush()  # the last batch read
            for entry in reversed(self.entries):  # deepest first: a read-only parent comes last
                if entry.kind == "dir":
                    os.chmod(self.root / entry.path, entry.mode & APPLIED_MODE)
        finally:
            self.reader.shutdown(wait=True, cancel_futures=True)
            for handle in self.open.values():
                os.close(handle.fd)

    def _start(self, index: int, entry: DirEntry, where: Path) -> None:
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.open[index] = _Open(fd, entry, self.ctx.crypto.file_hasher(entry.size))
        if entry.size == 0:
            self._finish(index)
            return
        for piece in _pieces(entry):
            if self.batch and (self.batch_bytes + piece[2] - piece[1] > BATCH_BYTES
                               or len(self.open) > BATCH_FILES):
                self._flush()
            self.batch.append((index, piece))
            self.batch_bytes += piece[2] - piece[1]

    def _flush(self) -> None:
        """Start reading the batch gathered so far; write the one read before it."""
        started = None
        if self.batch:
            pieces = [piece for _, piece in self.batch]
            started = (self.batch, self.reader.submit(read_ranges, self.ctx, self.manifest, pieces))
            self.batch = []
            self.batch_bytes = 0
        previous, self.reading = self.reading, started
        if previous is not None:
            self._write(previous[0], previous[1].result())

    def _write(self, batch: list[tuple[int, Piece]], outs: list[torch.Tensor]) -> None:
        for (index, _), out in zip(batch, outs, strict=True):
            handle = self.open[index]
            data = memoryview(out.numpy().data)
            handle.hasher.update(data)
            view = data
            while view:
                view = view[os.write(handle.fd, view):]
            handle.written += len(data)
            self.done += len(data)
            if handle.written == handle.entry.size:
                self._finish(index)
        if self.progress is not None:
            self.progress("write", self.done, self.total)

    def _finish(self, index: int) -> None:
        handle = self.open.pop(index)
        try:
            if handle.hasher.hexdigest() != handle.entry.blake3:
                raise FileHashMismatchError(
                    f"{handle.entry.path!r} of {self.manifest.run}@{self.manifest.step} does not hash to "
                    "the BLAKE3 recorded when it was added (the file changed while add_dir read it, or "
                    "the snapshot is forged); nothing was written at the target. Add the directory "
                    "again from a quiet copy."
                )
            os.fchmod(handle.fd, handle.entry.mode & APPLIED_MODE)
        finally:
            os.close(handle.fd)


def _pieces(entry: DirEntry) -> Iterator[Piece]:
    """The byte ranges of extents that make up a file, in order, none over BATCH_BYTES."""
    for part in entry.parts:
        start = part.offset
        end = start + _nbytes(part)
        while start < end:
            step = min(end, start + BATCH_BYTES)
            yield (part.extent, start, step)
            start = step


def _umask() -> int:
    """The process's umask, read without changing it (Linux); 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
