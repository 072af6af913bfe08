"""Opening a store: config file, catalog, blob locations, index cache -> a :class:`Store`.

The one place components are built from a store's description (see
:func:`casckpt.open`).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.database import check_url
from casckpt.catalog.settings import REDUNDANCY
from casckpt.engine.locations import identity
from casckpt.engine.maintenance import keyring
from casckpt.engine.versions import records
from casckpt.errors import (
    InvalidArgumentError,
    NotAStoreError,
    ReadOnlyStoreError,
    ReadOnlyStoreWarning,
    StoreIdentityError,
)
from casckpt.options import Options, check, settings
from casckpt.storage import BlobStore, redact_url
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location, LocationSet
from casckpt.storage.registry import backend_for, check_options, local_path
from casckpt.storage.sealed import sealed
from casckpt.store import Store
from casckpt.store_core import StoreCore, open_location_store

if TYPE_CHECKING:
    from casckpt.engine.tiering.tier import FastTier

log = logging.getLogger(__name__)


def _default_cache_dir(store_id: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "casckpt" / store_id


def open_locations(catalog: Catalog, spec: cfg.StoreSpec, given: dict[str, BlobStore], *,
                   recover: bool = False, master: bytes | None = None, read_only: bool = False,
                   ) -> LocationSet:
    """Open every location the catalog knows or the config names, check they are this store's,
    then register the configured ones the catalog does not know yet.

    The identity check (:mod:`casckpt.engine.locations.identity`) runs before the catalog
    is written to, so a foreign or empty catalog is never taught this store's
    locations. A location this host cannot open (a removed disk, a bad URL) is
    still listed, as unreachable: reads skip it, and ``repair`` writes its
    shards again once it is marked failed. The directory of a location the catalog
    already knows is never made again: gone, it is unreachable. This host's config file may name another
    URL for a location than the catalog records (a different mount point).

    Before anything but the identity and key records is read, the store is unlocked
    (:func:`casckpt.engine.maintenance.keyring.unlock`, with the master key ``master``): an encrypted
    store's locations are then sealed (:mod:`casckpt.storage.sealed`).
    ``read_only``: the identity check runs, but nothing is written or made: no identity
    record, no catalog row, no directory; a configured location the catalog does not know
    is left out.

    Raises:
        StoreIdentityError: a location holds another store's data, or data this catalog
            knows nothing of (see :func:`casckpt.engine.locations.identity.check_at_open`).
    """
    configured = {loc.name or "": loc for loc in spec.locations}
    known = shard_sql.locations(catalog)
    urls = {row.name: configured[row.name].url if row.name in configured else row.url or ""
            for row in known}
    urls.update((name, loc.url) for name, loc in configured.items() if name not in urls)
    states = {row.name: row.state for row in known}
    known_urls = {row.name: row.url for row in known}
    opened: dict[str, BlobStore] = {}
    try:
        for name, url in urls.items():
            if read_only and name not in states:
                continue
            opened[name] = open_location_store(name, url, spec.backends, given,
                                               create=name not in states and not read_only,
                                               failed=states.get(name) == "failed")
        usable = {name: blobs for name, blobs in opened.items() if states.get(name) != "failed"}
        crypto = keyring.unlock(catalog, usable, master, recover=recover, read_only=read_only)
        opened = {name: sealed(blobs, crypto) for name, blobs in opened.items()}
        surveys = [identity.survey(name, blobs) for name, blobs in opened.items()
                   if states.get(name) != "failed"]
        to_write = identity.check_at_open(catalog, surveys, recover=recover)
        rows = known
        if read_only:
            return LocationSet([Location(row.id, row.name, row.domain, row.state, opened[row.name])
                                for row in rows])
        if any(name not in states or not known_urls.get(name) for name in configured):
            rows = shard_sql.ensure_locations(  # a write transaction only when there is news
                catalog, [(loc.name or "", loc.url, loc.domain or loc.name or "") for loc in spec.locations])
        identity.write_records(catalog, to_write)
        if crypto.encrypted and not recover:
            keyring.publish(catalog, {name: opened[name] for name in usable})
    except BaseException:
        for blobs in opened.values():
            blobs.close()
        raise
    located = LocationSet([Location(row.id, row.name, row.domain, row.state, opened[row.name])
                           for row in rows])
    if set(configured) - set(states) and not recover:  # locations new to the catalog: mirror them
        records.record_locations(located, catalog)
    return located


def open_store(path: str | os.PathLike[str] | None, options: Options, *, env_key: bool = True) -> Store:
    """See :func:`casckpt.open` (``options`` checked already: :func:`casckpt.options.check`).
    ``env_key`` False: ``CASCKPT_KEY_FILE`` is not read (a mirror's destination, whose key is
    the one its mirror recorded, or none).

    Raises:
        InvalidArgumentError: ``path`` is a URL (see :func:`casckpt.config.check_store_path`), besides
            :func:`casckpt.open`'s errors.
    """
    if path is not None:
        cfg.check_store_path(path)
    tuned = settings(options)
    blobs, catalog, cache, redundancy = (options.get("blobs"), options.get("catalog"),
                                         options.get("cache"), options.get("redundancy"))
    create = options.get("create") is not False  # None: the default, create when missing
    recover = options.get("recover") is True
    s3 = options.get("s3")
    backends = {"s3": s3} if s3 is not None else {}
    check_options(backends, "casckpt.open")
    given: dict[str, BlobStore] = {}
    items = [blobs] if isinstance(blobs, BlobStore) else blobs
    if isinstance(items, (list, tuple)):
        items = [given.setdefault(b.url, b).url if isinstance(b, BlobStore) else b for b in items]
    _check_before_writing(items, given, catalog, options.get("fast_tier"))
    if redundancy is not None:
        scheme = Redundancy.parse(redundancy)
        new = path is not None and not _config_path(Path(path)).exists()  # its directory: one domain
        places = items if items else ["."] if new else None
        domains = {loc.domain or loc.name for loc in cfg.blob_locations(places)} if places else None
        if domains is not None and scheme.shards > len(domains):  # before a config file is written
            raise InvalidArgumentError(
                f"redundancy {scheme} puts each pack on {scheme.shards} failure domains, but the "
                f"locations given span {len(domains)}; give one location per failure domain "
                "(--location DOMAIN=URL, BlobLocation(url, domain=)) or choose a smaller scheme")
        redundancy = str(scheme)
    asked = options.get("read_only")
    asked = asked if asked is not None else cfg.read_only_env()
    # the key file is read before anything is created: a bad one leaves no half-made store behind
    key_file = options.get("key_file") or (os.environ.get("CASCKPT_KEY_FILE") if env_key else None) or None
    master = keyring.read_key_file(key_file) if key_file else None
    try:
        spec = cfg.locate_store(
            Path(path).expanduser().resolve() if path is not None else None,
            blobs=items,  # type: ignore[arg-type]
            catalog=catalog, cache=Path(cache).expanduser() if cache is not None else None,
            create=create and not asked, backends=backends, redundancy=redundancy,
            record=_tier_record(options),
        )
    except NotAStoreError as exc:
        if asked and create:
            raise ReadOnlyStoreError(f"{exc}; creating a store needs write access, and it is "
                                     "opened read-only", right="store:create") from None
        raise
    check_options(spec.backends, str(spec.config_file or "casckpt.open"))
    read_only = _unwritable(spec) if asked is None else None
    cat = Catalog(spec.catalog, where=redact_url(spec.catalog), retry_s=tuned.catalog_retry_s,
                  read_only=True if asked or read_only else None if asked is None else False)
    if cat.read_only and not asked:
        read_only = read_only or cat.write_denied
        warnings.warn(ReadOnlyStoreWarning(
            f"opening the store read-only: {read_only}. Restores and queries work; "
            "commits, tags, gc and other writes raise ReadOnlyStoreError (pass read_only=True or "
            "--read-only to say so and silence this warning)"), stacklevel=3)
    why = (read_only if not asked else "it was asked to be (read_only=True, --read-only or "
           "CASCKPT_READ_ONLY=1)") if cat.read_only else None
    try:
        if identity_sql.rebuilding(cat) and not recover:
            raise StoreIdentityError(
                f"the catalog at {cat.where} holds a catalog rebuild that did not finish (killed "
                "midway?): it lacks some of the store's tags, runs or policies and must not be "
                "used. Rebuild again into a new, empty catalog: move this one away (SQLite) or "
                "create an empty database (PostgreSQL), then `casckpt catalog rebuild`")
        # a store named by URLs only is new when its catalog knows no location yet (not a rebuild's)
        created = spec.created if spec.root is not None else (
            not cat.read_only and not recover and not shard_sql.locations(cat))
        locations = open_locations(cat, spec, given, recover=recover, master=master,
                                   read_only=cat.read_only)
        recovering = recover and (shard_sql.is_empty(cat) or identity_sql.rebuilding(cat))
        if not recovering and not cat.read_only:  # a rebuild restores the store's policies from its records
            _seed_redundancy(cat, spec.redundancy, redundancy, locations)
            _record_mirrors_on_upgrade(cat, locations)
    except BaseException:
        cat.close()
        raise
    cache_dir = spec.cache if spec.cache is not None else _default_cache_dir(cat.store_id)
    index = (IndexCache.unused if cat.read_only else IndexCache)(cache_dir / "index", _cache_binding(cat))
    try:
        tier = None if recovering else _open_tier(cat, spec, options, tuned.pack_size)
    except BaseException:  # its lock and the catalog's connections are not left open
        locations.close()
        cat.close()
        raise
    core = StoreCore(root=spec.root, catalog=cat, cache=index, locations=locations,
                     staging=cache_dir / "staging",  # the tier's packs fill in its own staging/
                     settings=tuned, write_quorum=spec.write_quorum, backends=spec.backends,
                     config_file=spec.config_file, recovering=recovering, read_only=why, tier=tier,
                     background_drain=options.get("background_drain") is not False)
    store = Store(core, created=created, opener=open_destination)
    if created:  # a mistyped path would otherwise start training again from step 0, silently
        where = str(spec.root) if spec.root is not None else (
            f"catalog {cat.where}, blobs {', '.join(redact_url(loc.url) for loc in spec.locations)}")
        log.warning("created a new casckpt store at %s; pass create=False to casckpt.open where a "
                    "store must already exist", where, extra={"store_created": where})
    return store


def open_destination(where: str, key_file: str | None, create: bool) -> Store:
    """A copy's or a mirror's destination store, opened (``create``: when missing; no
    background drain: the copy closes it at once). Its key is ``key_file`` (``--to-key-file``,
    the one a mirror recorded) or none: never ``CASCKPT_KEY_FILE``, the source's key (which
    would encrypt a new destination with it, or fail on an unencrypted one)."""
    options: Options = {"background_drain": False, "create": create}
    if key_file is not None:
        options["key_file"] = key_file
    return open_store(where, check(options), env_key=False)


def _check_before_writing(blobs: object, given: Mapping[str, BlobStore], catalog: str | None,
                          fast_tier: str | os.PathLike[str] | None) -> None:
    """Refuse what would leave a store no open gets past, before its config file is written:
    a location of a scheme no backend serves, a credential in its URL, a ``file://`` URL
    naming a host, two locations naming one place (:func:`casckpt.config.locate_store`), a
    catalog URL naming no database, a fast tier under a regular file.

    Raises:
        InvalidArgumentError: any of these (the message says what to write instead).
    """
    for loc in cfg.blob_locations(blobs) if blobs is not None else ():
        if "://" in loc.url and loc.url not in given:
            backend_for(loc.url)
            local_path(loc.url)
    if catalog is not None:
        check_url(catalog, redact_url(catalog))
    if fast_tier is not None:
        probe = _existing_ancestor(Path(fast_tier).expanduser())
        if not probe.is_dir():
            raise InvalidArgumentError(f"fast_tier {str(fast_tier)!r} lies under {probe}, which is not "
                                       "a directory: give a directory on this host's fast disk")


def _config_path(path: Path) -> Path:
    """The config file of the store at ``path`` (a directory, or the file itself)."""
    return path if path.suffix == ".toml" else path / "casckpt.toml"


def _tier_record(options: Options) -> dict[str, Any]:
    """What a new store's config file records of the fast tier it was opened with."""
    where, budget = options.get("fast_tier"), options.get("fast_tier_bytes")
    return {"fast_tier": str(Path(where).expanduser().resolve()) if where else None,
            "fast_tier_bytes": cfg.parse_size(budget, "fast_tier_bytes") if budget is not None else None,
            "keep_fast_last": options.get("keep_fast_last")}


