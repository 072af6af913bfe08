"""``check`` without reading pack data: everything the store relies on besides the chunks.

- **Identity**: every readable location carries the catalog's identity record.
- **Listing**: every location is listed once (``packs/``, ``manifests/``,
  ``refs/``); presence and sizes below come from it, not from stat calls.
- **Manifests**: each visible version's manifest in the catalog decodes,
  hashes to its id and says the run, step, parent and time its row says; a
  copy of it is on every active location once the version is durable (with
  ``read_data``: each copy is read, verified and identical to the catalog's;
  a version still on a fast tier has its copies written by the drain); a
  version lost with its fast tier before it drained is reported; a manifest
  on a location the catalog neither knows nor has tombstoned is reported
  (the catalog is missing a version: stale, partly rebuilt or damaged).
- **Derived rows**: each version's tensor rows and the content rows they
  point at are exactly what its manifest implies (GC marks from manifests;
  history, diff and show read these rows); every chunk a manifest
  references, and every delta base those need, is in the catalog.
- **Records**: every ``refs/`` record the catalog implies (tags, runs with a
  fork or policy, the store's settings) is on every active location and
  says what the catalog says.
- **Packs**: every shard the catalog records is listed on its location with
  its recorded size (missing ones are queued for repair); a pack with two
  shards in one failure domain is degraded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from casckpt.catalog import ChunkLocation, PackLayout
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import history as history_sql
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import nodes as node_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.rows import manifest_bytes
from casckpt.engine.context import EngineContext
from casckpt.engine.locations import identity
from casckpt.engine.packlayer.packlayouts import shard_state_of
from casckpt.engine.read import trees
from casckpt.engine.read.degraded import doubled_domains
from casckpt.engine.versions import records
from casckpt.engine.versions.refs import bind
from casckpt.errors import (
    AccessDeniedError,
    CasckptError,
    CatalogError,
    CatalogUnavailableError,
    CorruptManifestError,
    IntegrityError,
    StorageError,
)
from casckpt.format import objectnames
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.merkle import decode_node, node_json
from casckpt.storage import BlobInfo
from casckpt.storage.locations import Location
from casckpt.types import CheckProblem

_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


@dataclass(slots=True)
class Findings:
    """What the metadata checks found, and what the data checks need from them."""

    problems: list[CheckProblem] = field(default_factory=list)
    manifests: list[tuple[str, Manifest]] = field(default_factory=list)  # visible, verified: (id, m)
    listed: dict[int, dict[str, BlobInfo]] = field(default_factory=dict)  # location id -> key -> info
    unlisted: set[int] = field(default_factory=set)  # locations that could not be listed

    def add(self, kind: str, subject: str, detail: str) -> None:
        """Record one problem."""
        self.problems.append(CheckProblem(kind, subject, detail))


def check_identity(ctx: EngineContext, found: Findings) -> None:
    """Every readable location carries this catalog's identity."""
    mine = identity_sql.read(ctx.catalog)
    for loc in ctx.locations.all:
        if not loc.readable:
            continue
        try:
            record = identity.read_record(loc.blobs)
        except IntegrityError as exc:
            found.add("identity", loc.name, str(exc))
            continue
        except StorageError as exc:
            found.add("location", loc.name, f"{loc.describe()} cannot be read: {exc}")
            continue
        if record is not None and mine.same_as(record) and record.location != loc.name:
            found.add("identity", loc.name, f"{loc.describe()} holds the identity record of location "
                      f"{record.location!r}: the same storage under two names; keep one of them")
            continue
        if not mine.same_as(record):
            what = "has no identity record" if record is None else f"carries {record.describe()}"
            found.add("identity", loc.name, f"{loc.describe()} {what}, the catalog is {mine.describe()}; "
                      "open the store with its catalog to write it, or find out whose data it holds")


def list_locations(ctx: EngineContext, found: Findings) -> None:
    """List every readable location once."""
    for loc in ctx.locations.all:
        if not loc.readable:
            continue
        try:
            prefixes = (objectnames.PACKS, objectnames.MANIFESTS, objectnames.REFS)
            found.listed[loc.id] = {info.key: info for prefix in prefixes for info in loc.blobs.list(prefix)}
        except StorageError as exc:
            found.unlisted.add(loc.id)
            found.add("location", loc.name, f"{loc.describe()} cannot be listed: {exc}. What it "
                      "holds could not be verified (nothing was found missing); check again once "
                      "it can be reached")


