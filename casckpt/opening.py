"""Opening a store: config file, catalog, blob locations, index cache -> a :class:`Store`.

The one place components are built from a store's description (see
:func:`casckpt.open`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.catalog import shards as shard_sql
from casckpt.errors import InvalidArgumentError
from casckpt.storage import BlobStore, redact_url
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location, LocationSet
from casckpt.store import Store
from casckpt.store_admin import open_location

log = logging.getLogger(__name__)


def _default_cache_dir(store_id: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "casckpt" / store_id


def open_locations(catalog: Catalog, spec: cfg.StoreSpec,
                   given: dict[str, BlobStore]) -> LocationSet:
    """Register the configured locations in the catalog and open every location it knows.

    A location this host cannot open (a removed disk, a bad URL) is still
    listed, as unreachable: reads skip it, and ``repair`` rebuilds its shards
    once it is marked failed. This host's config file may name another URL
    for a location than the catalog records (a different mount point).
    """
    rows = shard_sql.ensure_locations(
        catalog, [(loc.name or "", loc.url, loc.domain or loc.name or "") for loc in spec.locations])
    local_urls = {loc.name: loc.url for loc in spec.locations}
    opened: list[Location] = []
    try:
        for row in rows:
            opened.append(open_location(row, local_urls.get(row.name) or row.url or "", spec.s3, given))
    except BaseException:
        for loc in opened:
            loc.blobs.close()
        raise
    return LocationSet(opened)


def open_store(
    path: str | os.PathLike[str] | None = None, *, blobs: object = None,
    catalog: str | None = None, cache: str | os.PathLike[str] | None = None,
    create: bool = True, chunk_size: int | None = None, pack_size: int | None = None,
    workers: int | None = None, s3: Mapping[str, Any] | None = None,
    redundancy: str | None = None, max_pending_commits: int | None = None,
    commit_memory: int | None = None, backpressure: str | None = None,
    staging_memory: int | None = None,
) -> Store:
    """See :func:`casckpt.open`."""
    settings = cfg.settings({"chunk_size": chunk_size, "pack_size": pack_size, "workers": workers,
                             "max_pending_commits": max_pending_commits,
                             "commit_memory": commit_memory, "backpressure": backpressure,
                             "staging_memory": staging_memory})
    given: dict[str, BlobStore] = {}
    items = [blobs] if isinstance(blobs, BlobStore) else blobs
    if isinstance(items, (list, tuple)):
        items = [given.setdefault(b.url, b).url if isinstance(b, BlobStore) else b for b in items]
    if redundancy is not None:
        scheme = Redundancy.parse(redundancy)
        domains = {loc.domain or loc.name for loc in cfg.blob_locations(items)} if items else None
        if domains is not None and scheme.shards > len(domains):  # before a config file is written
            raise InvalidArgumentError(
                f"redundancy {scheme} puts each pack on {scheme.shards} failure domains, but blobs= "
                f"gives {len(domains)}; pass more locations or choose a smaller scheme")
        redundancy = str(scheme)
    spec = cfg.locate_store(
        Path(path).expanduser().resolve() if path is not None else None,
        blobs=items,  # type: ignore[arg-type]
        catalog=catalog, cache=Path(cache).expanduser() if cache is not None else None,
        create=create, s3=s3, redundancy=redundancy,
    )
    cat = Catalog(spec.catalog, where=redact_url(spec.catalog), retry_s=settings.catalog_retry_s)
    try:
        _seed_redundancy(cat, spec.redundancy, redundancy)
        locations = open_locations(cat, spec, given)
    except BaseException:
        cat.close()
        raise
    cache_dir = spec.cache if spec.cache is not None else _default_cache_dir(cat.store_id)
    index = IndexCache(cache_dir / "index", cat.store_id)
    return Store(root=spec.root, catalog=cat, cache=index, locations=locations,
                 staging=cache_dir / "staging", settings=settings, write_quorum=spec.write_quorum,
                 s3=spec.s3, config_file=spec.config_file)


def _seed_redundancy(catalog: Catalog, recorded: str | None, explicit: str | None) -> None:
    """A new store takes its configured redundancy; an explicit one must agree with the catalog's."""
    current = shard_sql.store_redundancy(catalog)
    if current is None and (explicit or recorded):
        shard_sql.set_store_redundancy(catalog, str(Redundancy.parse(explicit or recorded or "none")))
    elif explicit is not None and current is not None and explicit != current:
        raise InvalidArgumentError(
            f"this store's redundancy is {current}, not {explicit}; change it with "
            "store.set_redundancy() or `casckpt redundancy set`"
        )
