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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from casckpt import errors
from casckpt._version import __version__ as __version__
from casckpt.config import BlobLocation
from casckpt.errors import CasckptError
from casckpt.options import Options
from casckpt.run import Run
from casckpt.types import (
    Advice,
    AuditEntry,
    CheckProblem,
    CheckReport,
    DrillReport,
    DrillResult,
    KeyInfo,
    MigrationReport,
    RetentionPolicy,
    RunInfo,
    RunNode,
    StoreStats,
    TagInfo,
    TensorChange,
    TensorHistoryEntry,
    TensorInfo,
    ValueChange,
    Version,
    VersionDetail,
    VersionDiff,
)

if TYPE_CHECKING:
    from casckpt.engine.background import CommitHandle
    from casckpt.storage import BlobStore
    from casckpt.store import Store


def __getattr__(name: str) -> Any:
    # torch is imported only when a store is used, so `casckpt --help` and
    # `import casckpt.errors` stay fast.
    if name == "Store":
        from casckpt.store import Store

        return Store
    if name == "CommitHandle":
        from casckpt.engine.background import CommitHandle

        return CommitHandle
    raise AttributeError(f"module 'casckpt' has no attribute {name!r}")


def generate_key_file(path: str | os.PathLike[str]) -> str:
    """Write a new random master key to ``path`` (mode 0600; an existing file is never
    overwritten) and return its public id. Keep it safe: a store whose every key is lost
    cannot be read by anyone, casckpt included.

    Raises:
        StoreKeyError: ``path`` exists or cannot be written.
    """
    from casckpt.engine.keyring import write_key_file
    from casckpt.format.crypto import key_id, new_master_key

    key = new_master_key()
    write_key_file(path, key)
    return key_id(key)