def copies_expected(ctx: EngineContext, found: Findings) -> list[Location]:
    """Locations that should hold every manifest and record: the active ones that were listed."""
    return [loc for loc in ctx.locations.active() if loc.id in found.listed]


def check_manifests(ctx: EngineContext, found: Findings, *, read_data: bool) -> None:
    """Manifests in the catalog and on the locations (see the module docstring)."""
    holders = copies_expected(ctx, found)
    for batch in gc_sql.manifest_batches(ctx.catalog, gc_sql.visible_ids(ctx.catalog)):
        for row in batch:
            try:
                data = manifest_bytes(row.manifest, row.id)
                manifest = bind(row, trees.decode(ctx, ctx.catalog, data, row.id, heal=False))
            except IntegrityError as exc:
                found.add("manifest", row.id, f"{row.run}@{row.step}: the catalog's copy: {exc}")
                continue
            try:
                # a version migrated to a tree
                manifest = trees.migrated(manifest, row.tree_root, ctx.crypto.chunk_id)
                _check_tree_rows(ctx, found, row, manifest)
            except IntegrityError as exc:
                found.add("catalog", f"{row.run}@{row.step}", str(exc))
            found.manifests.append((row.id, manifest))
            _check_values(found, row, manifest)
            if row.durability == "lost":
                found.add("version", f"{row.run}@{row.step}", f"version {row.id[:12]} was lost "
                          "before it drained: its fast tier was lost (wiped, or its host gone), "
                          "and it cannot be restored; delete it (`casckpt delete`) once nothing "
                          "needs it")
            if row.durability != "durable":
                continue  # its manifest goes to the locations when it drains
            for loc in holders:
                _check_copy(loc, found, row, data, read_data)
    known: set[str] = set()
    for loc_id, objects in found.listed.items():
        ids = {v for key in objects if (v := objectnames.version_of(key)) is not None}
        unknown = (ids - known) - gc_sql.known_manifests(ctx.catalog, ids - known)
        known |= ids - unknown
        holder = ctx.locations.get(loc_id)
        for version_id in sorted(unknown):
            found.add("manifest", version_id, f"on {holder.name if holder else loc_id}: a manifest of a "
                      "version the catalog does not know (is the catalog stale or partly rebuilt? "
                      "`casckpt catalog rebuild` into a new catalog recovers it; gc refuses to run)")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _check_values(found: Findings, row: Any, manifest: Manifest) -> None:
    """The catalog's metadata and metrics of a version (what log, show and best read) against
    its manifest's."""
    for name, text, want in (("metadata", row.meta_text, manifest.metadata),
                             ("metrics", row.metrics_text, manifest.metrics)):
        try:
            have = json.loads(text)
        except (TypeError, ValueError):
            have = None
        if _canonical(have) != _canonical(dict(want)):
            found.add("catalog", row.id, f"{row.run}@{row.step}: the catalog's {name} disagree with "
                      "the manifest (log, show and best would be wrong); the catalog is damaged")


def _check_copy(loc: Location, found: Findings, row: Any, data: bytes, read_data: bool) -> None:
    if loc.id in found.unlisted or loc.id not in found.listed:
        return
    key = objectnames.manifest_name(row.id)
    label = f"{row.run}@{row.step}"
    if key not in found.listed[loc.id]:
        found.add("manifest", row.id, f"{label}: missing from {loc.describe()}; "
                  "`casckpt repair` writes it again")
        return
    size = found.listed[loc.id][key].size
    if size != len(data):
        found.add("manifest", row.id, f"{label}: the copy on {loc.describe()} is {size} bytes, the "
                  f"catalog's {len(data)}: damaged; `casckpt repair` writes it again")
        return
    if not read_data:
        return
    try:
        copy = loc.blobs.get(key, max_size=len(data))
    except StorageError as exc:
        found.add("manifest", row.id, f"{label}: cannot be read from {loc.describe()}: {exc}")
        return
    if copy != data:
        try:
            decode_manifest(copy, row.id)
            why = "differs from the catalog's copy"
        except IntegrityError as exc:
            why = str(exc)
        found.add("manifest", row.id, f"{label}: the copy on {loc.describe()} is damaged ({why}); "
                  "`casckpt repair` writes it again")


