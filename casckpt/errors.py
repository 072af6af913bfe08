"""The casckpt error hierarchy.

Every error casckpt raises on purpose is a :class:`CasckptError`. Subclasses
also subclass the matching builtin (``KeyError``, ``ValueError``, ``OSError``),
so callers can catch either. Messages say what went wrong *and* what to do.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

_LISTED = 10
"""How many names a "not found" message lists before it says how many more there are."""


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error of ``cls`` with ``args`` and attributes ``state``, its ``__init__`` not called
    (what unpickling an error whose ``__init__`` takes other arguments than its message needs)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class CasckptError(Exception):
    """Root of every error casckpt raises on purpose."""


class UnsupportedStateError(CasckptError, TypeError):
    """The state holds an object casckpt cannot store faithfully."""


class InvalidNameError(CasckptError, ValueError):
    """A run name, tag name or state key is not allowed (it could escape a directory)."""


class InvalidArgumentError(CasckptError, ValueError):
    """An argument has the wrong type or value."""


class ChangeHintError(InvalidArgumentError):
    """A commit's change hint (``unchanged=``) is demonstrably wrong: a tensor declared
    unchanged has another dtype or shape than in the run's previous version."""


class NotAStoreError(CasckptError, FileNotFoundError):
    """A path that should hold a store does not hold one."""


class SchemaTooNewError(CasckptError, RuntimeError):
    """The catalog was written by a newer casckpt than this one."""


class CatalogError(CasckptError, RuntimeError):
    """The catalog database failed or holds something inconsistent."""


class CatalogUnavailableError(CatalogError):
    """The catalog database cannot be reached (an outage, a restart, a network cut).

    Nothing became visible, unless ``in_doubt`` is true: the connection was lost
    while the database was committing, so the change may have been committed
    (a published version is then whole and correct; ``casckpt show`` tells). A
    training loop may keep training and commit again at its next interval; the
    first commit after the database is back succeeds.
    """

    in_doubt: bool = False


class InvalidConfigError(InvalidArgumentError):
    """A store's config file cannot be decoded or holds a bad value."""


class ForkedStoreError(CasckptError, RuntimeError):
    """A process forked from the one that opened a store used it (its connections, pools and
    cache belong to the parent): open the store again in the child."""


def refuse_forked(opened_by: int) -> None:
    """Refuse a store's use in a process forked from ``opened_by``, the one that opened it: a
    child inherits the parent's catalog connections, thread pools, commit worker and LMDB
    environment, none of which it can use (a commit there waited forever on the pools' dead
    threads; a SQLite connection or LMDB environment shared across a fork can corrupt them).

    Raises:
        ForkedStoreError: this process is not ``opened_by``.
    """
    here = os.getpid()
    if here != opened_by:
        raise ForkedStoreError(
            f"this store was opened by process {opened_by} and this process ({here}) is a fork "
            "of it: its catalog connections, thread pools and cache belong to the parent. Open "
            "the store again in this process (casckpt.open), e.g. in a DataLoader worker's "
            "worker_init_fn or at the top of a multiprocessing target")


class StoreIdentityError(CasckptError, RuntimeError):
    """The catalog and a blob location are not of the same store: the catalog is missing,
    empty, stale or another store's. Nothing was changed; the message says how to recover."""


class GCRefusedError(CasckptError, RuntimeError):
    """GC found something the catalog cannot account for and refused to delete anything
    (a circuit breaker); the message says what to look at, and ``--force`` overrides it."""


class GCRunningError(CasckptError, RuntimeError):
    """Another garbage collection holds the store's GC lock."""


