"""How a store is opened: :class:`Options`, validated once, the one place keyword arguments
of :func:`casckpt.open` and environment overrides (:func:`casckpt.config.settings`) meet."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from casckpt import config as cfg
from casckpt.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Options:
    """Everything :func:`casckpt.open` can be told besides the path, checked when made.

    A field left None takes the store's config file, then the environment
    (``CASCKPT_*``, see :mod:`casckpt.config`), then the default.

    Attributes:
        blobs: where packs live instead of the store's directory: a directory,
            ``file:///dir`` or ``s3://bucket/prefix``, or a list of such locations (each
            its own failure domain unless a :class:`casckpt.BlobLocation` or
            ``{"url", "domain"}`` says otherwise). Recorded in ``casckpt.toml`` for a new store.
        catalog: an SQLAlchemy URL for the catalog (PostgreSQL for many hosts).
        cache: the directory of this host's index cache.
        create: False refuses to create a store that does not exist (pass it where one must
            already exist, such as a job that resumes). Creating one logs a WARNING naming
            where, and ``Store.created`` is True.
        chunk_size, pack_size: bytes per chunk (1 MiB) and per pack (64 MiB).
        workers: threads for hashing, compression and reads.
        s3: S3 options of a new store (``endpoint_url``, ``region``, ``sse``, ...).
        redundancy: ``"none"``, ``"replicate:N"`` or ``"ec:K+M"``.
        max_pending_commits, commit_memory, backpressure: the bounds of background
            commits (2; RAM/4 up to 8 GiB; ``"block"`` or ``"raise"``).
        staging_memory: host bytes GPU tensors stream through on commit (256 MiB).
        recover: accept an empty catalog over locations holding data, to rebuild it.
        key_file: the master key file of an encrypted store (``CASCKPT_KEY_FILE``); given
            for a new store, the store is created encrypted.
        read_only: True opens the store for reads only (nothing in it is ever written; every
            write call raises :class:`~casckpt.errors.ReadOnlyStoreError`); None (default)
            does so when this process cannot write the store, with a
            :class:`~casckpt.errors.ReadOnlyStoreWarning`; False never (a write the
            credentials forbid then fails as it happens). ``CASCKPT_READ_ONLY`` when None.
        fast_tier: a directory on this host's fast local disk: commits land there (at local
            disk speed) and drain to the locations in the background; restores read from
            it while it holds the packs (see ``Store.wait_durable``). Recorded in
            ``casckpt.toml`` for a new store.
        fast_tier_bytes: the tier's budget (an int or ``"200GiB"``; default: half the free
            space of its disk when opened); drained packs beyond it are evicted.
        keep_fast_last: the newest N versions whose packs eviction keeps on the tier (1).
        background_drain: False: no drain worker thread, and ``close`` does not drain; only
            ``Store.drain`` drains the fast tier (the CLI opens stores so, but for commands
            that commit: looking at a store never uploads as a side effect).
    """

    blobs: object = None  # str | BlobLocation | BlobStore, or a list of those (or mappings)
    catalog: str | None = None
    cache: str | os.PathLike[str] | None = None
    create: bool = True
    chunk_size: int | None = None
    pack_size: int | None = None
    workers: int | None = None
    s3: Mapping[str, Any] | None = None
    redundancy: str | None = None
    max_pending_commits: int | None = None
    commit_memory: int | None = None
    backpressure: str | None = None
    staging_memory: int | None = None
    recover: bool = False
    key_file: str | os.PathLike[str] | None = None
    read_only: bool | None = None
    fast_tier: str | os.PathLike[str] | None = None
    fast_tier_bytes: int | str | None = None
    keep_fast_last: int | None = None
    background_drain: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_size", "pack_size", "workers", "max_pending_commits", "commit_memory",
                     "staging_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidArgumentError(f"Options.{name} must be a positive int, got {value!r}")
        for name in ("create", "recover", "background_drain"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"Options.{name} must be True or False, got {getattr(self, name)!r}")
        if self.read_only is not None and not isinstance(self.read_only, bool):
            raise InvalidArgumentError(
                f"Options.read_only must be True, False or None, got {self.read_only!r}")
        if self.backpressure is not None and self.backpressure not in ("block", "raise"):
            raise InvalidArgumentError(
                f"Options.backpressure must be 'block' or 'raise', got {self.backpressure!r}")
        for name in ("catalog", "redundancy"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"Options.{name} must be a str, got {getattr(self, name)!r}")
        if self.key_file is not None and not isinstance(self.key_file, (str, os.PathLike)):
            raise InvalidArgumentError(f"Options.key_file must be a path, got {self.key_file!r}")
        if self.fast_tier is not None and not isinstance(self.fast_tier, (str, os.PathLike)):
            raise InvalidArgumentError(f"Options.fast_tier must be a directory path, got {self.fast_tier!r}")
        if self.fast_tier_bytes is not None:
            cfg.parse_size(self.fast_tier_bytes, "Options.fast_tier_bytes")
        if self.keep_fast_last is not None and (not isinstance(self.keep_fast_last, int) or isinstance(
                self.keep_fast_last, bool) or self.keep_fast_last < 0):
            raise InvalidArgumentError(
                f"Options.keep_fast_last must be an int >= 0, got {self.keep_fast_last!r}")
        if self.s3 is not None and not isinstance(self.s3, Mapping):
            raise InvalidArgumentError(f"Options.s3 must be a mapping of S3 options, got {self.s3!r}")
        if self.redundancy is not None:
            from casckpt.storage.erasure import Redundancy

            try:
                Redundancy.parse(self.redundancy)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"Options.redundancy: {exc}") from exc

    def with_given(self, **given: Any) -> Options:
        """These options with the keyword arguments that were given (not None) instead."""
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise InvalidArgumentError(f"no such option: {', '.join(sorted(unknown))}")
        chosen = {k: v for k, v in given.items() if v is not None}
        return replace(self, **chosen) if chosen else self

    def settings(self, env: Mapping[str, str] = os.environ) -> cfg.Settings:
        """The pipelines' settings: defaults, then ``env``, then these options."""
        return cfg.settings({"chunk_size": self.chunk_size, "pack_size": self.pack_size,
                             "workers": self.workers, "max_pending_commits": self.max_pending_commits,
                             "commit_memory": self.commit_memory, "backpressure": self.backpressure,
                             "staging_memory": self.staging_memory}, env)
