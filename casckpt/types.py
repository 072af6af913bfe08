"""Public value types returned by :class:`casckpt.Store`.

Versions, runs, tensors, diffs and retention are defined here; the reports of storage
administration (stats, check, locations, repair, rebuilds) in :mod:`casckpt.reports`,
importable from here as well.

All are frozen, slotted dataclasses: safe to share between threads, cheap to
build, and convertible to plain JSON with :meth:`to_dict` (the CLI's ``--json``);
:func:`dumps` writes any of them (or a structure of them) as strict JSON text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from casckpt.jsonable import ToDict
from casckpt.jsonable import dumps as dumps
from casckpt.jsonable import to_json_value as to_json_value
from casckpt.mirror_rules import MirroredVersion as MirroredVersion
from casckpt.mirror_rules import MirrorFailure as MirrorFailure
from casckpt.mirror_rules import MirrorInfo as MirrorInfo
from casckpt.mirror_rules import MirrorReport as MirrorReport
from casckpt.mirror_rules import MirrorSelection as MirrorSelection
from casckpt.reports import Advice as Advice
from casckpt.reports import CheckProblem as CheckProblem
from casckpt.reports import CheckReport as CheckReport
from casckpt.reports import CopiedVersion as CopiedVersion
from casckpt.reports import CopyReport as CopyReport
from casckpt.reports import DrainReport as DrainReport
from casckpt.reports import DrillReport as DrillReport
from casckpt.reports import DrillResult as DrillResult
from casckpt.reports import KeyInfo as KeyInfo
from casckpt.reports import LocationInfo as LocationInfo
from casckpt.reports import MigrationReport as MigrationReport
from casckpt.reports import RebuildReport as RebuildReport
from casckpt.reports import RepairReport as RepairReport
from casckpt.reports import StoreStats as StoreStats
from casckpt.reports import TierInfo as TierInfo
from casckpt.reports import TierLoss as TierLoss
from casckpt.reports import TierStatus as TierStatus
from casckpt.retention_rules import RetentionPolicy as RetentionPolicy


def human_bytes(n: float) -> str:
    """``1288490189`` -> ``"1.2 GiB"``; below 1 KiB the exact count (``"512 B"``)."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "PiB":
            break
    return f"{size:.1f} {unit}"


ProgressCallback = Callable[[str, int, int], None]
"""``callback(phase, done, total)``: called from the calling thread as work advances.

``phase`` names the stage (``"hash"``, ``"write"``, ``"read"``, ``"check"``);
``done`` and ``total`` are bytes for data stages and items otherwise. A restore
waiting for storage it cannot reach reports ``"wait"`` about once a second: seconds
waited so far, of the storage retry budget (``CASCKPT_STORAGE_RETRY_S``).
"""


@dataclass(frozen=True, slots=True)
class Version(ToDict):
    """One committed checkpoint.

    Attributes:
        id: 64 hex digits, BLAKE3 of the version's manifest; any unique prefix is a ref.
        run: the run the version belongs to.
        step: the training step it was committed at (unique within the run).
        created_at: when the commit started (UTC).
        logical_bytes: bytes of tensor data in the state.
        new_bytes: raw bytes of chunks the store did not hold before this commit.
        stored_bytes: encoded (compressed) bytes written for those chunks; pack
            headers and footers are not counted (``StoreStats.pack_bytes`` has them).
        duration_s: wall time of the commit.
        parent: id of the previous version of the run (None for the first).
        tags: tag names pointing at this version.
        metadata, metrics, message: what the caller passed to ``commit``.
        degraded: set on the version a commit returns (blocking, a background
            handle's ``wait()``, a group commit): True when a pack the commit wrote
            could not be placed as its redundancy asks -- a shard recorded missing
            (its location refused it), shards doubled up in one failure domain, or
            fewer shards than the scheme; a WARNING names the locations. The data
            is committed; ``casckpt repair`` restores the redundancy. Versions read
            back from the catalog (``log``, ``resolve``, ...) say False: ask
            ``Store.show(ref).degraded`` for a version's state now.
        durability: ``"durable"``: every byte is on the store's locations, with their
            redundancy. ``"fast"``: committed to a host's fast tier (``fast_tier=``) and
            not yet drained to the locations -- restorable on that host only, lost if that
            disk is lost first (``store.tier.wait_durable`` waits for the drain). ``"lost"``:
            its fast tier was lost before the drain; it cannot be restored.
        stall_s: how long the commit held the caller up, in seconds: a blocking commit's
            whole wall time (``duration_s``); a background commit's (``block=False``) time
            until ``commit()`` returned (waiting for room, and the snapshot). None for
            versions committed before casckpt recorded it (schema 0011) and for versions a
            catalog rebuild restored. ``casckpt advise`` reads it.
    """

    id: str
    run: str
    step: int
    created_at: datetime
    logical_bytes: int
    new_bytes: int
    stored_bytes: int
    duration_s: float
    parent: str | None = None
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    message: str | None = None
    degraded: bool = False
    durability: str = "durable"
    stall_s: float | None = None

    @property
    def short_id(self) -> str:
        """The first 12 hex digits of :attr:`id`."""
        return self.id[:12]


