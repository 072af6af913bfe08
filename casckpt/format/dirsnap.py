"""Directory snapshots as states: the listing's shape and its validation (no I/O).

A directory snapshot is an ordinary state::

    {"casckpt.dir": 1, "files": [entry, ...]}

with one entry per directory, file and symbolic link, parents before children::

    {"path": "a/b.safetensors", "kind": "file" | "dir" | "link", "mode": 0o644,
     "size": 123, "blake3": "<hex of the whole file>" | None, "target": None | "link text",
     "parts": [segment, ...]}

``parts`` are the file's bytes in order, each a tensor leaf (a numpy array over the file),
cut by :mod:`casckpt.format.segments`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from casckpt.errors import CorruptManifestError

DIR_KEY = "casckpt.dir"
"""The reserved top-level key that marks a state (and a version's metadata) as a directory
snapshot; its value is the snapshot format (:data:`DIR_FORMAT`) in the state, a summary in the
metadata."""
DIR_FORMAT = 1
KINDS = ("dir", "file", "link")
MAX_PATH_BYTES = 4096
MAX_DEPTH = 256
"""Most ``/`` a snapshot name may hold: deeper trees hit Python's recursion limit in the walk
and in the removal of a failed checkout (which then masked the error and left the temporary
directory), so ``add_dir`` refuses them and a listing naming one is refused whole."""
_HEX = re.compile(r"[0-9a-f]{64}")


# -- reading a listing back -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One validated entry of a directory snapshot; ``parts`` are the caller's tensor handles."""

    path: str
    kind: str
    mode: int
    size: int
    blake3: str | None
    target: str | None
    parts: tuple[Any, ...]


def is_snapshot(state: object) -> bool:
    """Whether a decoded state is a directory snapshot (it has the reserved key)."""
    return isinstance(state, dict) and DIR_KEY in state


def read_listing(state: object, part_size: Callable[[Any], int]) -> list[DirEntry]:
    """Validate a decoded snapshot state (parts replaced by handles ``part_size`` measures; it
    returns a negative size for anything that is not a part) and return its entries, parents
    before children.

    Every name is relative, normalised (no ``.``, ``..``, empty parts, NUL) and unique; every
    entry's parent is a directory of the snapshot (so nothing is written through a symbolic
    link); a file's parts add up to its size. A listing that breaks any of this was not written
    by ``add_dir`` (forged or damaged) and is refused whole.

    Raises:
        CorruptManifestError: the listing is malformed or names an unsafe path.
    """
    if not isinstance(state, dict) or state.get(DIR_KEY) != DIR_FORMAT or set(state) != {DIR_KEY, "files"}:
        raise CorruptManifestError(f"not a directory snapshot of format {DIR_FORMAT}; "
                                   "a newer casckpt may read it")
    files = state["files"]
    if not isinstance(files, list):
        raise CorruptManifestError("directory snapshot: 'files' is not a list")
    kinds: dict[str, str] = {}
    out = []
    for raw in files:
        entry = _entry(raw, part_size)
        parent = entry.path.rpartition("/")[0]
        if entry.path in kinds:
            raise CorruptManifestError(f"directory snapshot lists {entry.path!r} twice; refused")
        if parent and kinds.get(parent) != "dir":
            raise CorruptManifestError(
                f"directory snapshot lists {entry.path!r} before (or without) its parent directory, "
                "or under a file or link; refused (nothing is written through a link)")
        kinds[entry.path] = entry.kind
        out.append(entry)
    return out


def _entry(raw: object, part_size: Callable[[Any], int]) -> DirEntry:
    keys = {"path", "kind", "mode", "size", "blake3", "target", "parts"}
    if not isinstance(raw, dict) or set(raw) != keys:
        raise CorruptManifestError("directory snapshot entry is malformed")
    path, kind, mode, size = raw["path"], raw["kind"], raw["mode"], raw["size"]
    digest, target, parts = raw["blake3"], raw["target"], raw["parts"]
    check_path(path)
    sizes = [part_size(p) for p in parts] if isinstance(parts, list) else [-1]
    bad = (
        kind not in KINDS or type(mode) is not int or not 0 <= mode <= 0o7777
        or type(size) is not int or size < 0 or not isinstance(parts, list)
        or (kind == "file") != (isinstance(digest, str) and _HEX.fullmatch(digest) is not None)
        or (kind == "link") != (isinstance(target, str) and 0 < len(target) and "\0" not in target)
        or (kind != "file" and (parts or size or digest is not None))
        or any(n < 0 for n in sizes) or (kind == "file" and sum(sizes) != size)
    )
    if bad:
        raise CorruptManifestError(f"directory snapshot entry {path!r} is malformed; refused")
    return DirEntry(path, kind, mode, size, digest, target, tuple(parts))


def check_path(path: object) -> str:
    """``path`` if it is a safe relative name (``a/b``); else CorruptManifestError."""
    if (not isinstance(path, str) or not path or "\0" in path or path.startswith("/")
            or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES
            or path.count("/") >= MAX_DEPTH
            or any(part in ("", ".", "..") for part in path.split("/"))):
        raise CorruptManifestError(
            f"directory snapshot names {path!r}, which is not a plain relative path; refused "
            "(a snapshot never writes outside its target)")
    return path


def summary(entries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """``{"files", "dirs", "links", "bytes"}`` of a listing: what a version's metadata records."""
    counts = {"files": 0, "dirs": 0, "links": 0, "bytes": 0}
    for entry in entries:
        counts[{"file": "files", "dir": "dirs", "link": "links"}[entry["kind"]]] += 1
        counts["bytes"] += int(entry["size"])
    return counts
