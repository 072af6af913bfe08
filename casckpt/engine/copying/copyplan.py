"""A copy's plan: which versions the destination gets, and which chunks it lacks.

Pure reads of both stores (the source's catalog and tree nodes, the destination's catalog);
nothing is written, so a dry run is this plan printed. A version is planned with its
ancestors up to the nearest one the destination holds (as git pushes the commits a branch
needs): a manifest names its parent, and the version id is the manifest's hash, so the
parent must be there for the version to arrive as the same version. An ancestor the source
no longer shows (deleted) ends the chain: the copied version then names a parent neither
store shows, as it did on the source.

A version saved before casckpt wrote trees (manifest format 1 or 2) travels as the version
``casckpt catalog migrate-trees`` makes of it: its document as it is (the same id), with the
tree derived from it (the source's, if migrated: the same root), so the destination holds it
migrated whether or not the source was.

Memory: a plan keeps, per version, its ids, the ids it sends with their sizes and element
sizes, and the ids and sizes of the tree nodes the destination lacks (their bytes are read
again when the copy sends them, :mod:`.copynodes`); a version's whole tree is read once, then
dropped, so planning a long run holds no version's tree. CPU: a tree is walked (each node
read and verified once), never decoded into a manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from casckpt.catalog import Catalog
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import nodes as node_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.rows import VersionRow
from casckpt.catalog.treemigrate import tree_root as migrated_root
from casckpt.engine.copying.copynodes import NodeBodies, NodeReader
from casckpt.engine.versions.nodes import StoreNodes
from casckpt.engine.versions.refs import bind
from casckpt.errors import CasckptError, CopyConflictError, CorruptManifestError
from casckpt.format import treeread
from casckpt.format.chunks import ChunkIds
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import ExtentEntry, Manifest, decode_manifest
from casckpt.format.merkle import NodeSource
from casckpt.format.treemanifest import with_tree

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
        nodes: the raw bytes (verified against their ids), by id, of every node of its tree:
            sizes held, bytes read again from the source when asked
            (:class:`~.copynodes.NodeBodies`, whose ``wanted`` are the nodes it sends or whose
            catalog rows the destination lacks and no earlier version of the copy adds; a tree
            derived from a document of format 1 or 2: held), so a plan does not hold them all.
            Its publish adds the rows the destination lacks then.
        send: the ids among ``ids`` the destination lacks and no earlier version of the copy
            brings, in order.
        send_bytes: their raw bytes.
        aligns: element size of each chunk's tensor (what the destination's encoder groups by).
        root: its tree's root node (a version of manifest format 1 or 2: the root of the tree
            ``casckpt catalog migrate-trees`` gives it, which the destination's row names).
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
        CorruptManifestError, MissingDataError: the source cannot read a version's tree.
        VersionMismatchError: a version's manifest is another version than its row says.
    """
    planned: list[VersionPlan] = []
    state = _Planning(source_nodes, NodeReader(source_nodes))
    checked: set[str] = set()
    for row, was_asked in chain(source, dest, asked, lineage=lineage):
        if _held(dest, row, was_asked):
            planned.append(VersionPlan(row, b"", True, was_asked, *movable_tags(source, dest, row.id)))
            continue
        _refuse_conflict(dest, row)
        refuse_foreign_run(source, dest, row.run, checked)
        planned.append(_plan_version(source, dest, row, was_asked, state))
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


@dataclass(slots=True)
class _Planning:
    """What planning a copy's versions shares: where the source's nodes are read (and read
    again, :mod:`.copynodes`), and the ids and node rows earlier versions of the copy bring."""

    source_nodes: StoreNodes
    reader: NodeReader
    sending: set[bytes] = field(default_factory=set)
    rowed: set[bytes] = field(default_factory=set)


def _plan_version(source: Catalog, dest: Catalog, row: VersionRow, asked: bool,
                  state: _Planning) -> VersionPlan:
    """One version the destination lacks: what it references, and what of that to send.

    Only what the copy needs of it is kept: its ids, the ones it sends with their sizes and
    element sizes, and the nodes it sends or whose rows the destination lacks, as ids and
    sizes (:class:`~.copynodes.NodeBodies`: read again from the source when the copy asks;
    a tree derived from a document of format 1 or 2, which the source may not hold, is kept
    whole).
    """
    data = source.manifest(row.id)
    head = decode_manifest(data, row.id)
    if head.tree is None:
        walked = _document(source, row, data, state.source_nodes.chunk_ids)
    else:
        walked = _walk(head.tree.root, head.tree.shared, state.source_nodes)
    ids, nodes = walked.ids, walked.nodes
    held = {bytes.fromhex(h) for h in dest.find_chunks([i.hex() for i in ids])}
    send = [i for i in ids if i not in held and i not in state.sending]
    state.sending.update(send)
    unrowed = [i for i in nodes if i not in state.rowed]
    have = node_sql.tree_node_ids(dest, [i.hex() for i in unrowed])
    needed = [i for i in send if i in nodes]  # sent: the pipeline takes their bytes from the plan
    needed += [i for i in unrowed if i.hex() not in have]  # rows its publish adds
    state.rowed.update(needed)
    kept: Mapping[bytes, bytes]
    if walked.document is None:  # every node's size (a gc may purge rows the publish then adds)
        kept = NodeBodies(state.reader, {i: len(raw) for i, raw in nodes.items()}, needed)
    else:
        kept = dict(nodes)
    sizes = {bytes.fromhex(h): loc.raw_len for h, loc in
             source.find_chunks([i.hex() for i in send if i not in nodes], live_only=False).items()}
    send_bytes = sum(len(nodes[i]) if i in nodes else sizes.get(i, 0) for i in send)
    return VersionPlan(row, data, False, asked, *movable_tags(source, dest, row.id), tuple(ids),
                       kept, tuple(send), send_bytes, walked.aligns(send), walked.root)


