"""Reading a directory into a directory-snapshot state (see :mod:`casckpt.format.dirsnap`).

Nothing here writes. Every regular file's bytes reach the state as numpy arrays over a
read-only memory map of the file (or, for small files, over the bytes read), so a blocking
commit of a 10 GiB directory holds page cache, not 10 GiB of copies. The arrays keep their
maps open until the state is dropped: the files must not change until the commit returns
(a background commit: until it has snapshotted), or the version holds bytes that do not hash
to the recorded whole-file BLAKE3 and ``checkout`` refuses them.
"""

from __future__ import annotations

import mmap
import os
import resource
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from casckpt.engine.transfer.dcpitems import dcp_items
from casckpt.errors import InvalidArgumentError, UnsupportedFileError
from casckpt.format.crypto import PLAIN
from casckpt.format.dirsnap import DIR_FORMAT, DIR_KEY, MAX_DEPTH, summary
from casckpt.format.segments import Segment, plan_segments
from casckpt.types import ProgressCallback

READ_WHOLE = 64 << 10
"""Files of at most this many bytes are read into memory; larger ones are memory-mapped (one
open descriptor each, for as long as the state lives)."""
_SPARE_DESCRIPTORS = 256


@dataclass(slots=True)
class _Scan:
    root: Path
    progress: ProgressCallback | None
    hasher: Callable[[int], Any]
    entries: list[dict[str, Any]] = field(default_factory=list)
    mapped: int = 0
    done: int = 0