def _check_tree_rows(ctx: EngineContext, found: Findings, row: Any, manifest: Manifest) -> None:
    """A version's tree root in its row, and a verified catalog row for each of its nodes."""
    label = f"{row.run}@{row.step}"
    if row.tree_root != trees.root_of(manifest):
        found.add("catalog", label, "the version row names another tree root than its manifest; "
                  "the catalog is damaged")
    have = node_sql.tree_nodes(ctx.catalog, [n.hex() for n in manifest.nodes])
    for node_id in manifest.nodes:
        body = have.get(node_id.hex())
        try:
            if body is None:
                raise CorruptManifestError("the catalog has no row for it")
            decode_node(node_json(body), node_id, ctx.crypto.chunk_id)
        except CorruptManifestError as exc:
            found.add("catalog", f"{label}:node {node_id.hex()[:12]}",
                      f"tree node row is missing or damaged ({exc}); `casckpt repair` restores it "
                      "from the packs")


def check_rows(ctx: EngineContext, found: Findings) -> None:
    """Tensor and content rows, chunk rows and delta bases, against the verified manifests."""
    verified: set[str] = set()
    for version_id, manifest in found.manifests:
        label = f"{manifest.run}@{manifest.step}"
        want_rows, want_contents = trees.catalog_rows(version_id, manifest)
        try:
            have = {r.path: r for r in ctx.catalog.tensors_of(version_id)}
        except CatalogUnavailableError:
            raise
        except CatalogError as exc:  # a row that does not even decode
            found.add("catalog", label, f"the catalog's tensor rows cannot be read: {exc}")
            have = {}
        want = {r["path"]: r for r in want_rows}
        for path in sorted(have.keys() | want.keys()):
            w, h = want.get(path), have.get(path)
            if w is None or h is None or (h.dtype, list(h.shape), h.nbytes, h.chunks, h.digest) != (
                    w["dtype"], w["shape"], w["nbytes"], w["chunks"], w["digest"]):
                found.add("catalog", f"{label}:{path}", "the catalog's tensor row disagrees with the "
                          "manifest (history, diff and show would be wrong); the catalog is damaged")
        todo = {c["digest"]: c for c in want_contents if c["digest"] not in verified}
        rows = history_sql.contents(ctx.catalog, todo)
        for digest, c in todo.items():
            r = rows.get(digest)
            if r is None or (r.nbytes, r.chunk_size, bytes(r.chunk_ids)) != (
                    c["nbytes"], c["chunk_size"], c["chunk_ids"]):
                found.add("catalog", digest, f"the catalog's content row of a tensor of {label} "
                          "disagrees with the manifest; the catalog is damaged")
            else:
                verified.add(digest)
        ids = {cid.hex() for cid in manifest.chunk_ids()}
        known = ctx.catalog.find_chunks(ids, live_only=False)  # condemned ones are still stored
        for cid in sorted(ids - set(known)):
            found.add("chunk", cid, f"referenced by {label} but not in the catalog")
        _check_bases(ctx, label, known, found)


def _check_bases(ctx: EngineContext, label: str, known: dict[str, ChunkLocation], found: Findings) -> None:
    """Every delta base the version's chunks need is in the catalog, transitively."""
    def bases(rows: dict[str, ChunkLocation]) -> dict[str, str]:
        out = {}
        for cid, loc in rows.items():
            if loc.base_id is not None and not (isinstance(loc.base_id, str) and _HEX_ID.match(loc.base_id)):
                found.add("chunk", cid, f"its catalog row names no valid delta base ({label}); the "
                          "catalog is damaged")
            elif loc.base_id is not None:
                out[loc.base_id] = cid
        return out

    frontier = bases(known)
    seen: set[str] = set()
    while frontier:
        seen.update(frontier)
        have = ctx.catalog.find_chunks(frontier, live_only=False)
        for base, user in sorted(frontier.items()):
            if base not in have:
                found.add("chunk", base, f"the delta base of chunk {user} ({label}) is not in the catalog")
        frontier = {b: cid for b, cid in bases(have).items() if b not in seen}