@dataclass(frozen=True, slots=True)
class TensorInfo(ToDict):
    """One tensor of a version, as the catalog records it.

    ``shards``: how many pieces ranks saved it as (1: whole); ``split_dims``:
    the dimensions along which those pieces cut it.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    digest: str
    shards: int = 1
    split_dims: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class VersionDetail(ToDict):
    """A version together with its tensors and plain values (``Store.show``).

    ``world_size`` is how many ranks saved the version (None: one process,
    ``Store.commit``); ``saved_with`` how: ``"dcp"`` (torch.distributed.checkpoint,
    tensors sharded) or ``"group"`` (``Store.commit(group=)``, one state per
    rank: paths ``rankN/...``). ``delta_chunks`` of its chunks are stored as
    deltas, the deepest ``longest_chain`` deltas from a keyframe (``version``'s
    ``new_bytes`` vs ``stored_bytes`` tell what its new chunks cost).

    ``degraded`` says whether the version is below its redundancy *now*: some
    pack holding its chunks (or their delta bases) has a shard that is not ok,
    sits on a failed location, or shares a failure domain with another of the
    pack's shards, as the catalog records them; ``degraded_packs`` counts those
    packs and ``degraded_detail`` says what is wrong with the first few. False
    again once ``repair`` has restored them.
    """

    version: Version
    tensors: tuple[TensorInfo, ...]
    values: Mapping[str, Any]
    world_size: int | None = None
    saved_with: str | None = None
    delta_chunks: int = 0  # of the version's chunks, those stored as deltas
    longest_chain: int = 0  # deltas decoded to read its deepest chunk
    degraded: bool = False
    degraded_packs: int = 0
    degraded_detail: str | None = None
    tensor_count: int = 0  # the summary (also with ``show(ref, tensors=False)``)
    tensor_bytes: int = 0
    tensor_groups: tuple[TensorGroup, ...] = ()  # by the first part of the path (group_tensors)


def group_tensors(sizes: Iterable[tuple[str, int]]) -> tuple[TensorGroup, ...]:
    """Tensors by the first part of their path (``model``, ``optim``; ``rank1/model``), with
    their count and bytes, in natural order: the summary ``casckpt show`` prints."""
    return sorted_groups((name, n, size) for name, (n, size) in group_sizes(sizes).items())


def group_sizes(sizes: Iterable[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """Tensors by the first part of their path: head -> (count, bytes), in first-seen order."""
    found: dict[str, list[int]] = {}
    for path, nbytes in sizes:
        slot = found.setdefault(path.partition(".")[0], [0, 0])
        slot[0] += 1
        slot[1] += nbytes
    return {head: (n, b) for head, (n, b) in found.items()}


def sorted_groups(groups: Iterable[tuple[str, int, int]]) -> tuple[TensorGroup, ...]:
    """``(name, tensors, bytes)`` as :class:`TensorGroup` values, in natural order of their names."""
    return tuple(TensorGroup(*g) for g in sorted(groups, key=lambda g: natural_key(g[0])))


@dataclass(frozen=True, slots=True)
class TensorGroup(ToDict):
    """Tensors whose paths start with ``name`` (:attr:`VersionDetail.groups`)."""

    name: str
    tensors: int
    nbytes: int


def natural_key(path: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting ``layers.2`` before ``layers.10`` (digit runs compare as numbers)."""
    return tuple((0, int(part)) if part.isascii() and part.isdigit() else (1, part)
                 for part in _DIGITS.split(path) if part)