def _open_tier(cat: Catalog, spec: cfg.StoreSpec, options: Options, pack_size: int) -> FastTier | None:
    """This host's fast tier (options first, then the config file), or None."""
    given_dir = options.get("fast_tier")
    where = Path(given_dir).expanduser() if given_dir else spec.fast_tier
    if where is None:
        return None
    from casckpt.engine.tiering.tier import open_tier

    given = options.get("fast_tier_bytes")
    given = given if given is not None else spec.fast_tier_bytes
    budget = cfg.parse_size(given, "fast_tier_bytes") if given is not None else _half_free(where)
    keep = options.get("keep_fast_last")
    keep = keep if keep is not None else spec.keep_fast_last
    return open_tier(cat, where, budget, 1 if keep is None else keep, read_only=cat.read_only,
                     pack_size=pack_size)


def _half_free(where: Path) -> int:
    """Half the free space of the disk ``where`` is (or would be) on."""
    return max(1, shutil.disk_usage(_existing_ancestor(where)).free // 2)


def _existing_ancestor(path: Path) -> Path:
    """``path`` if it exists, else its nearest parent that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable(spec: cfg.StoreSpec) -> str | None:
    """Why this process cannot write a local location of the store (None: it can, as far as
    the file system says). The directory of a store whose data lives elsewhere only holds its
    config file, which commits do not write: a root-owned one shared by many users is fine.
    The catalog answers for itself (see :class:`~casckpt.catalog.Catalog`). Buckets and
    containers are not probed: one refusing writes is only known by writing, so such stores
    are opened read-only by asking."""
    for loc in spec.locations:
        place = local_path(loc.url)
        if place is not None and place.is_dir() and not os.access(place, os.W_OK):
            where = "store directory" if place == spec.root else f"blob location {loc.name or ''}".rstrip()
            return f"the {where} {place} is not writable by this process (uid {os.geteuid()})"
    return None


def _cache_binding(catalog: Catalog) -> str:
    """What an index cache belongs to: one store, in one catalog generation (a rebuilt
    catalog's chunk rows are new, so a cache filled before the rebuild is dropped)."""
    mine = identity_sql.read(catalog)
    return f"{mine.store_id}/{mine.generation}"


def _record_mirrors_on_upgrade(catalog: Catalog, locations: LocationSet) -> None:
    """The open that upgraded the catalog writes every mirror's record: mirrors added by a
    casckpt that wrote none get theirs (for a catalog rebuild; ``check`` wants them)."""
    if catalog.upgraded_from is not None:
        for mirror in mirror_sql.mirrors(catalog):
            records.record_mirror(locations, catalog, mirror.name)


def _seed_redundancy(catalog: Catalog, recorded: str | None, explicit: str | None,
                     locations: LocationSet) -> None:
    """A new store takes its configured redundancy; an explicit one must agree with the catalog's."""
    current = REDUNDANCY.stored(catalog)
    if current is None and (explicit or recorded):
        REDUNDANCY.set_store(catalog, str(Redundancy.parse(explicit or recorded or "none")))
        records.record_store(locations, catalog)
    elif explicit is not None and current is not None and explicit != current:
        raise InvalidArgumentError(
            f"this store's redundancy is {current}, not {explicit}; change it with "
            "store.locations.set_redundancy() or `casckpt redundancy set`"
        )
