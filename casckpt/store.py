"""The Store facade: wires catalog, index cache, blob store and engine together.

This is the only module that builds components; everything below it receives
what it needs. A ``Store`` is thread-safe: concurrent commits and restores from
several threads share its pools (the catalog serialises what must be serial).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from sqlalchemy import Row

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.engine import check as check_engine
from casckpt.engine import commit as commit_engine
from casckpt.engine import restore as restore_engine
from casckpt.engine.context import EngineContext
from casckpt.engine.refs import resolve
from casckpt.engine.validate import check_name
from casckpt.errors import InvalidArgumentError, RefNotFoundError
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.tree import iter_values
from casckpt.storage import BlobStore, open_blob_store, redact_url
from casckpt.types import (
    CheckReport,
    ProgressCallback,
    RunInfo,
    StoreStats,
    TensorInfo,
    Version,
    VersionDetail,
)

Ref = str | Version


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


class Store:
    """A casckpt store: commit, restore and query checkpoint versions.

    Build one with :func:`casckpt.open`. Use it as a context manager, or call
    :meth:`close` when done.
    """

    def __init__(self, *, root: Path | None, catalog: Catalog, cache: IndexCache,
                 blobs: BlobStore, staging: Path, settings: cfg.Settings) -> None:
        self.path = root
        staging.mkdir(parents=True, exist_ok=True)
        self._ctx = EngineContext(
            catalog=catalog, cache=cache, blobs=blobs, staging=staging, config=settings,
            pool=ThreadPoolExecutor(settings.workers, thread_name_prefix="casckpt"),
            uploads=ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="casckpt-upload"),
        )
        self._closed = False

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Release threads, the cache, pooled connections and clients. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctx.pool.shutdown(wait=True)
        self._ctx.uploads.shutdown(wait=True)
        self._ctx.cache.close()
        self._ctx.catalog.close()
        self._ctx.blobs.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<casckpt.Store {self._ctx.blobs.url}>"

    # -- commit and restore -------------------------------------------------

    def commit(
        self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None, message: str | None = None,
        tags: Iterable[str] = (), progress: ProgressCallback | None = None,
    ) -> Version:
        """Store ``state`` as version ``run@step`` and return it once it is visible.

        Only chunks the store has never held are written. The state is read,
        not modified; do not mutate it until ``commit`` returns.

        Raises:
            UnsupportedStateError: the tree holds an unsupported object (nothing written).
            InvalidNameError, InvalidArgumentError: bad run/tag name, step, metadata or metrics.
            VersionExistsError: ``run`` already has a version at ``step``.
            StorageError, CatalogError: the blob store or catalog failed; the
                version is not visible and the store stays consistent.
        """
        req = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        return commit_engine.commit(self._ctx, state, req, progress)

    def restore(self, ref: Ref, into: object = None, *, map_location: Any = None,
                progress: ProgressCallback | None = None) -> Any:
        """Bring back the state tree of ``ref``, every byte verified.

        Args:
            ref: a ref string (``run@step``, ``run@latest``, ``run@~N``,
                ``tag:NAME``, id prefix) or a :class:`Version`.
            into: None to get a new tree; or a tree / ``nn.Module`` / optimizer /
                anything with ``state_dict``/``load_state_dict`` to restore in
                place (existing CPU tensors of matching dtype and shape are
                filled directly, without a second copy).
            map_location: device for new tensors (e.g. ``"cuda:0"``).

        Returns:
            The new tree, or ``into`` updated.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            RestoreTargetError: ``into`` does not match the stored state.
            CorruptChunkError, MissingDataError: stored data is damaged or gone.
        """
        manifest = self._manifest(ref)
        if into is None:
            return restore_engine.materialize(self._ctx, manifest, map_location=map_location,
                                              progress=progress)
        return restore_engine.restore_into(self._ctx, manifest, into, map_location=map_location,
                                           progress=progress)

    def load_tensor(self, ref: Ref, path: str, *, map_location: Any = None) -> torch.Tensor | np.ndarray:
        """Read one tensor (dotted path, e.g. ``model.layers.0.weight``), fetching only its chunks.

        Raises:
            TensorNotFoundError: no tensor at ``path`` (near matches listed).
        """
        return restore_engine.load_tensor(self._ctx, self._manifest(ref), path, map_location)

    # -- queries ------------------------------------------------------------

    def resolve(self, ref: Ref) -> Version:
        """The version a ref names."""
        return self._version(self._row(ref))

    def log(self, run: str | None = None, *, limit: int | None = None) -> list[Version]:
        """Versions of ``run`` (all runs if None), newest first."""
        if run is not None:
            check_name(run, "run")
            names = self._ctx.catalog.run_names()
            if run not in names:
                near = difflib.get_close_matches(run, names, n=3)
                raise RefNotFoundError(run, "there is no run with that name", near)
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(f"limit must be a non-negative int, got {limit!r}")
        return self._versions(self._ctx.catalog.log(run, limit))

    def show(self, ref: Ref) -> VersionDetail:
        """A version with its tensors (from the catalog) and plain values (from its manifest)."""
        row = self._row(ref)
        manifest = decode_manifest(self._ctx.catalog.manifest(row.id), row.id)
        tensors = tuple(
            TensorInfo(t.path, t.dtype, tuple(t.shape), t.nbytes, t.chunks, t.digest)
            for t in self._ctx.catalog.tensors_of(row.id)
        )
        return VersionDetail(self._version(row), tensors, dict(iter_values(manifest.root)))

    def runs(self) -> list[RunInfo]:
        """Every run with a summary of its versions."""
        return [
            RunInfo(r[0], _utc(r[1]), r[2], r[3], r[4], int(r[5])) for r in self._ctx.catalog.runs()
        ]

    def tag(self, ref: Ref, name: str) -> Version:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        check_name(name, "tag")
        row = self._row(ref)
        self._ctx.catalog.set_tag(name, row.id)
        return self._version(row)

    def check(self, *, read_data: bool = False, progress: ProgressCallback | None = None) -> CheckReport:
        """Check catalog <-> blob store consistency; with ``read_data``, verify every chunk."""
        return check_engine.check(self._ctx, read_data=read_data, progress=progress)

    def stats(self) -> StoreStats:
        """Space accounting: logical vs unique vs stored bytes."""
        return StoreStats(**self._ctx.catalog.totals())

    # -- helpers ------------------------------------------------------------

    def _row(self, ref: Ref) -> Row[Any]:
        return resolve(self._ctx.catalog, ref.id if isinstance(ref, Version) else ref)

    def _manifest(self, ref: Ref) -> Manifest:
        row = self._row(ref)
        return decode_manifest(self._ctx.catalog.manifest(row.id), row.id)

    def _versions(self, rows: list[Row[Any]]) -> list[Version]:
        tags = self._ctx.catalog.tags_of([r.id for r in rows])
        return [self._version(r, tags.get(r.id, ())) for r in rows]

    def _version(self, row: Row[Any], tags: tuple[str, ...] | None = None) -> Version:
        if tags is None:
            tags = self._ctx.catalog.tags_of([row.id]).get(row.id, ())
        return Version(
            id=row.id, run=row.run, step=row.step, created_at=_utc(row.created_at),
            logical_bytes=row.logical_bytes, new_bytes=row.new_bytes,
            stored_bytes=row.stored_bytes, duration_s=row.duration_s, parent=row.parent_id,
            tags=tags, metadata=row.meta, metrics=row.metrics, message=row.message,
        )


def _default_cache_dir(store_id: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "casckpt" / store_id


def open_store(
    path: str | os.PathLike[str] | None = None, *, blobs: str | BlobStore | None = None,
    catalog: str | None = None, cache: str | os.PathLike[str] | None = None,
    create: bool = True, chunk_size: int | None = None, pack_size: int | None = None,
    workers: int | None = None, s3: Mapping[str, Any] | None = None,
) -> Store:
    """See :func:`casckpt.open`."""
    settings = cfg.settings({"chunk_size": chunk_size, "pack_size": pack_size, "workers": workers})
    spec = cfg.locate_store(
        Path(path).expanduser().resolve() if path is not None else None,
        blobs=blobs if isinstance(blobs, str) or blobs is None else blobs.url,
        catalog=catalog, cache=Path(cache).expanduser() if cache is not None else None,
        create=create, s3=s3,
    )
    blob_store = blobs if blobs is not None and not isinstance(blobs, str) else (
        open_blob_store(spec.blobs, spec.s3)
    )
    try:
        cat = Catalog(spec.catalog, where=redact_url(spec.catalog))
    except BaseException:
        blob_store.close()
        raise
    cache_dir = spec.cache if spec.cache is not None else _default_cache_dir(cat.store_id)
    index = IndexCache(cache_dir / "index", cat.store_id)
    return Store(root=spec.root, catalog=cat, cache=index, blobs=blob_store,
                 staging=cache_dir / "staging", settings=settings)