def scan(root: str | os.PathLike[str], progress: ProgressCallback | None = None,
         hasher: Callable[[int], Any] | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """The snapshot state of the directory ``root`` and its summary (files, dirs, links, bytes).

    ``hasher(size)``: a new BLAKE3 hasher for a file of ``size`` bytes (the store's
    :meth:`~casckpt.format.crypto.StoreCrypto.file_hasher`: keyed in an encrypted store);
    plain BLAKE3 when None.

    ``progress("scan", bytes_done, 0)`` is called after each file is hashed (the total is not
    known before the walk ends).

    Raises:
        InvalidArgumentError: ``root`` is not a directory.
        UnsupportedFileError: the tree holds something that is not a regular file, directory
            or symbolic link (a fifo, socket, device), a name that is not valid UTF-8, or an
            entry that cannot be read (or changed while read); the message names it. Nothing
            was written.
    """
    top = Path(root)
    if not top.is_dir():
        raise InvalidArgumentError(f"{str(top)!r} is not a directory; add_dir stores a directory "
                                   "tree (for one checkpoint file, pass its folder)")
    state = _Scan(top, progress, hasher or PLAIN.file_hasher)
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _walk(state, top, "", fd)
        finally:
            os.close(fd)
    except OSError as exc:  # unreadable, or changed under the walk (removed, replaced by a link)
        raise UnsupportedFileError(
            f"could not read {exc.filename or str(top)!r}: {exc.strerror or exc}; make the directory "
            "readable and keep it still while add_dir reads it. Nothing was stored."
        ) from exc
    return {DIR_KEY: DIR_FORMAT, "files": state.entries}, summary(state.entries)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _walk(state: _Scan, folder: Path, prefix: str, fd: int) -> None:
    """Entries under the open directory ``fd`` (named ``folder``): everything below is opened
    relative to it, never by a path whose directories could be swapped for links meanwhile."""
    with os.scandir(fd) as listing:
        children = sorted(listing, key=lambda e: e.name)
    if children and prefix.count("/") >= MAX_DEPTH:
        raise UnsupportedFileError(
            f"{str(folder)!r} is nested {MAX_DEPTH} directories deep and holds more; a snapshot keeps "
            f"at most {MAX_DEPTH} levels: add a shallower directory. Nothing was stored.")
    names = {child.name for child in children}
    items: dict[str, list[tuple[int, int]]] = {}
    metadata = next((c for c in children if c.name == ".metadata"), None)
    if metadata is not None and metadata.is_file(follow_symlinks=False) \
            and any(n.endswith(".distcp") for n in names):  # a DCP checkpoint (never a link out)
        items = dcp_items(folder / ".metadata")
    for child in children:
        name = _name(folder / child.name, child.name)
        rel = f"{prefix}{name}"
        info = child.stat(follow_symlinks=False)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISLNK(info.st_mode):
            target = _name(folder / child.name, os.readlink(child.name, dir_fd=fd))
            state.entries.append(_entry(rel, "link", 0, target=target))
        elif stat.S_ISDIR(info.st_mode):
            state.entries.append(_entry(rel, "dir", mode))
            sub = _open_at(folder / child.name, _DIR_FLAGS, fd)  # a link put there since: ELOOP
            try:
                now = os.fstat(sub)
                if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                    raise UnsupportedFileError(f"{str(folder / child.name)!r} was replaced while "
                                               "add_dir read it; keep the directory still. "
                                               "Nothing was stored.")
                _walk(state, folder / child.name, rel + "/", sub)
            finally:
                os.close(sub)
        elif stat.S_ISREG(info.st_mode):
            state.entries.append(_file(state, folder / child.name, rel, mode, items.get(child.name), fd))
        else:
            raise UnsupportedFileError(
                f"{str(folder / child.name)!r} is {_what(info.st_mode)}, not a regular file, directory "
                "or symbolic link; move it out of the directory (add_dir stores only those). "
                "Nothing was stored."
            )


def _open_at(path: Path, flags: int, dir_fd: int) -> int:
    """``path``'s last part opened relative to ``dir_fd``; an error names the whole path."""
    try:
        return os.open(path.name, flags, dir_fd=dir_fd)
    except OSError as exc:
        exc.filename = str(path)
        raise


def _entry(path: str, kind: str, mode: int, *, size: int = 0, digest: str | None = None,
           target: str | None = None, parts: list[np.ndarray] | None = None) -> dict[str, Any]:
    return {"path": path, "kind": kind, "mode": mode, "size": size, "blake3": digest,
            "target": target, "parts": parts or []}


def _file(state: _Scan, path: Path, rel: str, mode: int,
          items: list[tuple[int, int]] | None, dir_fd: int) -> dict[str, Any]:
    fd = _open_at(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # replaced since the listing
            raise UnsupportedFileError(f"{str(path)!r} is no longer a regular file; nothing was stored")
        size = info.st_size
        buffer: bytes | mmap.mmap
        if size <= READ_WHOLE:
            with os.fdopen(os.dup(fd), "rb") as f:
                buffer = f.read(size)  # what it held when measured, even if it grows
        else:
            _count_map(state, path)
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    view = memoryview(buffer)
    hasher = state.hasher(len(view))
    hasher.update(view)
    state.done += len(view)
    if state.progress is not None:
        state.progress("scan", state.done, 0)
    parts = [_array(buffer, s) for s in plan_segments(path.name, view, items)]
    view.release()
    return _entry(rel, "file", mode, size=len(buffer), digest=hasher.hexdigest(), parts=parts)


def _array(buffer: bytes | mmap.mmap, segment: Segment) -> np.ndarray:
    dtype = np.dtype(segment.dtype)
    count = (segment.end - segment.start) // dtype.itemsize
    flat = np.frombuffer(buffer, dtype=dtype, count=count, offset=segment.start)
    return flat.reshape(segment.shape) if segment.shape is not None else flat


def _count_map(state: _Scan, path: Path) -> None:
    """Refuse, with what to do, before a map would exhaust the process's descriptors."""
    state.mapped += 1
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and state.mapped > soft - _SPARE_DESCRIPTORS:
        raise UnsupportedFileError(
            f"{str(state.root)!r} holds more files over {READ_WHOLE} bytes than this process may "
            f"keep open (the limit is {soft}; reached at {str(path)!r}); raise it (`ulimit -n`) "
            "or add the directory in parts. Nothing was stored."
        )


def _name(path: Path, text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedFileError(
            f"{str(path)!r}: {text!r} is not valid UTF-8; rename it (snapshot names are stored "
            "as UTF-8 text). Nothing was stored."
        ) from None
    return text


def _what(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((what for test, what in kinds if test(mode)), "a special file")
