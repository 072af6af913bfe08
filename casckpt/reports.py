"""What the storage-administration calls of :class:`casckpt.Store` report: space, check,
locations, repair, catalog rebuild, tree migration, restore drills, interval advice.

Frozen, slotted dataclasses like every public value type (see :mod:`casckpt.types`, which
re-exports them: ``from casckpt.types import CheckReport`` keeps working).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from casckpt.jsonable import ToDict


@dataclass(frozen=True, slots=True)
class StoreStats(ToDict):
    """Space accounting for the whole store.

    ``logical_bytes`` sums every version's tensor bytes (what N torch.save files
    would hold); ``unique_bytes`` is the raw size of distinct chunks;
    ``stored_bytes`` their encoded size; ``pack_bytes`` the packs in full (headers, footers);
    ``location_bytes`` what the blob locations hold for them (every copy and
    shard, parity included); ``redundancy`` the scheme new packs get.

    Delta coding: ``delta_chunks`` chunks are stored as deltas against a base
    chunk, ``delta_raw_bytes`` raw in ``delta_stored_bytes``; chains are at
    most ``longest_chain`` deltas deep (``mean_chain`` on average);
    ``delta_chain`` is the store's policy (deltas before a keyframe, 0: off)
    and ``run_delta_chains`` the runs with their own.

    ``versions_without_tree`` are read through per-tensor catalog rows: versions saved by
    many ranks (DCP, ``commit(group=)``), and versions from before tree manifests until
    ``casckpt catalog migrate-trees`` converts them (``store.ops.migrate_trees``).
    """

    runs: int
    versions: int
    tags: int
    chunks: int
    packs: int
    logical_bytes: int
    unique_bytes: int
    stored_bytes: int
    pack_bytes: int
    location_bytes: int = 0
    redundancy: str = "none"
    delta_chunks: int = 0
    delta_raw_bytes: int = 0
    delta_stored_bytes: int = 0
    longest_chain: int = 0
    mean_chain: float = 0.0
    delta_chain: int = 0
    run_delta_chains: Mapping[str, int] = field(default_factory=dict)
    versions_without_tree: int = 0

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per unique byte (higher is better)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        """Unique bytes per stored byte (higher is better)."""
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True, slots=True)
class CheckProblem(ToDict):
    """One inconsistency found by ``store.ops.check``."""

    kind: str
    subject: str
    detail: str


@dataclass(frozen=True, slots=True)
class CheckReport(ToDict):
    """What ``store.ops.check`` looked at and what it found."""

    versions: int
    packs: int
    chunks: int
    chunks_read: int
    bytes_read: int
    problems: tuple[CheckProblem, ...]
    packs_read: int = 0
    warnings: tuple[str, ...] = ()  # worth knowing, nothing wrong with the data (``ok`` ignores them)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


@dataclass(frozen=True, slots=True)
class LocationInfo(ToDict):
    """A blob location and what it holds.

    Attributes:
        name: how commands refer to it.
        url: where it is (credentials redacted).
        domain: its failure domain.
        state: ``active``, ``retiring`` (repair moves its shards off) or
            ``failed`` (never read; repair re-creates its shards elsewhere).
        shards: pack copies or shards recorded on it.
        bytes: their total size.
        damaged: those of them known missing or corrupt.
        reachable: whether it answered a real request (a read of its identity record)
            within the probe timeout, with this store's record: measured when the
            value was made, not assumed.
        reason: why it is not reachable (None when it is): a short line, credentials
            redacted.
        probe_s: how long the probe took, in seconds (the timeout, when it got no answer).
    """

    name: str
    url: str
    domain: str
    state: str
    shards: int
    bytes: int
    damaged: int
    reachable: bool
    reason: str | None = None
    probe_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RepairReport(ToDict):
    """What ``store.ops.repair`` did.

    Attributes:
        packs: packs that needed repair (and could be worked on).
        shards_rewritten: shards written again (re-encoded or copied).
        shards_moved: of those, shards placed on another location than before.
        unrepaired: ``pack id: reason`` for each pack left short of full redundancy.
        catalog_manifests_restored: damaged manifests in the catalog replaced by a
            verified copy from a location.
        manifests_written: manifest copies written to locations that lacked them (or
            held a differing copy).
        records_written: ``refs/`` records written to locations that lacked them (or
            held a stale one), and records of removed mirrors deleted where they were left.
        tree_nodes_restored: tree nodes whose catalog row was missing or damaged, restored
            from their verified copy in the packs.
        degraded: ``pack id: what`` for each pack with shards still sharing a failure
            domain (too few domains active to spread them).
    """

    packs: int
    shards_rewritten: int
    shards_moved: int
    unrepaired: tuple[str, ...]
    duration_s: float
    catalog_manifests_restored: int = 0
    manifests_written: int = 0
    records_written: int = 0
    degraded: tuple[str, ...] = ()
    tree_nodes_restored: int = 0

    @property
    def ok(self) -> bool:
        """True when every pack is back at full redundancy, on distinct failure domains."""
        return not self.unrepaired and not self.degraded

    @property
    def nothing_to_do(self) -> bool:
        """True when repair found every pack, manifest and record where it belongs."""
        return self.ok and not (self.packs or self.catalog_manifests_restored or self.manifests_written
                                or self.records_written or self.tree_nodes_restored)


@dataclass(frozen=True, slots=True)
class RebuildReport(ToDict):
    """What ``store.ops.rebuild_catalog`` recovered from the blob locations.

    Attributes:
        packs, chunks, versions, runs, tags: what the new catalog now holds.
        lost_packs: packs found with too few readable shards (their chunks are gone).
        skipped: ``version id: reason`` for manifests that could not be restored.
    """

    packs: int
    chunks: int
    versions: int
    runs: int
    tags: int
    lost_packs: tuple[str, ...]
    skipped: tuple[str, ...]
    duration_s: float


@dataclass(frozen=True, slots=True)
class MigrationReport(ToDict):
    """What ``store.ops.migrate_trees`` did (see :mod:`casckpt.engine.maintenance.treemigrate`).

    Attributes:
        versions_migrated: versions of manifest format 1 that got a tree in this run.
        versions_left: versions of format 1 left without one because their manifest does
            not verify (`casckpt check` says why; `casckpt repair` may restore it). A version
            deleted while the run worked is skipped, not counted.
        nodes_written: tree nodes written to the packs (the others were there already).
        tensor_rows_deleted: ``tensors`` rows the migrated versions no longer need.
        seconds: how long the run took.
        versions_indexed: tree versions whose ``tree_changes`` rows (what tensor history
            reads) this run recorded: migrated ones, and those committed without them.
    """

    versions_migrated: int
    versions_left: int
    nodes_written: int
    tensor_rows_deleted: int
    seconds: float
    versions_indexed: int = 0


@dataclass(frozen=True, slots=True)
class KeyInfo(ToDict):
    """One master key of an encrypted store (its slot in the key record; never the key).

    Attributes:
        id: the key's public id (16 hex digits, derived from the key; reveals nothing of it).
        created_at: when it was added (seconds since the epoch).
        created_by: ``user@host`` that added it.
        in_use: whether this store handle was opened with it.
    """

    id: str
    created_at: float
    created_by: str
    in_use: bool


@dataclass(frozen=True, slots=True)
class DrainReport(ToDict):
    """What one drain of a fast tier did (``store.tier.drain``, ``casckpt drain``).

    Attributes:
        packs, bytes: packs (and their bytes) stored on the locations and made durable.
        versions: versions that became durable.
        lost_packs, lost_versions: packs found gone from the tier before they drained, and
            the versions lost with them.
        evicted_bytes: drained packs evicted afterwards to keep the tier within its budget.
        seconds: wall time.
        busy: another process of this host was draining the tier (nothing was done).
        error: why the drain stopped early (what it did until then is counted); it resumes
            on the next drain.
    """

    packs: int = 0
    bytes: int = 0
    versions: int = 0
    lost_packs: tuple[str, ...] = ()
    lost_versions: tuple[str, ...] = ()
    evicted_bytes: int = 0
    seconds: float = 0.0
    busy: bool = False
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TierInfo(ToDict):
    """One host's fast tier as the catalog knows it.

    Attributes:
        id: the tier's id (its directory's ``casckpt-tier`` record).
        host, path: where it is.
        state: ``active`` or ``lost``.
        undrained_packs, undrained_bytes: packs still waiting on it for the drain.
        this_host: whether it is the tier this store handle uses.
    """

    id: str
    host: str
    path: str
    state: str
    created_at: float
    lost_at: float | None
    undrained_packs: int
    undrained_bytes: int
    this_host: bool


@dataclass(frozen=True, slots=True)
class TierStatus(ToDict):
    """Where a store's bytes are, by tier (``store.tier.status``, ``casckpt tier status``).

    Attributes:
        durable_bytes: bytes of the packs on the store's locations (before redundancy).
        versions: visible versions per durability (``durable``, ``fast``, ``lost``).
        not_durable: ids of the visible versions not durable yet (oldest first, at most 100).
        tiers: every fast tier the catalog knows.
        local_path: this handle's fast tier directory (None: opened without one).
        budget: its budget in bytes (``fast_tier_bytes``).
        held_bytes, held_packs: what it holds now (drained packs kept as a cache included).
        drained_bytes, drain_seconds: what every drain of this tier moved, and how long that
            took (the drain rate is their ratio).
        disk_bytes, disk_free: the size of the file system holding this host's tier and the
            bytes free on it (None: no tier, or the file system could not be asked).
        warnings: what makes the tier's budget untrue: a budget larger than its file system,
            or too little free space there for the next pack (commits then store their packs
            on the locations).
    """

    durable_bytes: int
    versions: dict[str, int]
    not_durable: tuple[str, ...]
    tiers: tuple[TierInfo, ...]
    local_path: str | None = None
    budget: int | None = None
    held_bytes: int = 0
    held_packs: int = 0
    drained_bytes: int = 0
    drain_seconds: float = 0.0
    disk_bytes: int | None = None
    disk_free: int | None = None
    warnings: tuple[str, ...] = ()

    @property
    def drain_rate(self) -> float | None:
        """Bytes per second this tier drains at (None before it drained anything)."""
        return self.drained_bytes / self.drain_seconds if self.drain_seconds > 0 else None


@dataclass(frozen=True, slots=True)
class TierLoss(ToDict):
    """A fast tier declared lost by hand (``store.tier.forget``, ``casckpt tier forget``).

    Attributes:
        tier: the tier's id.
        host, path: where it was.
        packs: the packs that were still waiting on it to drain, lost with it.
        versions: the versions needing one of those packs, now ``lost``.
    """

    tier: str
    host: str
    path: str
    packs: tuple[str, ...]
    versions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DrillResult(ToDict):
    """One version a restore drill read back (``store.ops.drill``, ``store.ops.drill_history``).

    Attributes:
        drill_id: the drill run it belongs to (every version of one ``store.ops.drill`` call
            shares it).
        at: when the version's restore started, UTC epoch seconds.
        version_id, run, step: the version.
        bytes: its tensor bytes (``Version.logical_bytes``): what the drill read back when ok.
        seconds: how long the restore took (into memory, every byte verified), or failed after.
        ok: it restored whole.
        error: why not (the typed error's message), None when ok.
    """

    drill_id: str
    at: float
    version_id: str
    run: str
    step: int
    bytes: int
    seconds: float
    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class DrillReport(ToDict):
    """What one restore drill found (``store.ops.drill``, ``casckpt drill``).

    ``recorded``: the results are in the catalog's ``drills`` table (``store.ops.drill_history``);
    False when the store is read-only (the drill ran, nothing was written).
    """

    drill_id: str
    results: tuple[DrillResult, ...]
    recorded: bool = True

    @property
    def ok(self) -> bool:
        """Every version drilled restored."""
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> tuple[DrillResult, ...]:
        """The versions that did not restore."""
        return tuple(r for r in self.results if not r.ok)


@dataclass(frozen=True, slots=True)
class Advice(ToDict):
    """The checkpoint interval advised for a run (``store.ops.advise``, ``casckpt advise``).

    Inputs, measured: ``checkpoint_cost_s`` (C: median training-visible stall of the run's
    recent commits, ``Version.stall_s``), ``restore_s`` (median seconds of the run's successful
    drill restores, or of one restore measured now: ``restore_source`` is ``"drills"`` or
    ``"measured"``), ``restart_s`` (given; R = ``restore_s + restart_s``), ``mtbf_s`` (M:
    given). ``current_interval_s`` / ``current_interval_steps``: median time and
    step difference between consecutive commits; ``step_rate``: steps per second over them.

    Advice: ``advised_interval_s`` (Daly's higher-order optimum), ``young_interval_s``
    (Young's sqrt(2CM)), ``advised_interval_steps`` (the advised interval at the step rate,
    at least 1). ``expected_overhead`` (fraction of wall time lost to checkpoints and to
    failures, C/tau + (tau/2 + R)/M) and ``expected_lost_work_s`` (per failure, tau/2 + R):
    each ``{"current": ..., "advised": ...}``. docs/guides/drills-and-intervals.md has the
    formulas and their assumptions.
    """

    run: str
    checkpoint_cost_s: float
    restore_s: float
    restore_source: str
    restart_s: float
    mtbf_s: float
    advised_interval_s: float
    young_interval_s: float
    advised_interval_steps: int
    current_interval_s: float
    current_interval_steps: float
    step_rate: float
    expected_overhead: Mapping[str, float]
    expected_lost_work_s: Mapping[str, float]
    commits: int


@dataclass(frozen=True, slots=True)
class CopiedVersion(ToDict):
    """One version of a copy between stores (``Store.copy``, ``casckpt copy``).

    Attributes:
        source_id: its id in the source store.
        id: its id in the destination: the same between stores keyed alike (the manifest's
            bytes travel unchanged); another one across keys (the version is committed again
            under the destination's keyed ids), empty in a dry run across keys.
        run, step: where it is, on both sides.
        asked: a ref of the copy named it (else it is an ancestor its lineage needed).
        sent: it was published at the destination by this copy (False: the destination held
            it already, or another copy running at the same time published it first; a dry
            run: it would be).
        chunks: chunks and tree nodes this copy sent for it, read from the source and stored
            at the destination (also when another copy published it first; a dry run: that
            would be).
        bytes: their raw bytes (a dry run across keys: the version's logical bytes, all of
            which are read).
    """

    source_id: str
    id: str
    run: str
    step: int
    asked: bool
    sent: bool
    chunks: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class CopyReport(ToDict):
    """What a copy between stores did (``Store.copy``, ``casckpt copy``), or, with
    ``dry_run``, would do.

    Attributes:
        versions: every version of the copy, ancestors first.
        chunks: chunks and tree nodes sent (read from the source, written at the destination).
        bytes: their raw bytes.
        stored_bytes: what the destination stored for the tensor chunks among them (after its
            compression; tree nodes apart, as commits count them).
        tags: tags set or moved at the destination.
        tags_kept: the source's tags on copied versions that the destination has on versions of
            its own (not copies from the source): left there, never taken over.
        dry_run: nothing was written.
        seconds: wall time.
        degraded_packs: packs this copy stored at the destination below their redundancy (a
            location there refused shards, or too few failure domains), as a degraded commit
            is (``Version.degraded``; a WARNING names the locations): the versions are copied
            and readable; ``casckpt repair`` on the destination restores the redundancy. A copy
            across keys commits each version there: those commits log their own WARNING, and
            the packs each stored below its redundancy are counted here too.
    """

    versions: tuple[CopiedVersion, ...] = ()
    chunks: int = 0
    bytes: int = 0
    stored_bytes: int = 0
    tags: tuple[str, ...] = ()
    tags_kept: tuple[str, ...] = ()
    dry_run: bool = False
    seconds: float = 0.0
    degraded_packs: int = 0

    @property
    def nothing_sent(self) -> bool:
        """The destination held everything: no version published, no chunk sent."""
        return self.chunks == 0 and not any(v.sent for v in self.versions)

    @property
    def ids(self) -> dict[str, str]:
        """Source version id -> destination version id, for every version of the copy."""
        return {v.source_id: v.id for v in self.versions}
