"""A copy's plan: which versions the destination gets, and which chunks it lacks.

Pure reads of both stores (the source's catalog and tree nodes, the destination's catalog);
nothing is written, so a dry run is this plan printed. A version is planned with its
ancestors up to the nearest one the destination holds (as git pushes the commits a branch
needs): a manifest names its parent, and the version id is the manifest's hash, so the
parent must be there for the version to arrive as the same version. An ancestor the source
no longer shows (deleted) ends the chain: the copied version then names a parent neither
store shows, as it did on the source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from casckpt.catalog import Catalog
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.rows import VersionRow
from casckpt.engine.versions.nodes import StoreNodes
from casckpt.errors import CasckptError, CopyConflictError, CopyUnsupportedError
from casckpt.format import treeread
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.merkle import NodeSource

__all__ = ["CopyPlan", "VersionPlan", "chain", "movable_tags", "plan", "refuse_foreign_run"]


@dataclass(frozen=True, slots=True)
class VersionPlan:
    """One version of a copy, as the source holds it.

    Attributes:
        row: the source's catalog row.
        manifest: its compressed manifest (the same bytes travel: the same version id).
        present: the destination shows it already (nothing of it is sent).
        asked: named by the copy's refs (else an ancestor the lineage needs).
        tags: the source's tags on it that are set on the destination too.
        kept_tags: the source's tags on it that the destination has on a version of its own
            (one no copy from the source made), left there (:func:`movable_tags`).
        ids: every chunk and tree node it references.
        nodes: its tree nodes' raw bytes (verified against their ids), by id.
        send: the ids among ``ids`` the destination lacks and no earlier version of the copy
            brings, in order.
        send_bytes: their raw bytes.
        aligns: element size of each chunk's tensor (what the destination's encoder groups by).
        root: its tree's root node.
    """

    row: VersionRow
    manifest: bytes
    present: bool
    asked: bool
    tags: tuple[str, ...] = ()
    kept_tags: tuple[str, ...] = ()
    ids: tuple[bytes, ...] = ()
    nodes: Mapping[bytes, bytes] = field(default_factory=dict)
    send: tuple[bytes, ...] = ()
    send_bytes: int = 0
    aligns: Mapping[bytes, int] = field(default_factory=dict)
    root: bytes | None = None


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Every version of a copy, ancestors before descendants."""

    versions: tuple[VersionPlan, ...]

    @property
    def send_bytes(self) -> int:
        """Raw bytes of the chunks and nodes the destination lacks."""
        return sum(v.send_bytes for v in self.versions)

    @property
    def send_chunks(self) -> int:
        """How many chunks and nodes the destination lacks."""
        return sum(len(v.send) for v in self.versions)


class _Recorded(NodeSource):
    """The source's nodes (catalog, then packs), each kept raw once read."""

    def __init__(self, inner: StoreNodes) -> None:
        self.inner, self.chunk_ids = inner, inner.chunk_ids
        self.raw: dict[bytes, bytes] = {}

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        wanted = [i for i in ids if i not in self.raw]
        if wanted:
            self.raw.update(self.inner.get_many(wanted))
        return {i: self.raw[i] for i in ids if i in self.raw}


def chain(source: Catalog, dest: Catalog, asked: Sequence[VersionRow],
          held_by: Callable[[VersionRow], bool] | None = None, *,
          lineage: bool = True) -> list[tuple[VersionRow, bool]]:
    """The versions a copy of ``asked`` publishes, ancestors first, each with whether it was
    asked for: every asked version, and each ancestor up to the nearest one ``dest`` holds
    (``held_by``; default: shows a version of the same id). Without ``lineage``: the asked
    versions alone (each then names a parent the destination may not show, as a version
    whose ancestors were deleted does)."""
    if not lineage:
        return [(row, True) for row in asked]
    out: dict[str, tuple[VersionRow, bool]] = {}
    wanted = {row.id for row in asked}
    for row in asked:
        line: list[VersionRow] = []
        current: VersionRow | None = row
        while current is not None and current.id not in out:
            held = held_by(current) if held_by is not None else _held(dest, current, current.id in wanted)
            if held and current.id not in wanted:
                break
            line.append(current)
            if held or current.parent_id is None:
                break
            current = source.version(current.parent_id)
        for ancestor in reversed(line):
            out.setdefault(ancestor.id, (ancestor, ancestor.id in wanted))
    return list(out.values())


def _held(dest: Catalog, row: VersionRow, asked: bool) -> bool:
    """Whether ``dest`` holds ``row``: shows it, or holds it deleted (an ancestor deleted there
    ends the lineage a copy brings: deletions at the destination are not undone).

    Raises:
        CopyConflictError: a version asked for is deleted at the destination.
    """
    if dest.version(row.id) is not None:
        return True
    if not retention_sql.find_deleted(dest, prefix=row.id, limit=1):
        return False
    if asked:
        raise CopyConflictError(
            f"the destination holds version {row.id[:12]} ({row.run}@{row.step}) deleted: undelete it "
            f"there (`casckpt undelete {row.id[:12]}`), or let its gc purge it, then copy again")
    return True


def plan(source: Catalog, dest: Catalog, asked: Sequence[VersionRow], source_nodes: StoreNodes, *,
         lineage: bool = True) -> CopyPlan:
    """What copying ``asked`` from ``source`` to ``dest`` sends (see module).

    Raises:
        CopyConflictError: the destination holds another version at one's run and step.
        CopyUnsupportedError: a version is of manifest format 1 or 2 (not migrated to a tree).
        CorruptManifestError, MissingDataError: the source cannot read a version's tree.
    """
    planned: list[VersionPlan] = []
    sending: set[bytes] = set()
    checked: set[str] = set()
    for row, was_asked in chain(source, dest, asked, lineage=lineage):
        if _held(dest, row, was_asked):
            planned.append(VersionPlan(row, b"", True, was_asked, *movable_tags(source, dest, row.id)))
            continue
        _refuse_conflict(dest, row)
        refuse_foreign_run(source, dest, row.run, checked)
        found = _plan_version(source, dest, row, was_asked, source_nodes, sending)
        if found is not None:
            planned.append(found)
    return CopyPlan(tuple(planned))


