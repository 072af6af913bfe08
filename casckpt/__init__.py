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
from collections.abc import Sequence
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
    from typing_extensions import Unpack

    from casckpt.engine.write.commithandle import CommitHandle
    from casckpt.store import Store


def __getattr__(name: str) -> Any:
    # torch is imported only when a store is used, so `casckpt --help` and
    # `import casckpt.errors` stay fast.
    if name == "Store":
        from casckpt.store import Store

        return Store
    if name == "CommitHandle":
        from casckpt.engine.write.commithandle import CommitHandle

        return CommitHandle
    raise AttributeError(f"module 'casckpt' has no attribute {name!r}")


def generate_key_file(path: str | os.PathLike[str]) -> str:
    """Write a new random master key to ``path`` (mode 0600; an existing file is never
    overwritten) and return its public id. Keep it safe: a store whose every key is lost
    cannot be read by anyone, casckpt included.

    Raises:
        StoreKeyError: ``path`` exists or cannot be written.
    """
    from casckpt.engine.maintenance.keyring import write_key_file
    from casckpt.format.crypto import key_id, new_master_key

    key = new_master_key()
    write_key_file(path, key)
    return key_id(key)


def grants(role: str, *, role_name: str | None = None, urls: Sequence[str] = ()) -> dict[str, Any]:
    """What role ``role`` (``reader``, ``writer`` or ``admin``; docs/guides/roles.md) may do,
    as the grants to give it: ``{"role", "role_name", "sql": [GRANT statement, ...],
    "s3_policy": {...}, ...}`` -- the PostgreSQL GRANTs on the catalog's tables (to
    ``role_name``, default ``casckpt_<role>``), then one document per storage backend the
    ``urls`` name (every backend's, with placeholders, when none does): ``s3_policy`` (an S3
    IAM policy), ``azure_role`` (an Azure role definition). Creates nothing and connects to
    nothing (``casckpt init --print-grants ROLE``).

    Raises:
        InvalidArgumentError: an unknown role, or a role name that is not an SQL identifier.
    """
    from casckpt.catalog import grants as catalog_grants
    from casckpt.storage.registry import role_grants

    name = catalog_grants.check_role_name(
        role_name or catalog_grants.default_role_name(catalog_grants.check_role(role)))
    doc: dict[str, Any] = {"role": role, "role_name": name,
                           "sql": catalog_grants.grant_statements(role, name)}
    doc.update((g.key, g.document) for g in role_grants(role, list(urls)))
    return doc


def open(  # noqa: A001 - the documented name of the entry point
    path: str | os.PathLike[str] | None = None, options: Options | None = None,
    **overrides: Unpack[Options],
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

    Every location carries an identity record (store id, catalog generation);
    a catalog that is missing, emptied, stale or another store's is refused
    with StoreIdentityError before anything is written to it or to the locations.

    Args:
        path: the store's root directory (None: a store named by ``blobs`` and
            ``catalog`` alone).
        options: how to open it: a :class:`casckpt.Options` (its fields are documented there).
        **overrides: fields of :class:`casckpt.Options` as keywords
            (``casckpt.open(path, create=False, fast_tier="/nvme")``), each replacing the
            field of ``options`` it names (None included: the config file, environment or
            default then decides).

    Raises:
        InvalidArgumentError: an option that is not a field of :class:`casckpt.Options` (the
            closest field suggested), a bad value (naming its field), a bad location list
            or redundancy spec. Nothing is created or opened before the options are checked.
        NotAStoreError: ``path`` is not a store and cannot become one.
        StoreIdentityError: the catalog and the locations are not of one store.
        SchemaTooNewError: the catalog was written by a newer casckpt.
        ReadOnlyStoreError: read-only, and the catalog's schema is older (upgrading it
            writes), or there is no store at ``path`` (creating one writes).
        CatalogError: the catalog database cannot be opened.
        KeyRequiredError, WrongKeyError: the store is encrypted; no key, or not one of its keys.
        NotEncryptedError: a key was given for an existing store that is not encrypted.
    """
    from casckpt.opening import open_store
    from casckpt.options import check

    chosen = check(options if options is not None else {})
    return open_store(path, check({**chosen, **overrides}))


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
    "grants",
    "open",
]