@dataclass(slots=True)
class _Walked:
    """What one version references: its tree's root, every chunk and node id (``ids``), its
    nodes' bytes, and how to tell the element size of a chunk's tensor (:meth:`aligns`)."""

    root: bytes
    ids: list[bytes]
    nodes: Mapping[bytes, bytes]
    tensors: list[dict[str, Any]] = field(default_factory=list)
    shared: Sequence[ExtentEntry] = ()
    document: Manifest | None = None

    def aligns(self, send: Sequence[bytes]) -> dict[bytes, int]:
        """The element size of the tensor each chunk among ``send`` holds (1 for packed
        extents, which hold several): the byte grouping the destination's encoder may use."""
        if self.document is not None:
            return _aligns(self.document, send)
        wanted = {i.hex() for i in send}
        out: dict[bytes, int] = {}
        for value in self.tensors if wanted else ():
            entry = value["e"]
            extent = entry["blob"]
            if set(extent) == {"s"}:
                index = extent["s"]
                ok = isinstance(index, int) and 0 <= index < len(self.shared)
                chunks = [c.hex() for c in self.shared[index].chunks] if ok else []
            else:
                chunks = extent.get("chunks", [])
            hit = [c for c in chunks if c in wanted]
            if hit:
                size = 1 if extent.get("packed") is True else _element_size(entry)
                for c in hit:
                    out.setdefault(bytes.fromhex(c), size)
        return out


def _element_size(entry: Mapping[str, Any]) -> int:
    try:
        return element_size(entry["kind"], entry["dtype"])
    except (CasckptError, KeyError, TypeError, ValueError):
        return 1  # a grouping hint only: a chunk's bytes are verified against its id on arrival


def _walk(root: bytes, shared: Sequence[ExtentEntry], source_nodes: StoreNodes) -> _Walked:
    """A tree version's ids: its shared extents' chunks, then its nodes and their chunks, each
    node read (and verified) once."""
    recorded = _Recorded(source_nodes)
    walked = _Walked(root, [], recorded.raw, shared=shared)
    found = treeread.referenced(recorded, root, set(), walked.tensors)
    walked.ids = list(dict.fromkeys([c for extent in shared for c in extent.chunks] + list(found)))
    return walked


def _document(source: Catalog, row: VersionRow, data: bytes, chunk_ids: ChunkIds) -> _Walked:
    """A version of manifest format 1 or 2 (saved before casckpt wrote trees), carried as the
    tree ``casckpt catalog migrate-trees`` gives it (:func:`casckpt.format.treemanifest.with_tree`:
    derived from the document, which travels as it is, so the version keeps its id): the
    destination gets a migrated version, whether or not the source migrated it.

    Raises:
        CorruptManifestError, VersionMismatchError: the document does not decode, or is
            another version than the row says.
        CorruptManifestError: the source's row names another tree than the document's.
    """
    document = bind(row, decode_manifest(data, row.id))
    _, tree = with_tree(document, chunk_ids)
    named = migrated_root(source, row.id)
    if named is not None and named != tree.root.hex():
        raise CorruptManifestError(
            f"the source's catalog names another tree root for version {row.id[:12]} ({row.run}@"
            f"{row.step}) than the tree of its manifest: the source's catalog is damaged. Rebuild "
            "it from its locations (`casckpt catalog rebuild`), then copy again")
    chunks = [c for extent in document.extents for c in extent.chunks]
    return _Walked(tree.root, list(dict.fromkeys([*chunks, *tree.nodes])), tree.nodes, document=document)


def _aligns(manifest: Manifest, ids: Iterable[bytes]) -> dict[bytes, int]:
    """The element size of the tensor each chunk among ``ids`` holds (1 for packed extents,
    which hold several), from a whole manifest."""
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