def movable_tags(source: Catalog, dest: Catalog, version_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The source's tags on version ``version_id``: those the copy sets (or moves) at the
    destination, and those it leaves where they are. A tag moves when the destination has no
    such tag, or has it on a version a copy from the source made (the tag moved on the source);
    a tag the destination has on a version of its own is the destination's, and a copy taking it
    over would change what its retention keeps (``keep_tagged``) and what its users resolve."""
    moved: list[str] = []
    kept: list[str] = []
    for name in sorted(source.tags_of([version_id]).get(version_id, ())):
        target = dest.tag_target(name)
        there = dest.version(target) if target is not None and target != version_id else None
        (kept if there is not None and not _from_source(source, there) else moved).append(name)
    return tuple(moved), tuple(kept)


def _from_source(source: Catalog, there: VersionRow, *, unknown: bool = False) -> bool:
    """Whether the destination's version ``there`` is a copy of one of the source's: one the
    source shows, holds deleted, or purged (its tombstone) by id (stores keyed alike); else by
    run, step and creation time (a copy across keys), or, deleted there, by run and step.
    ``unknown``: the answer where the source has nothing at that run and step (a copy across
    keys of a version the source purged cannot be told from the destination's own)."""
    if gc_sql.known_manifests(source, [there.id]):
        return True
    mine = source.at_step(there.run, there.step)
    if mine is not None:
        return mine.created_at == there.created_at
    if retention_sql.find_deleted(source, run=there.run, step=there.step, limit=1):
        return True
    return unknown


def refuse_foreign_run(source: Catalog, dest: Catalog, run: str, checked: set[str], *,
                       keyed_alike: bool = True) -> None:
    """Refuse to add versions to a run the destination has a line of its own in: its latest
    version there is none of the source's, so a copy would make a foreign version the run's
    latest and the parent of its next commit (as git refuses a push that is not a fast-forward).

    Raises:
        CopyConflictError: the destination's ``run`` ends in a version of its own.
    """
    if run in checked:
        return
    checked.add(run)
    latest = dest.nth_latest(run, 0)
    if latest is not None and not _from_source(source, latest, unknown=not keyed_alike):
        raise CopyConflictError(
            f"the destination's run {run!r} is a line of its own (its latest, {run}@{latest.step} "
            f"{latest.id[:12]}, is no copy from this store): copying {run!r} into it would mix the "
            "two lines. Copy into another store, or delete the destination's versions of the run")


def _refuse_conflict(dest: Catalog, row: VersionRow) -> None:
    there = dest.at_step(row.run, row.step)
    if there is not None and there.id != row.id:
        raise CopyConflictError(
            f"the destination already has another version at {row.run}@{row.step} ({there.id[:12]}, "
            f"not {row.id[:12]}): the two stores' runs diverged. Delete that version from the "
            "destination (`casckpt delete`, then `casckpt gc`), or copy into a store without it")


def _plan_version(source: Catalog, dest: Catalog, row: VersionRow, asked: bool, source_nodes: StoreNodes,
                  sending: set[bytes]) -> VersionPlan | None:
    """One version the destination lacks: what it references, and what of that to send (None:
    an ancestor of manifest format 1 or 2, left out: the line ends there)."""
    data = source.manifest(row.id)
    head = decode_manifest(data, row.id)
    if head.tree is None and not asked:
        return None
    if head.tree is None:
        raise CopyUnsupportedError(
            f"version {row.id[:12]} ({row.run}@{row.step}) is of manifest format 1 or 2 (saved "
            "before casckpt wrote trees), which a copy between stores keyed alike does not carry, "
            "even after `casckpt catalog migrate-trees`. Copy its descendants (they name it as "
            "their parent), or restore it and commit it into the destination")
    recorded = _Recorded(source_nodes)
    ids = list(dict.fromkeys([c for b in head.tree.shared for c in b.chunks]
                             + list(treeread.referenced(recorded, head.tree.root, set()))))
    whole = decode_manifest(data, row.id, recorded)
    held = {bytes.fromhex(h) for h in dest.find_chunks([i.hex() for i in ids])}
    send = [i for i in ids if i not in held and i not in sending]
    sending.update(send)
    sizes = {bytes.fromhex(h): loc.raw_len for h, loc in
             source.find_chunks([i.hex() for i in send if i not in recorded.raw], live_only=False).items()}
    send_bytes = sum(len(recorded.raw[i]) if i in recorded.raw else sizes.get(i, 0) for i in send)
    return VersionPlan(row, data, False, asked, *movable_tags(source, dest, row.id), tuple(ids),
                       dict(recorded.raw), tuple(send), send_bytes, _aligns(whole, send), head.tree.root)


def _aligns(manifest: Manifest, ids: Iterable[bytes]) -> dict[bytes, int]:
    """The element size of the tensor each chunk among ``ids`` holds (1 for packed extents,
    which hold several): the byte grouping the destination's encoder may use."""
    wanted = set(ids)
    out: dict[bytes, int] = {}
    for tensor in manifest.tensors:
        extent = manifest.extents[tensor.extent]
        try:
            size = 1 if extent.packed else element_size(tensor.kind, tensor.dtype)
        except CasckptError:
            size = 1
        for cid in extent.chunks:
            if cid in wanted:
                out.setdefault(cid, size)
    return out