def open(  # noqa: A001 - the documented name of the entry point
    path: str | os.PathLike[str] | None = None, options: Options | None = None, *,
    blobs: (str | BlobLocation | BlobStore
            | Sequence[str | BlobLocation | BlobStore | Mapping[str, str]] | None) = None,
    catalog: str | None = None, cache: str | os.PathLike[str] | None = None,
    create: bool | None = None, chunk_size: int | None = None, pack_size: int | None = None,
    workers: int | None = None, s3: Mapping[str, Any] | None = None, redundancy: str | None = None,
    max_pending_commits: int | None = None, commit_memory: int | None = None,
    backpressure: str | None = None, staging_memory: int | None = None, recover: bool | None = None,
    key_file: str | os.PathLike[str] | None = None,
    read_only: bool | None = None, fast_tier: str | os.PathLike[str] | None = None,
    fast_tier_bytes: int | str | None = None, keep_fast_last: int | None = None,
) -> Store:
    """Open (or create) a store.

    With just ``path``: packs and manifests in that directory, the SQLite
    catalog (WAL) at ``path/catalog.db`` and the LMDB index cache in
    ``path/cache/``. A new or empty directory becomes a store; a non-empty
    directory that is not a store is refused. An older catalog schema is
    upgraded automatically (Alembic); a newer one is refused.

    Creation is atomic: any number of processes and threads opening the same
    new path at once (every rank of a job, say) all get the one store one of
    them created, with the same catalog and config file. Opening an existing
    store takes no lock.

    Everything besides ``path`` can come as one :class:`casckpt.Options` (checked when
    made: a bad value is an InvalidArgumentError naming the field), as keyword
    arguments, or both: a keyword argument given (not None) replaces the option.

    Args:
        path: the store's root directory.
        options: how to open it (the keyword arguments below are its fields).
        blobs: where packs live instead of ``path``: a directory, ``file:///dir`` or
            ``s3://bucket/prefix`` -- or several such locations (a list), each its
            own failure domain unless given as ``casckpt.BlobLocation(url,
            domain=..., name=...)`` or ``{"url": ..., "domain": ...}``. Recorded in
            ``path/casckpt.toml`` for a new store.
        catalog: an SQLAlchemy URL for the catalog instead of ``path/catalog.db``
            (e.g. ``postgresql+psycopg://user@host/db``). Recorded like ``blobs``.
        cache: directory for the local index cache (default ``path/cache`` for a
            self-contained store, else ``~/.cache/casckpt/<store id>``).
        create: False refuses to create a store that does not exist (pass it where one must
            already exist, such as a job that resumes). Creating one logs a WARNING naming
            where, and :attr:`Store.created` is True.
        chunk_size: overrides the default chunk size (see :mod:`casckpt.config`).
        pack_size: overrides the default pack size.
        workers: overrides the default number of worker threads.
        s3: S3 options for a new store (``endpoint_url``, ``region``, ``sse``,
            ``kms_key_id``, ``multipart_threshold``, ...), recorded in its
            config file's ``[s3]`` table. Credentials come from the AWS chain.
        redundancy: ``"none"`` (default), ``"replicate:N"`` or ``"ec:K+M"``
            (e.g. ``"ec:4+2"``: each pack as 4 data + 2 parity shards on 6
            failure domains; any 4 reconstruct it). Recorded in the catalog for a
            new store; for an existing one it must match (change it with
            :meth:`Store.set_redundancy`).
        max_pending_commits: background commits (``commit(..., block=False)``)
            in flight at once (default 2).
        commit_memory: bytes the background commits' copies of changed chunks
            may hold (default RAM/4, at most 8 GiB).
        backpressure: ``"block"`` (default) or ``"raise"`` when either bound is full.
        staging_memory: host bytes (pinned, with CUDA) that GPU tensors stream
            through on commit, in two reused buffers (default 256 MiB).
        recover: accept an empty catalog over locations that hold data, to rebuild
            it (:meth:`Store.rebuild_catalog`, `casckpt catalog rebuild`); until the
            rebuild ran, the store refuses to commit, gc or repair.
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
            while it holds the packs. ``Store.wait_durable`` waits for the drain, ``close``
            drains what is left. Recorded in ``casckpt.toml`` for a new store
            (docs/guides/fast-tier.md).
        fast_tier_bytes: the tier's budget (an int, or ``"200GiB"``; default half the free
            space of its disk): drained packs are evicted least recently used beyond it;
            packs not drained never are, and commits wait (``backpressure``) while those
            fill it.
        keep_fast_last: eviction keeps the packs of the newest N versions (default 1).

    Every location carries an identity record (store id, catalog generation);
    a catalog that is missing, emptied, stale or another store's is refused
    with StoreIdentityError before anything is written to it or to the locations.

    Raises:
        NotAStoreError: ``path`` is not a store and cannot become one.
        StoreIdentityError: the catalog and the locations are not of one store.
        SchemaTooNewError: the catalog was written by a newer casckpt.
        ReadOnlyStoreError: read-only, and the catalog's schema is older (upgrading it
            writes), or there is no store at ``path`` (creating one writes).
        CatalogError: the catalog database cannot be opened.
        InvalidArgumentError: a bad location list or redundancy spec.
        KeyRequiredError, WrongKeyError: the store is encrypted; no key, or not one of its keys.
        NotEncryptedError: a key was given for an existing store that is not encrypted.
    """
    from casckpt.opening import open_store

    if options is not None and not isinstance(options, Options):
        raise errors.InvalidArgumentError(f"options must be a casckpt.Options, got {options!r}")
    chosen = (options or Options()).with_given(
        blobs=blobs, catalog=catalog, cache=cache, create=create, chunk_size=chunk_size,
        pack_size=pack_size, workers=workers, s3=s3, redundancy=redundancy,
        max_pending_commits=max_pending_commits, commit_memory=commit_memory,
        backpressure=backpressure, staging_memory=staging_memory, recover=recover,
        key_file=key_file, read_only=read_only, fast_tier=fast_tier,
        fast_tier_bytes=fast_tier_bytes, keep_fast_last=keep_fast_last)
    return open_store(path, chosen)


__all__ = [
    "Advice",
    "AuditEntry",
    "BlobLocation",
    "CasckptError",
    "CheckProblem",
    "CommitHandle",
    "CheckReport",
    "DrillReport",
    "DrillResult",
    "KeyInfo",
    "MigrationReport",
    "Options",
    "RetentionPolicy",
    "Run",
    "RunInfo",
    "RunNode",
    "Store",
    "StoreStats",
    "TagInfo",
    "TensorChange",
    "TensorHistoryEntry",
    "TensorInfo",
    "ValueChange",
    "Version",
    "VersionDetail",
    "VersionDiff",
    "errors",
    "generate_key_file",
    "open",
]