class RefNotFoundError(CasckptError, KeyError):
    """A ref names no version."""

    def __init__(self, ref: str, reason: str, near: Sequence[str] = ()) -> None:
        self.ref = ref
        self.near = tuple(near)
        suggestion = f" Did you mean: {', '.join(self.near)}?" if self.near else ""
        super().__init__(f"{ref!r}: {reason}.{suggestion}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes (this and every subclass)
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class VersionNotFound(RefNotFoundError):
    """Alias kept for readability at call sites: a ref that resolves to no version."""


class AmbiguousRefError(CasckptError, KeyError):
    """An id prefix matches more than one version."""

    def __str__(self) -> str:
        return str(self.args[0])


class TensorNotFoundError(CasckptError, KeyError):
    """A version holds no tensor at the requested path."""

    def __str__(self) -> str:
        return str(self.args[0])


class VersionExistsError(CasckptError, ValueError):
    """A run already has a version at the step being committed."""


class RestoreTargetError(CasckptError, ValueError):
    """``into`` does not match the stored state (missing keys, wrong shapes or dtypes)."""


class UnreadableCheckpointError(InvalidArgumentError):
    """A checkpoint file or directory given to ``import_checkpoint`` cannot be read as what
    it claims to be (a forged or truncated safetensors header, a damaged DCP directory, a
    format casckpt does not import). Nothing was committed; ``path`` names the file."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class UnsafeCheckpointError(UnreadableCheckpointError):
    """A pickle given to ``import_checkpoint`` needs code execution to load (``torch.load``
    with ``weights_only=True`` refused a global it names); it was not loaded, so no code ran.
    Convert it in a trusted environment to safetensors or a weights-only state dict."""


class IntegrityError(CasckptError, ValueError):
    """Stored bytes are not what they should be."""


class CorruptChunkError(IntegrityError):
    """A chunk's bytes do not hash to its id, or its record is damaged."""

    def __init__(self, message: str, *, pack_id: str | None = None, chunk_id: str | None = None):
        self.pack_id = pack_id
        self.chunk_id = chunk_id
        super().__init__(message)


class CorruptPackError(IntegrityError):
    """A pack is truncated, forged, or its footer does not match its contents."""


class CorruptManifestError(IntegrityError):
    """A manifest cannot be decoded or does not hash to its version id."""


class VersionMismatchError(IntegrityError):
    """The manifest a ref led to is not the version the catalog said it is (another run,
    step or id): the catalog is damaged; no data of the wrong version is returned."""


class MissingDataError(IntegrityError):
    """A chunk, pack or manifest the catalog references is not in the blob store."""


class StorageError(CasckptError, OSError):
    """A blob store operation failed."""


class StorageFullError(StorageError):
    """A location has no room: disk full, quota exceeded or a file-size limit hit.

    Nothing half-written became visible. ``location`` names it and ``needed``
    is the size of the object that did not fit (None when unknown).
    """

    def __init__(self, message: str, *, location: str | None = None, needed: int | None = None) -> None:
        self.location = location
        self.needed = needed
        super().__init__(message)


class UnsafeObjectError(StorageError):
    """An object's path is not a regular file inside its location (a FIFO, a device, a
    directory, a symlink leaving the location); it is never opened for reading."""


class OversizedObjectError(StorageError):
    """An object is larger than its reader expects (the size the catalog records); it was
    refused before its bytes were read, so a damaged or forged object cannot exhaust memory."""


class EncodeWorkerError(StorageError):
    """An erasure-coding worker process died (killed, out of memory) or could not start while
    encoding a pack; that pack was not stored, so the commit that wrote it published nothing."""


class RetryableStorageError(StorageError):
    """A blob store operation failed in a way that may succeed if tried again."""


class BlobNotFoundError(StorageError, FileNotFoundError):
    """The blob store holds no object under the requested key."""


class StoreUnavailableError(RetryableStorageError):
    """Too few of the locations holding what a read needs could be reached (connections
    dropped, timeouts, throttling, access denied) within the storage retry budget
    (``CASCKPT_STORAGE_RETRY_S``). Nothing was found missing or damaged, and no shard was
    marked for repair: the same read may succeed once the storage is back."""


class RunExistsError(InvalidArgumentError):
    """A run of that name already exists (``fork`` needs a new name)."""


class RunNotFoundError(RefNotFoundError):
    """There is no run of the name asked for. The message suggests the nearest names, or
    lists the runs there are when none is near; ``near`` holds the suggestions (as
    ``run@latest`` refs when a ref named the run)."""

    def __init__(self, run: str, runs: Sequence[str], *, ref: str | None = None) -> None:
        self.run = run
        close = difflib.get_close_matches(run, list(runs), n=3)
        reason = "there is no run with that name" if ref is None else f"there is no run named {run!r}"
        if not close:
            reason += f"; runs: {_listing(runs)}" if runs else "; the store has no runs yet"
        super().__init__(run if ref is None else ref, reason,
                         close if ref is None else [f"{n}@latest" for n in close])


class MetricNotFoundError(RefNotFoundError):
    """No version of the run records the metric asked for (``best``). The message suggests
    the nearest metric names, or lists the metrics the run's versions record."""

    def __init__(self, metric: str, run: str, recorded: Sequence[str]) -> None:
        self.metric = metric
        self.run = run
        close = difflib.get_close_matches(metric, list(recorded), n=3, cutoff=0.4)
        reason = f"no version of run {run!r} records this metric"
        if not close:
            reason += (f"; its versions record: {_listing(recorded)}" if recorded else
                       "; its versions record no metrics (commit(..., metrics={...}) records them)")
        super().__init__(metric, reason, close)


class VersionSweptError(RefNotFoundError):
    """A deleted version cannot be undeleted: GC already swept (some of) its data."""


class BackgroundCommitError(CasckptError, RuntimeError):
    """A background commit failed and nobody waited on its handle; raised by the next
    commit or by ``close()``. The original error is the ``__cause__``."""


class CommitBackpressureError(CasckptError, RuntimeError):
    """Background commits are at their limit and the store was opened with ``backpressure="raise"``."""


class CommitTimeoutError(CasckptError, TimeoutError):
    """``CommitHandle.wait(timeout)`` ran out of time; the commit goes on."""


class GroupCommitError(CasckptError, RuntimeError):
    """A commit by a process group failed on some rank; every rank raises it, naming the ranks
    and their errors (this rank's own error, if any, is the ``__cause__``). Nothing was published."""


class UnsupportedFileError(InvalidArgumentError):
    """``add_dir`` met something it cannot store byte-identically (a fifo, socket or device,
    or a name that is not UTF-8); the message names it. Nothing was stored."""


class NotADirectorySnapshotError(InvalidArgumentError):
    """``checkout`` was asked for a version that is not a directory snapshot (one ``commit``
    stored): ``restore`` reads it back as a state."""


class CheckoutTargetError(RestoreTargetError):
    """``checkout``'s target exists and is not an empty directory (nothing was touched), or
    writing next to it failed (no space, no permission: nothing was left at the target)."""


class CheckoutMismatchError(CheckoutTargetError):
    """``checkout(reuse=True)``'s target holds something other than the snapshot (the message
    names the first difference); nothing was touched."""


class FileHashMismatchError(IntegrityError):
    """A file written by ``checkout`` does not hash to the BLAKE3 recorded when it was added
    (it changed while ``add_dir`` read it, or the snapshot is forged); nothing was left at the
    target."""


class CheckpointCommitError(BackgroundCommitError):
    """A framework integration's background commit of a checkpoint failed; the local checkpoint
    it was storing is kept. The store's error is the ``__cause__``."""


class CheckpointPathNotFoundError(RefNotFoundError):
    """A framework asked for a checkpoint by a path the store holds no version for (never
    saved through casckpt, removed since, or saved to another run)."""


class MixedCheckpointError(CasckptError, ValueError):
    """A framework's checkpoint directory holds files of one save and the store's version for
    that directory is of another (a later save into the directory was killed after the
    framework wrote its own files, before the store's version was published): loading would
    mix the two. The message names the version and how to load one explicitly."""


class OptionalDependencyError(CasckptError, ImportError):
    """An integration needs a library that is not installed; the message names the extra."""


class AccessDeniedError(CasckptError, PermissionError):
    """The credentials in use lack a right an operation needs (deleting objects, deleting
    catalog rows, writing a location). ``right`` names it; nothing was changed."""

    def __init__(self, message: str, *, right: str | None = None) -> None:
        self.right = right
        super().__init__(message)


class ReadOnlyStoreError(AccessDeniedError):
    """The store was opened read-only (``read_only=True``, ``--read-only``, or because it
    could not be written), and the call needs to write; ``right`` names what it needed."""


class StoreKeyError(CasckptError, PermissionError):
    """A key problem on an encrypted store: a key is required, the key given opens none of
    the store's key slots, or the key file itself is unusable."""


class KeyRequiredError(StoreKeyError):
    """The store is encrypted and no key was given (``key_file=`` or ``CASCKPT_KEY_FILE``)."""


class WrongKeyError(StoreKeyError):
    """The key given unwraps none of the store's data keys."""


class NotEncryptedError(InvalidArgumentError):
    """A key was given for a store that is not encrypted (or a key command run on one)."""


class LastKeyError(InvalidArgumentError):
    """Removing this master key would leave the store with none: refused."""


class SealedObjectError(UnsafeObjectError):
    """An object of an encrypted store fails authentication: altered, swapped for another,
    truncated, extended, written without encryption, or sealed under another store's key.
    Its bytes are refused unread (a shard with redundancy is reconstructed from the others)."""
class ReadOnlyStoreWarning(UserWarning):
    """A store was opened read-only because this process cannot write it (the catalog, the
    store directory or a location); the message says which. Not raised: warned, once per open."""


class VersionNotDurableError(CasckptError):
    """The version is committed to another host's fast tier and not drained to the store's
    locations yet: it cannot be read from here until it is (``store.tier.wait_durable``)."""


class VersionLostError(MissingDataError):
    """The version was committed to a fast tier that was lost (wiped, its host gone) before it
    drained: it cannot be restored. Versions committed before it are not affected."""


class DrainTimeoutError(CasckptError, TimeoutError):
    """``store.tier.wait_durable`` (or ``commit(durable=True)``) gave up waiting for a drain."""


class TierNotFoundError(RefNotFoundError):
    """No fast tier of the store has this id (``casckpt tier status`` lists them)."""


class CopyTargetError(InvalidArgumentError):
    """``Store.copy`` was asked to copy a store into itself (the same store id on both sides),
    or into something that is not another open store."""


class CopyConflictError(VersionExistsError):
    """A copy's destination holds another version at a copied version's run and step: the
    two stores' runs diverged. Nothing of that version was published."""


class CopyUnsupportedError(InvalidArgumentError):
    """A copy this version of casckpt does not make: of a version of manifest format 1 or 2,
    or, between stores whose chunk ids are keyed differently, of a version many ranks saved.
    The message says what to do instead."""


class MirrorDestinationError(CasckptError):
    """A mirror's destination store could not be opened (unreachable, not a store, a wrong
    key). The run is recorded as failed on the mirror (``casckpt mirror status``); the message
    says what to check."""


class MirrorsFailedError(MirrorDestinationError):
    """``store.mirrors.push_all``: the destinations of some mirrors could not be opened; every
    other mirror ran. A :class:`MirrorDestinationError` (what ``push_all`` raised before), that
    carries what the caller would otherwise lose.

    Attributes:
        reports: the report (a :class:`casckpt.types.MirrorReport`) of each mirror that ran, by name.
        errors: the name of each mirror that could not run -> its MirrorDestinationError, by name.
    """

    def __init__(self, reports: Sequence[Any], errors: Mapping[str, MirrorDestinationError]) -> None:
        self.reports = tuple(reports)
        self.errors = dict(sorted(errors.items()))
        total = len(self.reports) + len(self.errors)
        super().__init__(
            f"{len(self.errors)} of {total} mirrors could not run (their destinations could not be "
            f"opened; the others ran): " + "; ".join(str(e) for e in self.errors.values()))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes, with its reports and errors
        return _rebuilt, (type(self), self.args, dict(self.__dict__))
