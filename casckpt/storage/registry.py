"""Storage backends, registered by URL scheme.

A backend is a :class:`Backend` value: its scheme (``file``, ``s3``, ``az``), what it can do
(:class:`Capabilities`, data the engine reads instead of asking an object's class), the
options a store's config file may give it (the ``[SCHEME]`` table) and how to open a location
and print its roles. Backends are found through the ``casckpt.backends`` entry point group,
one entry point per scheme naming a module-level ``Backend``; casckpt's own are declared in its
``pyproject.toml`` like any other package's::

    [project.entry-points."casckpt.backends"]
    file = "casckpt.storage.local:BACKEND"
    s3 = "casckpt.storage.s3_backend:BACKEND"

A declaration module is light: it imports its SDK only in ``open`` (and ``import casckpt``
loads no declaration at all), so a store with only local locations never imports boto3 or the
Azure SDK. Entry points are read once per process, on the first URL opened; each backend's
module is imported when its scheme is first asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from casckpt.config_file import check_table
from casckpt.errors import InvalidArgumentError, InvalidConfigError
from casckpt.storage.base import BlobStore
from casckpt.storage.redact import redact_url

GROUP = "casckpt.backends"
"""The entry point group backends register in."""

BackendOptions = Mapping[str, Mapping[str, Any]]
"""Options of each backend, by scheme (``{"s3": {"endpoint_url": ...}, "az": {...}}``)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend guarantees, as the engine reads it (never from an object's class).

    Attributes:
        local_directory: objects are files under the directory the URL's path names, on this
            host: rights are read from the file system (no request), and an unwritable
            directory opens the store read-only.
        delete_probe: deleting a missing key succeeds when the right is held and is refused
            when it is not, so gc learns whether it may delete by deleting a random key that
            does not exist (S3, Azure). False: the rights are read some other way
            (``local_directory``) or not known before deleting.
        atomic_replace: a put over an existing key replaces it whole: a reader sees the old
            object or the new one, never a mix. The identity, key and mirror records are
            rewritten in place, so every backend must have it.
        consistent_listing: a listing shows every object whose put returned (read-after-write
            listing). gc's grace period and ``catalog rebuild`` rely on it, so every backend
            must have it.
    """

    local_directory: bool = False
    delete_probe: bool = True
    atomic_replace: bool = True
    consistent_listing: bool = True


# No capability says whether a backend can put only if the key is absent: nothing would read
# it. Content-addressed keys make a repeated put harmless, and the records written in place
# (identity, keys, mirrors) must replace what is there.
REQUIRED = ("atomic_replace", "consistent_listing")
"""Capabilities the engine cannot do without: a backend lacking one is refused when opened."""


@dataclass(frozen=True, slots=True)
class RoleGrants:
    """What one backend prints for a role (``casckpt init --print-grants``).

    Attributes:
        key: the key of ``document`` in ``--json`` output (``"s3_policy"``).
        title: the heading of the text output.
        document: the JSON document to hand the cloud's access management.
    """

    key: str
    title: str
    document: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Backend:
    """One storage backend: the value an entry point of :data:`GROUP` names.

    Attributes:
        scheme: the URL scheme it serves (``az`` for ``az://container/prefix``).
        example: a URL of its form, for messages (``az://container/prefix``).
        capabilities: what it guarantees (see :class:`Capabilities`).
        options: the options its ``[SCHEME]`` config table may hold, each with its type
            (:data:`~casckpt.config_file.TEXT`, ``INT``, ``NUMBER``); ``open`` takes
            exactly these.
        open: ``open(url, options, create)`` -> the store (already wrapped for retries where
            the backend is remote). ``create=False``: a location that should exist already.
        grants: ``grants(role, urls)`` -> what to print for ``role`` (``reader``, ``writer``,
            ``admin``) on the URLs of this scheme among ``urls`` (a placeholder when none);
            None: the backend has no access management to print (local directories).
    """

    scheme: str
    example: str
    capabilities: Capabilities
    open: Callable[[str, Mapping[str, Any], bool], BlobStore] = field(repr=False)
    options: Mapping[str, str] = field(default_factory=dict)
    grants: Callable[[str, Sequence[str]], RoleGrants] | None = field(default=None, repr=False)


@functools.cache
def _entry_points() -> dict[str, metadata.EntryPoint]:
    found = {ep.name: ep for ep in metadata.entry_points(group=GROUP)}
    if "file" not in found:  # casckpt's own declarations are missing: its metadata is stale
        raise InvalidArgumentError(
            f"no storage backends are registered (entry point group {GROUP!r} lacks casckpt's "
            "own): the installed casckpt's metadata is missing or older than its code; "
            "reinstall it (pip install -e . in a checkout, or pip install casckpt)")
    return found


@functools.cache
def _load(scheme: str) -> Backend:
    backend = _entry_points()[scheme].load()
    if not isinstance(backend, Backend) or backend.scheme != scheme:
        raise InvalidArgumentError(
            f"the entry point {scheme!r} of group {GROUP!r} names {backend!r}, not the "
            f"casckpt.storage.registry.Backend of scheme {scheme!r}; fix or uninstall the "
            "package that declares it")
    return backend


def schemes() -> list[str]:
    """Every registered scheme, sorted."""
    return sorted(_entry_points())


def backend(scheme: str) -> Backend:
    """The backend registered for ``scheme``.

    Raises:
        InvalidArgumentError: no backend serves ``scheme`` (the message lists those that do).
    """
    if scheme not in _entry_points():
        forms = ", ".join(["a directory", *(_load(s).example for s in schemes())])
        raise InvalidArgumentError(f"no storage backend serves {scheme or 'scheme-less'} URLs: "
                                   f"use {forms}")
    return _load(scheme)


def all_backends() -> list[Backend]:
    """Every registered backend, by scheme."""
    return [_load(s) for s in schemes()]


def role_grants(role: str, urls: list[str]) -> list[RoleGrants]:
    """What each backend prints for ``role`` (``casckpt init --print-grants``): the backends
    ``urls`` name, else (a new store, no URL yet) every one that prints anything."""
    printing = [b for b in all_backends() if b.grants is not None]
    named = [b for b in printing if any(u.startswith(f"{b.scheme}://") for u in urls)]
    return [b.grants(role, urls) for b in named or printing if b.grants is not None]


def backend_for(url: str) -> Backend:
    """The backend a location URL names (by its scheme).

    Raises:
        InvalidArgumentError: no backend serves its scheme (the message lists those that do),
            or the URL holds a credential.
    """
    if redact_url(url) != url:
        raise InvalidArgumentError(
            f"blob location {redact_url(url)!r} holds a credential: give credentials the way its "
            "backend documents (environment, profile, identity), never in the URL, which the "
            "catalog records and messages show")
    try:
        return backend(urlsplit(url).scheme)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"unsupported blob location {redact_url(url)!r}: {exc}") from None


def local_path(url: str) -> Path | None:
    """The directory a location URL names, if its backend keeps objects in a local directory
    (None for any other, and for a scheme no backend serves)."""
    scheme = urlsplit(url).scheme
    if scheme not in _entry_points() or not backend(scheme).capabilities.local_directory:
        return None
    return directory_of(url)


def directory_of(url: str) -> Path:
    """The absolute directory a ``file://`` URL names on this host.

    Raises:
        InvalidArgumentError: the URL names a host (``file://dir/x`` would otherwise name
            ``/x``, silently) or a relative path.
    """
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise InvalidArgumentError(
            f"blob location {redact_url(url)!r} does not name an absolute directory on this host: "
            "write file:///absolute/dir (three slashes), or give the directory as a plain path "
            "(a relative one is taken from the store's directory)")
    return Path(path)


def open_blob_store(url: str, options: BackendOptions | None = None, *,
                    create: bool = True) -> BlobStore:
    """Open the location ``url`` with the backend its scheme names, given that backend's
    options in ``options`` (``{"s3": {"endpoint_url": ...}}``).

    Remote backends come wrapped in :class:`~casckpt.storage.retry.RetryingBlobStore` (their
    ``retry_attempts`` option, 5 by default). ``create=False``: a directory that does not exist
    is an error, not made (buckets and containers are never made).

    Raises:
        InvalidArgumentError: no backend serves the scheme, or it lacks a capability in
            :data:`REQUIRED`.
        StorageError: the backend could not open it (``create`` is False and the directory
            does not exist; the SDK cannot be set up).
    """
    chosen = backend_for(url)
    missing = [name for name in REQUIRED if not getattr(chosen.capabilities, name)]
    if missing:
        raise InvalidArgumentError(
            f"the {chosen.scheme}:// backend lacks {', '.join(missing)}, which casckpt needs of "
            "every location; store checkpoints elsewhere")
    return chosen.open(url, dict((options or {}).get(chosen.scheme, {})), create)


def check_options(options: BackendOptions, where: str) -> None:
    """Check each registered backend's options in ``options`` against its declaration.

    ``where`` names their source for the message (a config file, ``s3=``). Tables of schemes
    no backend serves are left alone (a newer casckpt's, or a plug-in not installed here).

    Raises:
        InvalidConfigError: a backend's options are not a table, or hold an option it does
            not take or a value of the wrong type.
    """
    for scheme, table in options.items():
        if scheme not in _entry_points():
            continue
        if not isinstance(table, Mapping):
            raise InvalidConfigError(f"{where}: {scheme} must be an [{scheme}] table of options, "
                                     f"not {table!r}")
        check_table(table, backend(scheme).options, f"[{scheme}]", where, strict=True)
