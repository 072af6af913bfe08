"""Files on the local disk written whole or not at all: the one way casckpt replaces a file
a user or a tool reads (exported checkpoints and their sidecars, a store's config file,
DeepSpeed's ``latest`` and marker files, the HTML report).

Objects of a local location are written by :class:`casckpt.storage.local.LocalBlobStore`,
whose protocol (staging folder, free-space checks) is its own; both make renames durable
with :func:`fsync_dir`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(target: Path) -> Path:
    """A fresh name for a temporary file beside ``target`` (hidden, unique to this call)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def replace_atomically(target: Path, write: Callable[[Path], object], *, durable: bool = False) -> None:
    """Write ``target`` through a temporary file beside it, renamed over it when whole.

    ``write`` fills the temporary path it is given. Readers see the old file or the new one,
    never a part; a failed write leaves no temporary behind. The temporary is created here,
    exclusively and without following links (a link planted at its name is never written
    through), so the file gets the mode a new file gets from the umask (0666 & ~umask)
    whatever mode ``write`` creates files with (safetensors creates them 0600). ``durable``:
    the file and the rename are on disk when this returns (fsync of both).

    Raises:
        OSError: as the disk reports it; callers raise their typed error from it.
    """
    tmp = temporary_beside(target)
    created = False
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        created = True
        mode = tmp.stat().st_mode & 0o777
        write(tmp)
        tmp.chmod(mode)
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, target)
        created = False
        if durable:
            fsync_dir(target.parent)
    finally:
        if created:
            tmp.unlink(missing_ok=True)


def replace_bytes(target: Path, data: bytes, *, durable: bool = False) -> None:
    """:func:`replace_atomically` with ``data`` as the file's whole content."""
    replace_atomically(target, lambda tmp: tmp.write_bytes(data), durable=durable)
