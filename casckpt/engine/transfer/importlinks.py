"""Which files an import of a directory may read: its own, never one a link leads out to.

A checkpoint directory from elsewhere (a git clone, an archive) may hold symbolic links;
following ``tokenizer.json -> ../../.aws/credentials`` would copy a secret into the store
and into every export. A file is read only if its real path lies inside the directory's
real path, or, for a Hugging Face hub cache snapshot (``<repo>/snapshots/<rev>/x`` links
to ``../../blobs/<hash>``), inside that repository's ``blobs/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from casckpt.errors import UnreadableCheckpointError


def allowed_roots(root: Path) -> tuple[Path, ...]:
    """The real directories an import of ``root`` may read files from."""
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots":  # the Hugging Face hub cache layout
        return real, real.parent.parent / "blobs"
    return (real,)


def check_inside(file: Path, root: Path) -> None:
    """Refuse ``file`` (a path inside ``root``) when a link leads it out of ``root``.

    Raises:
        UnreadableCheckpointError: the file's real path is outside every allowed root.
    """
    real = Path(os.path.realpath(file))
    if not any(real.is_relative_to(r) for r in allowed_roots(root)):
        raise UnreadableCheckpointError(
            f"{str(file)!r} is a link to {str(real)!r}, outside the imported directory "
            f"{str(root)!r}; an import never reads files a link leads out to. If you mean to "
            "import that file, copy it into the directory", path=str(file))
