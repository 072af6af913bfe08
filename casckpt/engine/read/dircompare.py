"""Comparing a directory on disk with a directory snapshot version (``Store.checkout(reuse=True)``).

A restarted job finds the checkpoint directory it would check out already on local disk,
left by the run that saved it. It may be reused only if it is exactly the version: the same
names, kinds, permission bits (those ``checkout`` applies) and link targets, and every file's
bytes hashing to the whole-file BLAKE3 ``add_dir`` recorded (keyed in an encrypted store, as
recorded). Nothing is trusted from timestamps or sizes alone, and nothing is written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from casckpt.engine.context import EngineContext
from casckpt.engine.read.checkout import APPLIED_MODE, listing
from casckpt.format.dirsnap import DirEntry
from casckpt.format.manifest import Manifest

READ_BYTES = 8 << 20
"""Bytes read from a local file at a time while it is hashed (memory stays bounded)."""

_KINDS = {"dir": stat.S_ISDIR, "file": stat.S_ISREG, "link": stat.S_ISLNK}


def first_difference(ctx: EngineContext, manifest: Manifest, root: Path) -> str | None:
    """How the directory ``root`` differs from the snapshot ``manifest`` holds: the first
    difference found, in words, or None when it holds exactly the snapshot.

    Entries are compared parents first (a link where the snapshot has a directory is found
    before anything below it is read); files are hashed last, so a cheap difference is
    found without reading gigabytes.

    Raises:
        NotADirectorySnapshotError, CorruptManifestError: as :func:`casckpt.engine.read.checkout.listing`.
    """
    entries = listing(manifest)
    files: list[tuple[DirEntry, Path]] = []
    for entry in entries:
        where = root / entry.path
        try:
            info = where.lstat()
        except FileNotFoundError:
            return f"{entry.path!r} is missing"
        if not _KINDS[entry.kind](info.st_mode):
            return f"{entry.path!r} is not a {entry.kind}"
        if entry.kind == "link":
            if os.readlink(where) != entry.target:
                return f"link {entry.path!r} points elsewhere"
            continue
        if stat.S_IMODE(info.st_mode) & APPLIED_MODE != entry.mode & APPLIED_MODE:
            return f"{entry.path!r} has mode {stat.S_IMODE(info.st_mode):o}, not {entry.mode:o}"
        if entry.kind == "file":
            if info.st_size != entry.size:
                return f"{entry.path!r} holds {info.st_size} bytes, not {entry.size}"
            files.append((entry, where))
    extra = _extra(root, {entry.path for entry in entries})
    if extra is not None:
        return f"{extra!r} is not in the snapshot"
    for entry, where in files:
        if _digest(ctx, where, entry.size) != entry.blake3:
            return f"the bytes of {entry.path!r} differ"
    return None


def _extra(root: Path, listed: set[str]) -> str | None:
    """A name under ``root`` the snapshot does not list (links are not followed)."""
    for folder, dirs, names in os.walk(root):
        for name in (*dirs, *names):
            rel = os.path.relpath(os.path.join(folder, name), root)
            if rel not in listed:
                return rel
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
    return None


def _digest(ctx: EngineContext, where: Path, size: int) -> str | None:
    """The snapshot digest of the regular file ``where`` (None: it is no longer one)."""
    hasher = ctx.crypto.file_hasher(size)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        while block := os.read(fd, READ_BYTES):
            hasher.update(block)
    finally:
        os.close(fd)
    digest: str = hasher.hexdigest()
    return digest
