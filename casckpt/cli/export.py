"""Export a restored version to one safetensors file (``casckpt restore --to FILE``).

The file layout is :mod:`casckpt.engine.exporters`'; this module adds the check of the
target the command line names, made before any data is read.
"""

from __future__ import annotations

from pathlib import Path

from casckpt.engine.exporters import MAX_INLINE_VALUES as MAX_INLINE_VALUES
from casckpt.engine.exporters import ExportResult as ExportResult
from casckpt.engine.exporters import export_safetensors as export_safetensors
from casckpt.engine.exporters import sidecar_path as sidecar_path
from casckpt.engine.exporters import split_tree as split_tree
from casckpt.errors import RestoreTargetError


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse a target that cannot or should not be written, before any data is read.

    Raises:
        RestoreTargetError: the directory is missing, the target is a directory,
            or it exists and ``overwrite`` is false.
    """
    if not target.parent.is_dir():
        raise RestoreTargetError(
            f"directory {str(target.parent)!r} does not exist; create it first"
        )
    if target.is_dir():
        raise RestoreTargetError(f"{str(target)!r} is a directory; name a .safetensors file")
    if target.exists() and not overwrite:
        raise RestoreTargetError(f"{str(target)!r} exists; pass --force to overwrite it")
