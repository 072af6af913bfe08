"""Where a store's files go, the store config file, and every environment override, in one place
(the config file's decoding and checks: :mod:`casckpt.config_file`).

Environment variables (all optional):

``CASCKPT_STORE``        the store (directory or .toml file) the CLI opens without ``--store``.
``CASCKPT_FAST_TIER``    this host's fast tier directory for the CLI without ``--fast-tier``, where
                         the store's casckpt.toml records none (``casckpt drain``).
``CASCKPT_CHUNK_SIZE``   bytes per chunk (default 1 MiB).
``CASCKPT_PACK_SIZE``    target pack size in bytes (default 64 MiB).
``CASCKPT_WORKERS``      threads for hashing, compression and I/O.
``CASCKPT_COMPRESSION``  ``0`` stores every chunk raw; ``1`` (default) compresses where it pays.
``CASCKPT_ZSTD_LEVEL``   zstd level for compressed chunks (default 1).
``CASCKPT_MAX_PENDING_COMMITS``  background commits in flight at once (default 2).
``CASCKPT_COMMIT_MEMORY``  bytes background commits may hold as staging and copies (default RAM/4, <= 8 GiB).
``CASCKPT_BACKPRESSURE``   ``block`` (default) or ``raise`` when background commits are at a bound.
``CASCKPT_STAGING_MEMORY``  host bytes GPU tensors stream through on commit (default 256 MiB).
``CASCKPT_CATALOG_RETRY_S``  seconds a catalog step is retried while the database is unreachable
                           (default 5; 0: no retries).
``CASCKPT_STORAGE_RETRY_S``  seconds a pack read keeps trying while too few of its locations can be
                           reached before it raises StoreUnavailableError (default 30; 0: no waiting).
``CASCKPT_PROBE_TIMEOUT_S``  seconds a location has to answer its health probe (default 5).
``CASCKPT_READ_ONLY``      ``1`` opens every store read-only, ``0`` never (default: read-only
                           only where this process cannot write it).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from casckpt.config_file import STORE_FORMAT
from casckpt.config_file import read_config_file as read_config_file
from casckpt.errors import AccessDeniedError, InvalidArgumentError, NotAStoreError
from casckpt.localfs import fsync_dir, replace_atomically

CONFIG_FILE = "casckpt.toml"
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_PACK_SIZE = 64 << 20
CATALOG_FILE = "catalog.db"
CACHE_DIR = "cache"

@dataclass(frozen=True, slots=True)
class Settings:
    """Tuning knobs of the commit and restore pipelines.

    ``chunk_size``, ``pack_size``, ``workers``, ``max_pending_commits``, ``commit_memory``,
    ``backpressure`` and ``staging_memory`` are the :class:`casckpt.Options` fields of those
    names (documented there); the others are not options (the module docstring lists the
    environment variables that set some of them).

    Attributes:
        compress: False stores every chunk raw.
        zstd_level: zstd level for compressed chunks.
        read_coalesce: the largest single ranged read restore issues.
        upload_workers: packs stored concurrently while the next one fills: also how many
            finished packs a commit holds in staging beside the one filling (each a pack's
            size on the staging disk, with its shards when erasure-coded), and the most
            erasure-coding worker processes (at most half the CPUs).
        delta_memory: host memory holding the raw chunks of recent commits,
            the bases the next commit's chunks are delta-coded against
            (default: a sixteenth of RAM, at most 1 GiB; only chunks whose
            deltas pay are kept in full, see docs/DEFAULTS.md; a state whose
            bases do not fit gets keyframes where they do not). 0 turns delta
            coding off in this process (``CASCKPT_DELTA_MEMORY=0``); a chain
            length of 0 turns it off for a run or store.
        catalog_retry_s: how long each catalog step (a query, recording a pack,
            publishing a version) is retried while the catalog database is
            unreachable before it raises CatalogUnavailableError (0: no retries).
        storage_retry_s: how long a pack read keeps trying, with backoff, while too few
            of the locations holding its shards or copies can be reached (connections
            dropped, timeouts, throttling) before it raises StoreUnavailableError (0: no
            waiting). Locations that answer "no such object" are not waited for.
        probe_timeout_s: how long ``store.locations.list()`` waits for the locations to
            answer their health probes (all probed at once) before it reports the
            silent ones unreachable.
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = DEFAULT_PACK_SIZE
    workers: int = max(2, min(8, os.cpu_count() or 2))
    compress: bool = True
    zstd_level: int = 1
    read_coalesce: int = 16 << 20
    upload_workers: int = 2
    max_pending_commits: int = 2
    commit_memory: int = field(default_factory=lambda: int(min(8 << 30, _ram() // 4)))
    backpressure: str = "block"
    staging_memory: int = 256 << 20
    delta_memory: int = field(default_factory=lambda: int(min(1 << 30, _ram() // 16)))
    catalog_retry_s: float = 5.0
    storage_retry_s: float = 30.0
    probe_timeout_s: float = 5.0


def _ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a modest machine
        return 8 << 30


def _int_env(env: Mapping[str, str], name: str, zero: bool = False) -> int | None:
    """The integer in ``env[name]`` (None: unset); positive, or with ``zero`` also 0."""
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None
    if number < 0 or (number == 0 and not zero):
        raise InvalidArgumentError(f"{name}={value!r} must be {'0 (off) or more' if zero else 'positive'}")
    return number


def _seconds_env(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise InvalidArgumentError(f"{name}={value!r} must be 0 or more seconds")
    return seconds


def _backpressure(value: object) -> str:
    if value not in ("block", "raise"):
        raise InvalidArgumentError(f"backpressure must be 'block' or 'raise', got {value!r}")
    return str(value)


def read_only_env(env: Mapping[str, str] = os.environ) -> bool | None:
    """``CASCKPT_READ_ONLY``: True (``1``/``true``/``yes``), False (``0``/``false``/``no``),
    None when unset or empty (decide by whether the store can be written).

    Raises:
        InvalidArgumentError: another value.
    """
    value = env.get("CASCKPT_READ_ONLY", "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "0", "false", "no"):
        return value in ("1", "true", "yes")
    raise InvalidArgumentError(f"CASCKPT_READ_ONLY must be 1 or 0, got {env['CASCKPT_READ_ONLY']!r}")


_ZERO_MEANS_OFF = frozenset({"delta_memory"})  # settings whose 0 turns their feature off
_INT_VARS = {"chunk_size": "CASCKPT_CHUNK_SIZE", "pack_size": "CASCKPT_PACK_SIZE",
             "workers": "CASCKPT_WORKERS", "zstd_level": "CASCKPT_ZSTD_LEVEL",
             "max_pending_commits": "CASCKPT_MAX_PENDING_COMMITS",
             "commit_memory": "CASCKPT_COMMIT_MEMORY", "staging_memory": "CASCKPT_STAGING_MEMORY",
             "delta_memory": "CASCKPT_DELTA_MEMORY"}
_SECONDS_VARS = {"catalog_retry_s": "CASCKPT_CATALOG_RETRY_S",
                 "storage_retry_s": "CASCKPT_STORAGE_RETRY_S",
                 "probe_timeout_s": "CASCKPT_PROBE_TIMEOUT_S"}


def settings(overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] = os.environ) -> Settings:
    """Defaults, then environment variables, then explicit ``overrides``."""
    found: dict[str, Any] = {name: _int_env(env, var, zero=name in _ZERO_MEANS_OFF)
                             for name, var in _INT_VARS.items()}
    found |= {name: _seconds_env(env, var) for name, var in _SECONDS_VARS.items()}
    if env.get("CASCKPT_COMPRESSION", "1") == "0":
        found["compress"] = False
    if env.get("CASCKPT_BACKPRESSURE"):
        found["backpressure"] = _backpressure(env["CASCKPT_BACKPRESSURE"])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key == "backpressure":
            value = _backpressure(value)
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0 \
                or (value == 0 and key not in _ZERO_MEANS_OFF):
            raise InvalidArgumentError(f"{key} must be a positive int, got {value!r}")
        found[key] = value
    return replace(Settings(), **{k: v for k, v in found.items() if v is not None})


@dataclass(frozen=True, slots=True)
class BlobLocation:
    """One blob location of a store, as given to :func:`casckpt.open` or the config file.

    Attributes:
        url: a directory, or a URL of a registered storage backend (``file:///dir``,
            ``s3://bucket/prefix``, ``az://container/prefix``).
        domain: its failure domain (what fails together: a disk, a host, a
            bucket's region); default: its own.
        name: how commands refer to it; default ``loc0``, ``loc1``, ... by position.
    """

    url: str
    domain: str | None = None
    name: str | None = None


BlobsArg = str | BlobLocation | Sequence["str | BlobLocation | Mapping[str, str]"]


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Where a store's parts are.

    Attributes:
        root: the directory holding ``casckpt.toml`` (None for a store opened by URLs only).
        locations: the blob locations, URLs absolute, names and domains filled in.
        catalog: the catalog's SQLAlchemy URL.
        cache: the local index cache directory (None: derived from the store id).
        backends: each storage backend's options, by URL scheme (``{"s3": {"region": ...}}``):
            the config file's ``[s3]``, ``[az]``, ... tables, then what was passed.
        redundancy: the redundancy a new store starts with (None: ``none``).
        write_quorum: shards a pack needs durable before a commit publishes (None: default).
        fast_tier, fast_tier_bytes, keep_fast_last: this host's fast tier as the config file
            records it (a relative ``fast_tier`` is relative to the store directory).
        created: :func:`locate_store` created the config file (a new store).
    """

    root: Path | None
    locations: tuple[BlobLocation, ...]
    catalog: str
    cache: Path | None
    backends: Mapping[str, Mapping[str, Any]]
    redundancy: str | None = None
    write_quorum: int | None = None
    config_file: Path | None = None
    fast_tier: Path | None = None  # the [store] table's fast tier settings (None: none recorded)
    fast_tier_bytes: int | None = None
    keep_fast_last: int | None = None
    created: bool = False

    @property
    def blobs(self) -> str:
        """The first location's URL."""
        return self.locations[0].url


def _as_location(item: object) -> BlobLocation:
    """One location as given, its URL's scheme in lower case (schemes are case-insensitive,
    RFC 3986: ``S3://b`` is ``s3://b``, and is recorded so)."""
    loc = None
    if isinstance(item, BlobLocation):
        loc = item
    elif isinstance(item, str):
        loc = BlobLocation(item)
    elif isinstance(item, Mapping) and set(item) <= {"url", "domain", "name"}:
        loc = BlobLocation(item.get("url"), item.get("domain"), item.get("name"))  # type: ignore[arg-type]
    if loc is None or not isinstance(loc.url, str) or not all(
            v is None or isinstance(v, str) for v in (loc.domain, loc.name)):
        raise InvalidArgumentError(
            f"a blob location must be a URL string, a casckpt.BlobLocation or a table with url "
            f"(and optional domain, name), all strings; got {item!r}")
    scheme, sep, rest = loc.url.partition("://")
    return replace(loc, url=scheme.lower() + sep + rest) if sep else loc


def blob_locations(blobs: object) -> tuple[BlobLocation, ...]:
    """Normalise what ``blobs=`` accepts (one location: a URL, a BlobLocation or a mapping;
    or a list of them) into locations with names (URLs as given, schemes in lower case)."""
    one = isinstance(blobs, (str, BlobLocation, Mapping))
    if not one and not isinstance(blobs, (list, tuple)):
        raise InvalidArgumentError(f"blobs= must be a location or a list of locations, got {blobs!r}")
    items = [blobs] if one else list(blobs)  # type: ignore[call-overload]
    if not items:
        raise InvalidArgumentError("blobs= needs at least one location")
    out = []
    for i, item in enumerate(items):
        loc = _as_location(item)
        out.append(BlobLocation(loc.url, loc.domain, loc.name or f"loc{i}"))
    names = [loc.name for loc in out]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"blob location names must be unique, got {names}")
    return tuple(out)


def _resolved(locations: Sequence[BlobLocation], root: Path) -> tuple[BlobLocation, ...]:
    """Locations with absolute URLs (relative directories taken from ``root``).

    Raises:
        InvalidArgumentError: two locations name the same place.
    """
    out = tuple(BlobLocation(_blob_url(loc.url, root), loc.domain or loc.name, loc.name)
                for loc in locations)
    seen: dict[str, str | None] = {}
    for loc in out:
        same = seen.setdefault(loc.url.rstrip("/"), loc.name)
        if same != loc.name:
            raise InvalidArgumentError(
                f"blob locations {same} and {loc.name} are the same place"
                f"{f' ({loc.url})' if loc.url.startswith('file://') else ''}: each location must "
                "be a different directory, bucket prefix or container")
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def render_config(values: Mapping[str, Any], backends: Mapping[str, Mapping[str, Any]],
                  locations: Sequence[BlobLocation] = ()) -> str:
    """The text of a ``casckpt.toml`` recording where a store's parts are (each backend's
    options in a table named by its scheme)."""
    lines = [
        "# casckpt store. Every job and the CLI open the store from this file:",
        "#   casckpt.open(PATH) / casckpt --store PATH / CASCKPT_STORE=PATH",
        "# blobs defaults to this directory, catalog to catalog.db (SQLite) here,",
        "# cache to cache/ here. Keep passwords out of this file: use PGPASSWORD or",
        "# ~/.pgpass for PostgreSQL, the AWS credential chain for S3 and",
        "# AZURE_STORAGE_CONNECTION_STRING (or an Azure identity) for Azure.",
        "[store]",
        f"format = {STORE_FORMAT}",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    for loc in locations:
        lines += ["", "[[locations]]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                          (("name", loc.name), ("url", loc.url), ("domain", loc.domain))
                                          if v is not None]
    for scheme, options in backends.items():
        if options:
            lines += ["", f"[{scheme}]"] + [f"{k} = {_toml_value(v)}" for k, v in options.items()
                                             if v is not None]
    return "\n".join(lines) + "\n"


def _blob_url(value: str, root: Path) -> str:
    if "://" in value:
        return value
    return (root / Path(value).expanduser()).resolve().as_uri()


def _recorded_locations(doc: Mapping[str, Any]) -> tuple[BlobLocation, ...] | None:
    store = doc["store"]  # checked by read_config_file: not both of blobs and locations
    tables = doc.get("locations")
    if tables:
        return blob_locations(tables)
    if store.get("blobs") is not None:
        return blob_locations(store["blobs"])
    return None


def recorded_backends(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A config document's backend option tables, by scheme: every top-level table but
    ``[store]`` and ``[[locations]]`` (checked against each backend's declared options when the
    store opens: :func:`casckpt.storage.registry.check_options`)."""
    return {name: value for name, value in doc.items() if name not in ("store", "locations")}


def merged_backends(*layers: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Backend options by scheme, later layers' options overriding earlier ones'."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for scheme, options in (layer or {}).items():
            out[scheme] = {**out.get(scheme, {}), **options} if isinstance(options, Mapping) \
                else options  # type: ignore[assignment]  # not a table: check_options says so
    return out


def _spec_from_file(file: Path, blobs: BlobsArg | None, catalog: str | None,
                    cache: Path | None, backends: Mapping[str, Mapping[str, Any]] | None) -> StoreSpec:
    doc = read_config_file(file)
    store, root = doc["store"], file.parent
    recorded = _recorded_locations(doc)
    given = blob_locations(blobs) if blobs is not None else None
    if given is not None and recorded is not None and _resolved(given, root) != _resolved(recorded, root):
        raise InvalidArgumentError(
            f"the store at {root} records other blob locations than those passed; omit blobs= "
            f"or edit {file}"
        )
    if catalog is not None and store.get("catalog") is not None and catalog != store["catalog"]:
        raise InvalidArgumentError(
            f"the store at {root} records catalog = {store['catalog']!r} but {catalog!r} was "
            f"passed; omit catalog= or edit {file}"
        )
    if cache is None and store.get("cache"):
        cache = root / Path(store["cache"]).expanduser()
    if cache is None and recorded is None and store.get("catalog") is None:
        cache = root / CACHE_DIR  # a self-contained local store keeps its cache inside
    return StoreSpec(
        root=root,
        locations=_resolved(given or recorded or blob_locations("."), root),
        catalog=catalog or store.get("catalog") or f"sqlite:///{root / CATALOG_FILE}",
        cache=cache,
        backends=merged_backends(recorded_backends(doc), backends),
        redundancy=store.get("redundancy"),
        write_quorum=store.get("write_quorum"),
        config_file=file,
        fast_tier=root / Path(store["fast_tier"]).expanduser() if store.get("fast_tier") else None,
        fast_tier_bytes=store.get("fast_tier_bytes"),
        keep_fast_last=store.get("keep_fast_last"),
    )


def locate_store(path: Path | None, *, blobs: BlobsArg | None, catalog: str | None,
                 cache: Path | None, create: bool,
                 backends: Mapping[str, Mapping[str, Any]] | None = None,
                 redundancy: str | None = None, record: Mapping[str, Any] | None = None) -> StoreSpec:
    """Work out where a store's parts are, creating its config file for a new store.

    ``path`` is a store directory or a ``.toml`` config file. A new or empty
    directory becomes a store; ``blobs`` / ``catalog`` / ``backends`` (options by scheme) /
    ``redundancy`` (and the ``[store]`` values in ``record``: a fast tier) given for a new
    store are recorded in its config file so every later open needs only the path. For an
    existing store, ``backends`` options override the file's for this open.

    Raises:
        NotAStoreError: ``path`` is a non-empty directory without a store, a
            plain file, or missing while ``create`` is False.
        InvalidArgumentError: arguments contradict the store's config file.
    """
    if path is None:
        if blobs is None or catalog is None:
            raise InvalidArgumentError(
                "casckpt.open needs a store path, or both blobs= and catalog= "
                "(e.g. casckpt.open('ckpts/'))"
            )
        return StoreSpec(None, _resolved(blob_locations(blobs), Path.cwd()), catalog, cache,
                         merged_backends(backends), redundancy)
    file = path if path.suffix == ".toml" and not path.is_dir() else path / CONFIG_FILE
    try:
        found = file.is_file()
    except PermissionError as exc:  # pathlib lets EACCES through: a parent this uid cannot search
        raise AccessDeniedError(
            f"cannot reach the store at {path}: {exc.strerror} ({exc.filename}); give this user "
            "search (x) rights on every directory above the store and read rights on the store",
            right=f"read {file}") from exc
    if found:
        return _spec_from_file(file, blobs, catalog, cache, backends)
    root = file.parent
    if root.exists() and not root.is_dir():
        raise NotAStoreError(f"{root} is a file, not a casckpt store directory")
    if root.is_dir() and _holds_other_files(file):
        if file.is_file():  # another opener created the store meanwhile
            return _spec_from_file(file, blobs, catalog, cache, backends)
        raise _not_empty(root)
    if not create:
        raise NotAStoreError(
            f"no casckpt store at {path}; create one with `casckpt init {path}` or casckpt.open()"
        )
    given = blob_locations(blobs) if blobs is not None else None
    if given is not None:
        _resolved(given, root)  # refused before the config file is written
    single = given is not None and len(given) == 1 and given[0].domain is None and given[0].name == "loc0"
    text = render_config(
        {"blobs": given[0].url if single and given else None, "catalog": catalog,
         "redundancy": redundancy, **(record or {})},
        merged_backends(backends), () if single or given is None else given)
    if not _create_config_file(file, text):  # another process or thread created the store first
        return _spec_from_file(file, blobs, catalog, cache, backends)
    return replace(_spec_from_file(file, None, None, cache, None), created=True)


def _not_empty(root: Path) -> NotAStoreError:
    return NotAStoreError(
        f"{root} is not a casckpt store (no {CONFIG_FILE}) and is not empty; pass a new or "
        "empty directory to create a store, or the root of an existing one"
    )


def _is_temp_of(name: str, file: Path) -> bool:
    """Whether ``name`` is a temporary file a creator of ``file`` writes (and may leave if killed)."""
    return name.startswith(f".{file.name}.") and name.endswith(".tmp")


def _holds_other_files(file: Path) -> bool:
    """Whether the directory of a config file holds anything besides creators' temporary files."""
    return any(not _is_temp_of(p.name, file) for p in file.parent.iterdir())


@contextmanager
def _directory_lock(root: Path) -> Iterator[bool]:
    """Make ``root`` if missing and hold an exclusive flock on it; yields whether the lock is held.

    Each call opens its own descriptor, so threads of one process exclude
    each other as processes do. A filesystem that cannot flock a directory
    (some NFS setups) yields False: creation then rests on ``link()`` alone.
    """
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # releases the lock


def _create_config_file(file: Path, text: str) -> bool:
    """Create a new store's config file unless another opener has; True if this call created it.

    Creators serialise on a lock on the directory and re-check under it; the
    file itself appears whole and only once (written to a temporary file of a
    unique name, then hard-linked into place, which fails if the name exists).
    Only this path takes the lock: opening an existing store never does.

    Raises:
        NotAStoreError: the directory holds something other than a store.
    """
    root = file.parent
    with _directory_lock(root) as locked:
        if file.is_file():
            return False
        if _holds_other_files(file):
            if file.is_file():  # without the lock, a creator may have finished meanwhile
                return False
            raise _not_empty(root)
        if locked:  # every creator holds the lock while its temporary file exists: these are stale
            for stray in root.iterdir():
                if _is_temp_of(stray.name, file):
                    stray.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            created = _link_once(Path(tmp), file)
        finally:
            Path(tmp).unlink(missing_ok=True)
        if created:
            fsync_dir(root)
        return created


def _link_once(tmp: Path, file: Path) -> bool:
    """Put ``tmp`` in place as ``file`` unless ``file`` exists; True if it was put there."""
    try:
        os.link(tmp, file)
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem (some FUSE mounts): rename, the lock decides
        if file.exists():
            return False
        os.replace(tmp, file)
    return True


def add_location_to_file(file: Path, location: BlobLocation) -> None:
    """Append a location to a store's config file (rewritten atomically, other settings kept).

    A ``blobs`` setting becomes ``[[locations]]`` tables.
    """
    doc = read_config_file(file)
    current = _recorded_locations(doc) or blob_locations(".")
    store = {k: v for k, v in doc["store"].items() if k not in ("format", "blobs")}
    text = render_config(store, recorded_backends(doc), (*current, location))
    replace_atomically(file, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=True)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: object, what: str) -> int:
    """A byte count from an int or a string like ``"200GiB"``, ``"1.5 TB"``, ``"4096"``
    (``KiB``/``MiB``/... are powers of 1024, ``KB``/``MB``/... of 1000).

    Raises:
        InvalidArgumentError: anything else, or not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        number, unit, binary = m.groups()
        power = "kmgtp".find(unit.lower()) + 1 if unit else 0
        size = int(float(number) * (1024 if binary else 1000) ** power)
        if size > 0:
            return size
    raise InvalidArgumentError(f"{what} must be a positive number of bytes (an int, or a string "
                               f"such as '200GiB' or '500GB'), got {value!r}")


def check_store_path(path: str | os.PathLike[str]) -> str:
    """``path``, a store's directory, as a string: the one way a store is named, by
    ``casckpt.open``, ``casckpt copy --to`` and a mirror's destination alike.

    Raises:
        InvalidArgumentError: ``path`` is a URL (``s3://bucket/prefix``...): a store is its
            directory, whose casckpt.toml names its remote locations and catalog; a URL there
            would be taken for a relative directory named after the scheme.
    """
    text = os.fspath(path)
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text) if isinstance(text, str) else None
    if scheme:  # the URL itself is not shown: it may hold credentials
        raise InvalidArgumentError(
            f"a store is named by its directory, not a URL ({scheme[1]}://...); for a store on "
            "remote storage, make a directory whose casckpt.toml names it (casckpt init DIR "
            "--location URL [--catalog URL], or casckpt.open(DIR, blobs=URL)) and name DIR")
    return str(text)
