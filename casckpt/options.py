"""How a store is opened: :class:`Options`, declared once, checked by :func:`check` (which
:func:`casckpt.open` calls before anything is made), the one place option values and
environment overrides (:func:`casckpt.config.settings`) meet."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

from casckpt import config as cfg
from casckpt.errors import InvalidArgumentError

if TYPE_CHECKING:
    from casckpt.storage import BlobStore

    Blob = str | cfg.BlobLocation | BlobStore


class Options(TypedDict, total=False):
    """Everything :func:`casckpt.open` can be told besides the path: build one with
    ``casckpt.Options(chunk_size=..., ...)`` (a dict; a type checker checks its names and
    types), or pass its fields to ``casckpt.open`` as keywords. ``casckpt.open`` checks it
    before anything is created: an unknown name or a bad value is an
    :class:`~casckpt.errors.InvalidArgumentError` naming the field.

    A field left out (or None) takes the store's config file, then the environment
    (``CASCKPT_*``, see :mod:`casckpt.config`), then the default.

    Attributes:
        blobs: where packs live instead of the store's directory: a directory,
            ``file:///dir`` or ``s3://bucket/prefix`` -- or several such locations (a list),
            each its own failure domain unless given as ``casckpt.BlobLocation(url,
            domain=..., name=...)`` or ``{"url": ..., "domain": ...}``. Recorded in
            ``casckpt.toml`` for a new store.
        catalog: an SQLAlchemy URL for the catalog instead of ``path/catalog.db``
            (e.g. ``postgresql+psycopg://user@host/db``). Recorded like ``blobs``.
        cache: directory for the local index cache (default ``path/cache`` for a
            self-contained store, else ``~/.cache/casckpt/<store id>``).
        create: False refuses to create a store that does not exist (pass it where one must
            already exist, such as a job that resumes). Creating one logs a WARNING naming
            where, and ``Store.created`` is True. Default True.
        chunk_size: bytes per chunk, rounded down to whole elements per tensor (default
            1 MiB; :mod:`casckpt.config` lists the environment variables).
        pack_size: a pack is closed once it holds at least this many bytes (default 64 MiB).
        workers: threads for hashing, compression and reads (BLAKE3, zstd and file I/O
            release the GIL).
        s3: S3 options for a new store (``endpoint_url``, ``region``, ``sse``,
            ``kms_key_id``, ``multipart_threshold``, ...), recorded in its config file's
            ``[s3]`` table. Credentials come from the AWS chain.
        redundancy: ``"none"`` (default), ``"replicate:N"`` or ``"ec:K+M"`` (e.g. ``"ec:4+2"``:
            each pack as 4 data + 2 parity shards on 6 failure domains; any 4 reconstruct
            it). Recorded in the catalog for a new store; for an existing one it must match
            (change it with ``store.locations.set_redundancy``).
        max_pending_commits: background commits (``commit(..., block=False)``) in flight at
            once (default 2).
        commit_memory: bytes the background commits' host staging and copies may hold
            (default RAM/4, at most 8 GiB).
        backpressure: when either bound is full, ``"block"`` (default) the next commit until
            there is room, or ``"raise"`` CommitBackpressureError.
        staging_memory: host bytes (pinned, with CUDA) that GPU tensors stream through on
            commit, in two reused buffers (default 256 MiB).
        recover: accept an empty catalog over locations that hold data, to rebuild it
            (``store.ops.rebuild_catalog``, `casckpt catalog rebuild`); until the rebuild ran,
            the store refuses to commit, gc or repair. Default False.
        key_file: the master key file of an encrypted store (default: ``CASCKPT_KEY_FILE``).
            Given for a new store, the store is created encrypted: every object on every
            location sealed (AES-256-GCM), chunk ids keyed; see docs/SECURITY.md.
        read_only: True opens the store for reads only: restore, load_tensor, log, show,
            diff, history, check (no repair), checkout, export and DCP loads work; nothing
            in the store is written (no migration, no cache, no lease, no healing) and every
            write call raises ReadOnlyStoreError before touching anything. None (default):
            read-only when this process cannot write the store (the directory, a local
            location or the catalog), with a ReadOnlyStoreWarning. False: never
            (``CASCKPT_READ_ONLY`` decides when None; docs/guides/read-only.md).
        fast_tier: a directory on this host's fast local disk (NVMe): commits land there
            at local disk speed, their versions ``durability="fast"``, and a background
            drain stores them on the locations (then ``"durable"``); restores read from it
            while it holds the packs. ``store.tier.wait_durable`` waits for the drain,
            ``close`` drains what is left. Recorded in ``casckpt.toml`` for a new store
            (docs/guides/fast-tier.md).
        fast_tier_bytes: the tier's budget (an int, or ``"200GiB"``; default half the free
            space of its disk): drained packs are evicted least recently used beyond it;
            packs not drained never are, and commits wait (``backpressure``) while those
            fill it.
        keep_fast_last: eviction keeps the packs of the newest N versions (default 1).
        background_drain: False: no drain worker thread, and ``close`` does not drain; only
            ``store.tier.drain`` drains the fast tier (the CLI opens stores so, but for
            commands that commit: looking at a store never uploads as a side effect).
            Default True.
    """

    blobs: Blob | Sequence[Blob | Mapping[str, str]] | None
    catalog: str | None
    cache: str | os.PathLike[str] | None
    create: bool
    chunk_size: int | None
    pack_size: int | None
    workers: int | None
    s3: Mapping[str, Any] | None
    redundancy: str | None
    max_pending_commits: int | None
    commit_memory: int | None
    backpressure: str | None
    staging_memory: int | None
    recover: bool
    key_file: str | os.PathLike[str] | None
    read_only: bool | None
    fast_tier: str | os.PathLike[str] | None
    fast_tier_bytes: int | str | None
    keep_fast_last: int | None
    background_drain: bool


FIELDS = frozenset(Options.__optional_keys__)
"""The names an :class:`Options` may hold."""

_POSITIVE = ("chunk_size", "pack_size", "workers", "max_pending_commits", "commit_memory", "staging_memory")
_FLAGS = ("create", "recover", "background_drain", "read_only")
_PATHS = ("cache", "key_file", "fast_tier")


def check(given: Mapping[str, Any]) -> Options:
    """``given`` as checked :class:`Options` (a new dict; values left as given).

    Raises:
        InvalidArgumentError: not a mapping, an unknown name (the closest field suggested),
            or a bad value (naming its field).
    """
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(f"options must be a casckpt.Options (a mapping of option "
                                   f"names to values), got {given!r}")
    for name in given:
        if name not in FIELDS:
            near = difflib.get_close_matches(str(name), sorted(FIELDS), n=1)
            suggestion = f"; did you mean {near[0]!r}?" if near else \
                f"; the options are {', '.join(sorted(FIELDS))}"
            raise InvalidArgumentError(f"no such option: {name!r}{suggestion}")
    for name, value in given.items():
        _check_value(name, value)
    return cast(Options, dict(given))  # every name and value checked above


def _check_value(name: str, value: Any) -> None:  # noqa: C901 - one branch per kind of field
    def bad(want: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"Options.{name} must be {want}, got {value!r}")

    if value is None:  # left to the config file, the environment or the default
        return
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise bad("True, False or None")
    elif name in _POSITIVE:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise bad("a positive int")
    elif name == "backpressure":
        if value not in ("block", "raise"):
            raise bad("'block' or 'raise'")
    elif name in ("catalog", "redundancy"):
        if not isinstance(value, str):
            raise bad("a str")
        if name == "redundancy":
            from casckpt.storage.erasure import Redundancy

            try:
                Redundancy.parse(value)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"Options.redundancy: {exc}") from exc
    elif name in _PATHS:
        if not isinstance(value, (str, os.PathLike)):
            raise bad("a path")
    elif name == "fast_tier_bytes":
        cfg.parse_size(value, "Options.fast_tier_bytes")
    elif name == "keep_fast_last":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad("an int >= 0")
    elif name == "s3" and not isinstance(value, Mapping):
        raise bad("a mapping of S3 options")


def settings(options: Options, env: Mapping[str, str] = os.environ) -> cfg.Settings:
    """The pipelines' settings: defaults, then ``env``, then ``options``."""
    return cfg.settings({name: options.get(name) for name in (*_POSITIVE, "backpressure")}, env)