def check_records(ctx: EngineContext, found: Findings) -> None:
    """Every record the catalog implies is on every active location, saying the same."""
    wanted = records.expected(ctx.catalog)
    for loc in copies_expected(ctx, found):
        for key, want in sorted(wanted.items()):
            if key not in found.listed[loc.id]:
                found.add("record", key, f"missing from {loc.describe()} (a catalog rebuild from it "
                          "would lose it); `casckpt repair` writes it again")
                continue
            try:
                doc = records.parse(loc.blobs.get(key, max_size=records.MAX_RECORD))
            except AccessDeniedError:
                raise  # refused, not damaged or missing: stop, naming the right
            except (CasckptError, ValueError, RecursionError) as exc:
                found.add("record", key, f"unreadable on {loc.describe()} ({exc}); `casckpt repair` "
                          "writes it again")
                continue
            if not records.agrees(key, doc, want):
                found.add("record", key, f"on {loc.describe()} says {doc!r}, the catalog "
                          f"{want!r}; `casckpt repair` writes it again")
    removed = records.removed_mirror_keys(ctx.catalog)
    for loc in ctx.locations.all:
        for key in records.unknown_mirrors(found.listed.get(loc.id, ()), wanted):
            found.add("record", key, f"on {loc.describe()} is the record of a mirror this store no "
                      "longer has (its removal could not delete it there): a catalog rebuild would "
                      "bring the mirror back; `casckpt repair` deletes it" if key in removed else
                      f"on {loc.describe()} is the record of a mirror this catalog does not have and "
                      "whose removal it never logged (a rebuild could not restore it?): repair keeps "
                      "it, as it may be the mirror's last definition; add the mirror again "
                      "(casckpt mirror add) or, to drop it, delete the object yourself")


def check_presence(ctx: EngineContext, layouts: Iterable[PackLayout], found: Findings) -> dict[str, int]:
    """Every shard the catalog records is listed with its size; returns, per pack, how many
    shards are unusable (missing shards are queued for repair). A shard on a location that
    cannot be listed or reached is unverified, not unusable: its location's problem says so."""
    layouts = list(layouts)
    unusable: dict[str, int] = {}
    for layout in layouts:
        damaged: dict[int, str] = {}
        bad = 0
        for sh in layout.shards:
            loc = ctx.locations.get(sh.location_id)
            where = f"shard {sh.index} ({sh.key})" if layout.scheme != "none" else f"object {sh.key}"
            if loc is None or not loc.readable:
                detail = f"{where} is on a failed or unknown location"
            elif sh.state != "ok" and layout.scheme != "none":
                detail = f"{where} is {sh.state}; run `casckpt repair`"
            elif sh.location_id in found.unlisted:
                continue
            else:
                info = found.listed.get(sh.location_id, {}).get(sh.key)
                if info is not None and info.size == sh.size:
                    continue
                size = info.size if info is not None else None
                if info is None:  # not listed: say why, when it is something other than absence
                    try:
                        size = loc.blobs.size(sh.key)
                    except StorageError as exc:
                        state = shard_state_of(exc)
                        if state is None:
                            found.add("location", loc.name, f"{where} on {loc.describe()} could not "
                                      f"be verified: {exc}; check again once it can be reached")
                            continue
                        detail, damaged[sh.index] = f"{where} on {loc.describe()}: {exc}", state
                        size = -1
                if size is None:
                    detail, damaged[sh.index] = f"{where} is missing from {loc.describe()}", "missing"
                elif size == sh.size:
                    continue  # written after the listing
                elif size >= 0:
                    detail = f"{where} on {loc.describe()} is {size} bytes, catalog says {sh.size}"
                    damaged[sh.index] = "corrupt"
            bad += 1
            found.add("pack" if layout.scheme == "none" else "shard",
                      layout.id if layout.scheme == "none" else f"{layout.id}:{sh.index}", detail)
        if damaged and layout.scheme != "none":
            shard_sql.mark_shards(ctx.catalog, layout.id, {
                i: (state, row.location_id, row.key) for i, state in damaged.items()
                if (row := layout.shard(i)) is not None})
            ctx.packs.layouts.forget(layout.id)
        unusable[layout.id] = bad
    check_domains(ctx, layouts, found)
    return unusable


def check_domains(ctx: EngineContext, layouts: Iterable[PackLayout], found: Findings) -> None:
    """A pack with two shards in one failure domain loses two to one failure: degraded."""
    for layout in layouts:
        for domain, indexes in doubled_domains(ctx.locations, layout).items():
            found.add("redundancy", layout.id, f"shards {indexes} share failure domain {domain!r}: "
                      "one failure there loses them all; add a location in another domain "
                      "(`casckpt location add`), then `casckpt repair`")
