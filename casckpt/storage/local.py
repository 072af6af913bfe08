"""A blob store in a local directory.

Writes go to a temporary file in ``<root>/tmp``, are fsync'd, renamed into
place and the directory fsync'd, so an object is either wholly present or
absent after a crash. Leftover temporary files only cost space.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from casckpt.errors import BlobNotFoundError, StorageError
from casckpt.storage.base import BlobInfo, check_key

_IOV_MAX = 1024


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


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlobStore:
    """Objects as files under ``root``. Thread-safe (no shared mutable state)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _place(self, tmp: Path, key: str) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(tmp, target)
            with open(target, "rb+") as f:
                os.fsync(f.fileno())
            tmp.unlink()
        fsync_dir(target.parent)

    def put(self, key: str, data: bytes | memoryview) -> None:
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._place(tmp, key)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write {key} under {self.root}: {exc}") from exc

    def put_file(self, key: str, path: Path) -> None:
        try:
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            self._place(Path(path), key)
        except OSError as exc:
            raise StorageError(f"cannot store {key} under {self.root}: {exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFoundError(f"{key} is missing from {self.root}") from None
        except OSError as exc:
            raise StorageError(f"cannot read {key} under {self.root}: {exc}") from exc

    @contextmanager
    def _reading(self, key: str) -> Iterator[int]:
        """An open descriptor of ``key``; OS errors become BlobNotFoundError / StorageError."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{key} is missing from {self.root}") from None
        except OSError as exc:
            raise StorageError(f"cannot read {key} under {self.root}: {exc}") from exc
        try:
            yield fd
        except OSError as exc:
            raise StorageError(f"cannot read {key} under {self.root}: {exc}") from exc
        finally:
            os.close(fd)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._reading(key) as fd:
            parts = []
            while length > 0:
                part = os.pread(fd, length, offset)
                if not part:
                    break
                parts.append(part)
                offset += len(part)
                length -= len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        with self._reading(key) as fd:
            return _preadv_all(fd, list(buffers), offset)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot stat {key} under {self.root}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        top = prefix.split("/", 1)[0]
        base = self.root / top if top else self.root
        try:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if d != "tmp" or dirpath != str(self.root))
                for name in sorted(filenames):
                    full = Path(dirpath) / name
                    key = full.relative_to(self.root).as_posix()
                    if key.startswith(prefix) and not key.startswith("tmp/"):
                        st = full.stat()
                        yield BlobInfo(key, st.st_size, st.st_mtime)
        except OSError as exc:
            raise StorageError(f"cannot list {prefix!r} under {self.root}: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete {key} under {self.root}: {exc}") from exc

    def close(self) -> None:
        return None
