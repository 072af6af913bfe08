"""casckpt: a content-addressed, incremental checkpoint store for PyTorch training.

Typical use::

    import casckpt

    with casckpt.open("ckpts/") as store:
        store.commit({"model": model.state_dict(), "optim": opt.state_dict()},
                     run="my-run", step=step, metrics={"loss": loss})
        ...
        store.restore("my-run@latest", into={"model": model, "optim": opt})
"""

from __future__ import annotations

import os

from casckpt import errors
from casckpt.errors import CasckptError
from casckpt.storage import BlobStore
from casckpt.store import Store, open_store
from casckpt.types import (
    CheckProblem,
    CheckReport,
    RunInfo,
    StoreStats,
    TensorInfo,
    Version,
    VersionDetail,
)

__version__ = "0.1.0"


def open(  # noqa: A001 - the documented name of the entry point
    path: str | os.PathLike[str] | None = None, *, blobs: str | BlobStore | None = None,
    catalog: str | None = None, cache: str | os.PathLike[str] | None = None,
    create: bool = True, chunk_size: int | None = None, pack_size: int | None = None,
    workers: int | None = None,
) -> Store:
    """Open (or create) a store.

    With just ``path``: packs and manifests in that directory, the SQLite
    catalog (WAL) at ``path/catalog.db`` and the LMDB index cache in
    ``path/cache/``. A new or empty directory becomes a store; a non-empty
    directory that is not a store is refused. An older catalog schema is
    upgraded automatically (Alembic); a newer one is refused.

    Args:
        path: the store's root directory.
        blobs: where packs live instead of ``path`` (a directory or ``file://`` URL).
        catalog: an SQLAlchemy URL for the catalog instead of ``path/catalog.db``.
        cache: directory for the local index cache.
        create: False refuses to create a store that does not exist.
        chunk_size, pack_size, workers: override the defaults (see :mod:`casckpt.config`).

    Raises:
        NotAStoreError: ``path`` is not a store and cannot become one.
        SchemaTooNewError: the catalog was written by a newer casckpt.
        CatalogError: the catalog database cannot be opened.
    """
    return open_store(path, blobs=blobs, catalog=catalog, cache=cache, create=create,
                      chunk_size=chunk_size, pack_size=pack_size, workers=workers)


__all__ = [
    "CasckptError",
    "CheckProblem",
    "CheckReport",
    "RunInfo",
    "Store",
    "StoreStats",
    "TensorInfo",
    "Version",
    "VersionDetail",
    "errors",
    "open",
]
