"""A blob store in a local directory.

Writes go to a temporary file in this store's own scratch directory,
``<root>/tmp/<token>/`` (see :mod:`.scratch`), are fsync'd, renamed into
place and the directory fsync'd, so an object is either wholly present or
absent after a crash. A temporary file is removed when its write fails; the
files of a process that died are reclaimed by :meth:`LocalBlobStore.reclaim_temp`.

Reads trust nothing they find: an object must be a regular file inside the
location (a FIFO, a device, a directory or a symlink leaving the root is
refused with ``UnsafeObjectError``, without opening it), and ``get`` refuses
an object larger than the caller expects before reading a byte of it.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    OversizedObjectError,
    StorageError,
    StorageFullError,
    UnsafeObjectError,
)
from casckpt.localfs import fsync_dir
from casckpt.storage.base import BlobInfo, check_object_name, is_object_name
from casckpt.storage.registry import Backend, Capabilities, directory_of
from casckpt.storage.scratch import DEFAULT_GRACE, Reclaimed, ScratchDir, reclaim

_IOV_MAX = 1024
_COPY_BLOCK = 8 << 20
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _preadv_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """preadv until every buffer is full or the file ends (reads may come back short)."""
    total, first = 0, 0
    while first < len(buffers):
        n = os.preadv(fd, buffers[first : first + _IOV_MAX], offset)
        if n == 0:
            break
        total += n
        offset += n
        while first < len(buffers) and n >= len(buffers[first]):
            n -= len(buffers[first])
            first += 1
        if n:
            buffers[first] = buffers[first][n:]
    return total


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    parts = []
    while length > 0:
        part = os.pread(fd, length, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (the seam where tests inject a full disk)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


_MAKE_ROOM = "add a location (`casckpt location add`)"


def full_error(exc: OSError, what: str, where: str, needed: int | None,
               elsewhere: str = _MAKE_ROOM) -> StorageError:
    """The error for a failed write of ``what`` (``needed`` bytes) in ``where``:
    StorageFullError for a full disk, quota or file-size limit, else StorageError. The
    message says what to do: free space, raise the limit, or ``elsewhere``."""
    if exc.errno in FULL_ERRNOS:
        size = f" ({needed} bytes)" if needed is not None else ""
        return StorageFullError(
            f"no room to write {what}{size} in {where}: {exc.strerror or exc}. Nothing was "
            f"left half-written; free space there, raise the quota or file-size limit "
            f"(ulimit -f), or {elsewhere}", location=where, needed=needed)
    return StorageError(f"cannot write {what} in {where}: {exc}")


def _gone(root: Path) -> str:
    return (f"the location directory {root} is gone (a disk removed or unmounted?); it is not "
            "made again. Restore it, or mark the location failed (`casckpt location fail`) and "
            "run `casckpt repair`")


class LocalBlobStore:
    """Objects as files under ``root``. Thread-safe.

    Holds a scratch directory (and its lock file) from the first write until
    :meth:`close`.
    """

    def __init__(self, root: Path | str, *, create: bool = True) -> None:
        """``create``: make ``root`` (and its parents) if it does not exist. Pass False for a
        location the store already knows: a directory that vanished (an unmounted disk) is then
        reported, not silently made again on whatever file system is underneath.

        Raises:
            StorageError: ``create`` is False and ``root`` is not a directory.
        """
        self.root = Path(root).resolve()
        self._root_text = str(self.root)
        self.url = self.root.as_uri()
        self._tmp = self.root / "tmp"
        if not create and not self.root.is_dir():
            raise StorageError(_gone(self.root))
        self._tmp.mkdir(parents=create, exist_ok=True)
        self._scratch = ScratchDir(self._tmp, parents=False)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_object_name(key)

    # -- writes ---------------------------------------------------------------

    @contextmanager
    def _temp(self, what: str, needed: int | None) -> Iterator[Path]:
        """A new temporary file's path in the scratch directory, removed unless it was
        renamed away; OS errors become StorageFullError / StorageError."""
        tmp: Path | None = None
        try:
            tmp = self._scratch.path() / f"{uuid.uuid4().hex}.part"
            yield tmp
        except StorageError:
            raise
        except OSError as exc:
            raise self._write_failed(exc, what, needed) from exc
        finally:
            if tmp is not None:
                with suppress(OSError):  # renamed away, or the error above says why
                    tmp.unlink(missing_ok=True)

    def _write_failed(self, exc: OSError, what: str, needed: int | None) -> StorageError:
        """The typed error for a write of ``what`` that failed with ``exc``."""
        if isinstance(exc, FileNotFoundError) and not self.root.is_dir():
            return StorageError(f"cannot write {what}: {_gone(self.root)}")
        return full_error(exc, what, str(self.root), needed)

    def _place(self, tmp: Path, key: str) -> None:
        target = self._path(key)
        folder = self.root
        for part in key.split("/")[:-1]:  # never the root itself: see _temp
            folder = folder / part
            folder.mkdir(exist_ok=True)
            if folder.is_symlink() and self.root not in Path(os.path.realpath(folder)).parents:
                raise UnsafeObjectError(
                    f"cannot write {key}: {folder} is a symlink leading out of the location "
                    f"{self.root}; nothing was written through it. Remove the symlink")
        os.replace(tmp, target)
        fsync_dir(target.parent)

    def put(self, key: str, data: bytes | memoryview) -> None:
        check_object_name(key)
        with self._temp(key, len(data)) as tmp:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._place(tmp, key)

    def put_file(self, key: str, path: Path) -> None:
        """Rename ``path`` into place (consuming it); across file systems, copy it through
        a temporary file first, so no half-copied object is ever visible."""
        check_object_name(key)
        path = Path(path)
        try:
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise full_error(exc, f"{key} (from {path})", str(self.root), None) from exc
        try:
            self._place(path, key)
            return
        except StorageError:
            raise
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise self._write_failed(exc, key, size) from exc
        with self._temp(key, size) as tmp:
            _copy_file(path, tmp)
            self._place(tmp, key)
        with suppress(OSError):  # the object is in place; the caller may remove the source
            path.unlink(missing_ok=True)

    # -- reads ----------------------------------------------------------------

    def _safe_stat(self, key: str, path: Path | None = None) -> tuple[Path, os.stat_result]:
        """The real path and lstat of the regular file holding ``key`` (at ``path``, when the
        caller has it), never opening it.

        Raises:
            BlobNotFoundError: nothing is there.
            UnsafeObjectError: it is not a regular file inside the root.
        """
        if path is None:
            try:
                st = self._plain_file(key)
            except FileNotFoundError:
                raise BlobNotFoundError(f"{key} is missing from {self.root}") from None
            except OSError:
                st = None  # a component is no directory, or unreadable: resolved below
            if st is not None:
                return self._path(key), st
        path = self._path(key) if path is None else path
        real = Path(os.path.realpath(path))
        if real != path and self.root not in real.parents:
            raise UnsafeObjectError(
                f"{key} under {self.root} is a symlink to {real}, outside the location; it was "
                "not read. Remove it and run `casckpt check` (`casckpt repair` rewrites it "
                "where the pack has redundancy)")
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{key} is missing from {self.root}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeObjectError(
                f"{key} under {self.root} is not a regular file ({_kind(st.st_mode)}); it was not "
                "opened. Remove it and run `casckpt check` (`casckpt repair` rewrites it where "
                "the pack has redundancy)")
        return real, st

    def _plain_file(self, key: str) -> os.stat_result | None:
        """The lstat of ``key``'s file when it and every directory between it and the root are
        what they seem (a regular file, real directories: no symlink), so it lies inside the
        root as named; None when something needs resolving. One lstat per level, on strings:
        ``realpath``'s walk from ``/`` cost a restore 70 us per read.

        Raises:
            FileNotFoundError: nothing is there.
        """
        where = self._root_text
        for part in check_object_name(key).split("/")[:-1]:
            where = f"{where}/{part}"
            if not stat.S_ISDIR(os.lstat(where).st_mode):
                return None
        st = os.lstat(f"{self._root_text}/{key}")
        return st if stat.S_ISREG(st.st_mode) else None

    @contextmanager
    def _reading(self, key: str) -> Iterator[tuple[int, int]]:
        """An open descriptor of ``key`` and its size; OS errors become BlobNotFoundError /
        StorageError. Only a regular file inside the root is ever opened."""
        try:
            real, st = self._safe_stat(key)
            fd = os.open(real, _READ_FLAGS)
        except StorageError:
            raise
        except FileNotFoundError:
            raise BlobNotFoundError(f"{key} is missing from {self.root}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # swapped for a symlink since the check
                raise UnsafeObjectError(f"{key} under {self.root} became a symlink while "
                                        "being opened; it was not read") from exc
            raise StorageError(f"cannot read {key} under {self.root}: {exc}") from exc
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
                raise UnsafeObjectError(f"{key} under {self.root} was replaced while being "
                                        "opened; it was not read")
            yield fd, now.st_size
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise StorageError(f"cannot read {key} under {self.root}: {exc}") from exc
        finally:
            os.close(fd)

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        with self._reading(key) as (fd, size):
            if max_size is not None and size > max_size:
                raise OversizedObjectError(
                    f"{key} under {self.root} is {size} bytes, more than the {max_size} expected; "
                    "it was not read. Run `casckpt check` (it is damaged or not casckpt's)")
            return _pread_all(fd, 0, size)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._reading(key) as (fd, _size):
            return _pread_all(fd, offset, length)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        with self._reading(key) as (fd, _size):
            return _preadv_all(fd, list(buffers), offset)

    def size(self, key: str) -> int | None:
        try:
            return self._safe_stat(key)[1].st_size
        except BlobNotFoundError:
            return None
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot stat {key} under {self.root}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Yield the regular files under ``prefix`` whose names are keys; anything else (a
        FIFO, a device, a symlink leaving the root, a file removed meanwhile, a name no key
        has) is skipped, never opened. A directory that cannot be read raises StorageError."""
        top = prefix.split("/", 1)[0]
        base = self.root / top if top else self.root

        def fail(exc: OSError) -> None:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # nothing (or no directory) there
                raise StorageError(f"cannot list {prefix!r} under {self.root}: {exc}") from exc

        for dirpath, dirnames, filenames in os.walk(base, onerror=fail):
            dirnames[:] = sorted(d for d in dirnames if d != "tmp" or dirpath != str(self.root))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix) or key.startswith("tmp/") or not is_object_name(key):
                    continue
                try:
                    st = os.lstat(path)  # the walk follows no symlink: dirpath is inside the root
                    if stat.S_ISLNK(st.st_mode):
                        _real, st = self._safe_stat(key, path)
                except OSError:  # not a regular file inside the root, or removed meanwhile
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield BlobInfo(key, st.st_size, st.st_mtime)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except PermissionError as exc:
            right = f"write access to {self._path(key).parent}"
            raise AccessDeniedError(f"cannot delete {key} under {self.root}: {exc}; deleting needs "
                                    f"{right} (the admin role)", right=right) from exc
        except OSError as exc:
            raise StorageError(f"cannot delete {key} under {self.root}: {exc}") from exc

    # -- lifecycle --------------------------------------------------------------

    def reclaim_temp(self, grace: float = DEFAULT_GRACE) -> Reclaimed:
        """Remove the temporary files of writers that are gone (see :func:`.scratch.reclaim`);
        never a live writer's. Never raises."""
        return reclaim(self._tmp, grace=grace)

    def close(self) -> None:
        """Remove this store's scratch directory. Idempotent."""
        self._scratch.close()


def _copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to the new file ``target`` and fsync it."""
    with open(source, "rb") as src:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            while block := src.read(_COPY_BLOCK):
                _write_all(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def _open(url: str, options: Mapping[str, Any], create: bool) -> LocalBlobStore:
    return LocalBlobStore(directory_of(url), create=create)


BACKEND = Backend(
    scheme="file", example="file:///dir", open=_open,
    capabilities=Capabilities(local_directory=True, delete_probe=False),
)
"""``file:///dir`` locations (a directory given as a path is one too); no options, no roles
to print (the directory's permissions are the roles)."""
