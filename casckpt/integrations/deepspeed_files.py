"""The files :mod:`casckpt.integrations.deepspeed` writes into DeepSpeed's checkpoint folder.

DeepSpeed keeps a tag's files in ``DIR/TAG/FILE`` and the last tag in ``DIR/latest``; the
integration writes a *marker* (JSON naming the version, no data) at each file's path. Names
come from DeepSpeed (``save``) or from a version's metadata (``deepspeed.tag``,
``deepspeed.files``, which any writer of the store could set): both pass one rule, a plain
name that stays in its folder, before anything is written, and a marker never replaces a file
that is not a marker (DeepSpeed's own ``.pt`` files).

Imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from casckpt.errors import CorruptManifestError, InvalidArgumentError
from casckpt.format.state import key_ok
from casckpt.localfs import replace_bytes
from casckpt.types import Version

MARKER_FORMAT = "casckpt.deepspeed-marker/1"
"""The ``format`` of a marker file: JSON naming the version that holds the file."""


def check_tag(tag: str) -> str:
    """``tag``, when it is a plain folder name (DeepSpeed keeps a tag's files in ``DIR/TAG``).

    Raises:
        InvalidArgumentError: a path separator in it, or empty, ``.`` or ``..``.
    """
    if not plain_name(tag):
        raise InvalidArgumentError(
            f"DeepSpeed tag {tag!r} is not a plain folder name (no '/', not '.' or '..'): a load "
            "of it would find another tag's files; pick a tag without a path separator")
    return tag


def stored_tag(version: Version) -> str:
    """The DeepSpeed tag ``version`` records, checked to be a plain folder name.

    Raises:
        CorruptManifestError: it is not a string or not a plain name (written by something
            other than this engine).
    """
    tag = version.metadata.get("deepspeed.tag")
    if not isinstance(tag, str) or not plain_name(tag):
        raise CorruptManifestError(
            f"{version.run}@{version.step} records DeepSpeed tag {tag!r}, which is not a plain "
            "folder name; this engine never saves one: the version was written by something else")
    return tag


def stored_files(version: Version) -> dict[str, int]:
    """``{file name: rank}`` of ``version``, each name checked as :meth:`save` checks it.

    Raises:
        CorruptManifestError: a name that is not a plain file name (absolute, ``..``, a
            separator) or a rank that is not an int: files are written only inside ``DIR/TAG``.
    """
    files = version.metadata.get("deepspeed.files", {})
    if not isinstance(files, Mapping) or not all(
            isinstance(n, str) and plain_name(n) and type(r) is int for n, r in files.items()):
        raise CorruptManifestError(
            f"{version.run}@{version.step} records DeepSpeed files {files!r}: each must be a "
            "plain file name held by a rank; this engine never saves others, so the version was "
            "written by something else and nothing of it is written to disk")
    return dict(files)


def refuse_foreign_file(path: Path) -> None:
    """Refuse to replace ``path`` when it exists and is not a marker (by its content).

    Raises:
        InvalidArgumentError: it holds something else (DeepSpeed's own checkpoint file).
    """
    if path.exists() and not _is_marker(path):
        raise InvalidArgumentError(
            f"{path} is not a casckpt marker: {path.parent.parent} holds DeepSpeed's own "
            "checkpoint files, which casckpt does not overwrite. Load them with DeepSpeed's "
            "engine (or commit them with Store.import_checkpoint), or use another directory "
            "for the casckpt checkpoints")


def _is_marker(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4097)
        marker = json.loads(head) if len(head) <= 4096 else None
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT


def plain_name(name: str) -> bool:
    """A name that stays in its folder: no separator, not empty, ``.`` or ``..``."""
    return key_ok(name) and os.sep not in name and not name.startswith("..") and (
        os.altsep is None or os.altsep not in name)


def write_marker(path: Path, version: Version, name: str) -> None:
    """Write the marker of file ``name`` of ``version`` at ``path`` (atomically).

    Raises:
        InvalidArgumentError: ``path`` holds a file that is not a marker (see
            :func:`refuse_foreign_file`).
    """
    refuse_foreign_file(path)
    marker = {"format": MARKER_FORMAT, "ref": f"casckpt://{version.run}@{version.step}",
              "version": version.id, "file": name, "tag": version.metadata.get("deepspeed.tag")}
    write_atomically(path, (json.dumps(marker, indent=1) + "\n").encode())


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole (its folder made where missing): DeepSpeed's ``latest``
    and the marker files, read by other ranks and processes while this one writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_bytes(path, data)