_DIGITS = re.compile(r"([0-9]+)")


@dataclass(frozen=True, slots=True)
class RunInfo(ToDict):
    """A run and a summary of its versions."""

    name: str
    created_at: datetime
    versions: int
    latest_step: int | None
    latest_id: str | None
    logical_bytes: int


@dataclass(frozen=True, slots=True)
class TagInfo(ToDict):
    """A tag and the version it points at (:meth:`casckpt.Store.tags`).

    Attributes:
        name: the tag's name (``tag:NAME`` is a ref).
        created_at: when the tag was last pointed at a version: set, or moved (UTC).
        version: the version it points at.
    """

    name: str
    created_at: datetime
    version: Version


@dataclass(frozen=True, slots=True)
class RetentionDecision(ToDict):
    """Whether retention keeps one version, and the rules that keep it."""

    version: Version
    keep: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RetentionPlan(ToDict):
    """Retention applied to one run: a decision per visible version, newest first."""

    run: str
    policy: RetentionPolicy | None
    decisions: tuple[RetentionDecision, ...]

    @property
    def deleted(self) -> tuple[Version, ...]:
        """The versions retention removes."""
        return tuple(d.version for d in self.decisions if not d.keep)


@dataclass(frozen=True, slots=True)
class GCRun(ToDict):
    """One gc run as the catalog recorded it (``casckpt gc --history``).

    Its counts grow in the transactions that delete what they count, so a run killed with
    -9 (no JSON line, no report) still shows what it committed; ``bytes_freed`` and
    ``orphans_deleted`` are recorded right after each batch of objects goes (objects are
    not in a transaction: a kill between the two loses that batch's count).

    Attributes:
        outcome: ``finished``, ``failed`` (``error`` says why) or ``unfinished`` (killed, or
            still running).
    """

    id: int
    started_at: float
    finished_at: float | None
    host: str
    pid: int
    outcome: str
    versions_deleted: int
    versions_purged: int
    chunks_swept: int
    packs_deleted: int
    orphans_deleted: int
    bytes_freed: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GCReport(ToDict):
    """What one garbage collection did (or, with ``dry_run``, would do).

    Attributes:
        bytes_freed: bytes of the objects this run deleted (a dry run: would delete).
        bytes_pending: stored bytes of chunks found unreferenced but left in place for the
            grace period; a later run frees them (with ``grace=0``, this run does).
        kept: objects gc could not prove to be garbage, and why (see ``casckpt check``).
        space_counted: False for a dry run on a read-only store: it plans retention and counts
            the versions it would delete and purge, but marks nothing (marking writes gc's
            own catalog table), so every chunk, pack, object and byte count is 0, not known.
    """

    dry_run: bool
    grace_s: float
    retention: tuple[RetentionPlan, ...]
    versions_deleted: int
    versions_purged: int
    chunks_condemned: int
    chunks_revived: int
    chunks_swept: int
    packs_deleted: int
    packs_repacked: int
    orphans_deleted: int
    bytes_freed: int
    duration_s: float
    bytes_pending: int = 0
    chunks_kept_as_bases: int = 0  # unreferenced by any version, kept as delta bases
    leftovers_deleted: int = 0  # staging and temporary files of dead commits, killed checkouts' files
    kept: tuple[str, ...] = ()
    space_counted: bool = True

    def summary(self) -> dict[str, Any]:
        """The report without per-version retention decisions: counts, and per run how many
        versions retention keeps and deletes (what a cron log needs, one short line of JSON)."""
        out = {k: v for k, v in self.to_dict().items() if k != "retention"}
        out["retention"] = {plan.run: {"kept": len(plan.decisions) - len(plan.deleted),
                                       "deleted": len(plan.deleted)} for plan in self.retention}
        return out

    def describe(self) -> str:
        """One readable line: what this run did (a dry run: would do)."""
        verb = "would delete" if self.dry_run else "deleted"
        if not self.space_counted:
            return (f"gc {verb} {self.versions_deleted} version(s) by retention and purge "
                    f"{self.versions_purged} deleted version(s); space not counted (a read-only "
                    "store marks nothing: run the dry run with write access for the bytes)")
        parts = [f"{self.versions_deleted} version(s) by retention",
                 f"{self.versions_purged} deleted version(s) purged",
                 f"{self.chunks_swept} chunk(s) swept", f"{self.packs_deleted} pack(s)",
                 f"{self.orphans_deleted} orphan object(s)"]
        line = f"gc {verb} {', '.join(parts)}: {human_bytes(self.bytes_freed)} freed"
        if self.packs_repacked:
            line += f"; repacked {self.packs_repacked} pack(s)"
        if self.bytes_pending:
            pending = human_bytes(self.bytes_pending)
            line += f"; {pending} more {'would be' if self.dry_run else 'is'} freed by a " \
                    f"gc after the {self.grace_s:g} s grace period"
        if self.kept:
            line += f"; kept {len(self.kept)} object(s) it could not prove garbage (see the log)"
        return line


@dataclass(frozen=True, slots=True)
class TensorChange(ToDict):
    """One tensor that differs between two versions (``Store.diff``).

    ``change`` is ``"added"``, ``"removed"`` or ``"changed"``; the ``*_before``
    fields are None for an added tensor, the ``*_after`` ones for a removed one.
    ``changed_bytes``: for a changed tensor, the bytes of its chunks that differ
    (chunk lists compared position by position; the whole tensor when dtype,
    shape or chunk size differ); for an added or removed one, its whole size.
    """

    path: str
    change: str
    dtype_before: str | None
    dtype_after: str | None
    shape_before: tuple[int, ...] | None
    shape_after: tuple[int, ...] | None
    nbytes_before: int
    nbytes_after: int
    changed_bytes: int


@dataclass(frozen=True, slots=True)
class ValueChange(ToDict):
    """One plain (non-tensor) value that differs between two versions.

    ``change`` is ``"added"``, ``"removed"`` or ``"changed"``; ``before`` /
    ``after`` are None where the value is absent (``change`` says which).
    """

    path: str
    change: str
    before: Any
    after: Any


@dataclass(frozen=True, slots=True)
class VersionDiff(ToDict):
    """What changed from version ``a`` to version ``b`` (``Store.diff``).

    ``changed_bytes`` sums ``TensorChange.changed_bytes`` over every entry of
    ``added``, ``removed`` and ``changed``; ``unchanged`` counts tensors whose
    content is identical in both.
    """

    a: Version
    b: Version
    added: tuple[TensorChange, ...]
    removed: tuple[TensorChange, ...]
    changed: tuple[TensorChange, ...]
    unchanged: int
    changed_bytes: int
    values: tuple[ValueChange, ...]


@dataclass(frozen=True, slots=True)
class TensorHistoryEntry(ToDict):
    """A version in which one tensor changed (``Store.history``).

    ``change`` is ``"added"`` (first appearance, or back after a removal),
    ``"changed"`` or ``"removed"``. ``dtype``, ``shape``, ``nbytes`` and
    ``digest`` describe the tensor in ``version`` (None / 0 once removed);
    ``changed_bytes`` counts against the previous entry as in :class:`TensorChange`.
    """

    version: Version
    change: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    digest: str | None
    changed_bytes: int


@dataclass(frozen=True, slots=True)
class RunNode(ToDict):
    """A run in the lineage (``store.lineage``).

    ``parent_run`` / ``fork_step`` are None for a root run, and also when the
    version it was forked from is gone (``fork_version`` then keeps its id).
    """

    name: str
    created_at: datetime
    parent_run: str | None
    fork_version: str | None
    fork_step: int | None
    children: tuple[str, ...]
    versions: int


@dataclass(frozen=True, slots=True)
class AuditEntry(ToDict):
    """One row of the store's audit trail (``store.ops.audit``, ``casckpt audit``).

    Attributes:
        id: its position in the trail (increasing).
        at: when the change committed (UTC).
        action: what was done: ``commit``, ``delete``, ``tag``, ``gc``, ``location.add``, ...
            (docs/guides/audit.md lists them).
        target: what it was done to: a version id, ``run:NAME``, ``tag:NAME``,
            ``location:NAME``; None for the whole store (gc, repair, migrate).
        detail: the particulars, as JSON (a commit's run, step and new bytes; gc's counts).
        os_user, host, pid: the process that made the change.
        db_user: the PostgreSQL role it connected as (None on SQLite).
        casckpt_version: the casckpt that made it.
    """

    id: int
    at: datetime
    action: str
    target: str | None
    detail: Mapping[str, Any]
    os_user: str
    host: str
    pid: int
    db_user: str | None
    casckpt_version: str
