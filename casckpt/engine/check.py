"""Consistency checks and scrubbing.

Without reading data: every visible version's manifest decodes, matches its
id and has a copy on some location; every chunk it references is in the
catalog; every shard of every pack exists with its recorded size.

Reading data (all packs, or a scrub of the least recently verified share):
every shard of a pack is read in full and checked (shard header and
checksum, or a copy's hash against the pack id), the pack is rebuilt and
verified against its id, its footer compared with the catalog and every
chunk decoded and verified. Damaged shards are recorded in the catalog,
which queues them for ``repair``; verified packs and shards get
``verified_at``. Nothing stored is modified.

Delta-coded chunks are verified after every pack, through the reader: each
is decoded against its (verified, decoded) base chain, and its bytes checked
against its id. A chunk found corrupt is reported with every chunk
delta-coded on it and every version that needs any of them. Without reading
data, every chunk's delta base must be in the catalog, transitively.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from casckpt.catalog import ChunkLocation, PackLayout
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.deltas import dependents
from casckpt.engine.context import EngineContext, manifest_key
from casckpt.engine.reader import read_chunks
from casckpt.errors import CasckptError, IntegrityError, MissingDataError, StorageError
from casckpt.format.chunks import object_id
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.pack import decode_entry, read_index
from casckpt.types import CheckProblem, CheckReport, ProgressCallback


@dataclass(slots=True)
class _Tally:
    problems: list[CheckProblem] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)  # packs that cannot be read back
    deltas: dict[bytes, int] = field(default_factory=dict)  # delta chunks to verify: id -> raw length
    corrupt: set[str] = field(default_factory=set)  # chunks that failed verification
    packs_read: int = 0
    chunks_read: int = 0
    bytes_read: int = 0


def _manifests(ctx: EngineContext, version_ids: list[str], tally: _Tally) -> list[Manifest]:
    manifests = []
    for version_id in version_ids:
        try:
            manifest = decode_manifest(ctx.catalog.manifest(version_id), version_id)
        except IntegrityError as exc:
            tally.problems.append(CheckProblem("manifest", version_id, str(exc)))
            continue
        manifests.append(manifest)
        if not ctx.locations.exists_anywhere(manifest_key(version_id)):
            tally.problems.append(CheckProblem(
                "manifest", version_id, "manifest object is missing from every blob location"))
        ids = {cid.hex() for blob in manifest.blobs for cid in blob.chunks}
        known = ctx.catalog.find_chunks(ids, live_only=False)  # condemned ones are still stored
        for cid in sorted(ids - set(known)):
            tally.problems.append(CheckProblem(
                "chunk", cid, f"referenced by {manifest.run}@{manifest.step} but not in the catalog"))
        _check_bases(ctx, manifest, known, tally)
    return manifests


def _check_bases(ctx: EngineContext, manifest: Manifest, known: dict[str, ChunkLocation],
                 tally: _Tally) -> None:
    """Every delta base the version's chunks need is in the catalog, transitively."""
    frontier = {loc.base_id: cid for cid, loc in known.items() if loc.base_id is not None}
    seen: set[str] = set()
    while frontier:
        seen.update(frontier)
        found = ctx.catalog.find_chunks(frontier, live_only=False)
        for base, user in sorted(frontier.items()):
            if base not in found:
                tally.problems.append(CheckProblem(
                    "chunk", base, f"the delta base of chunk {user} ({manifest.run}@{manifest.step}) "
                    "is not in the catalog"))
        frontier = {loc.base_id: cid for cid, loc in found.items()
                    if loc.base_id is not None and loc.base_id not in seen}


def _problem(layout: PackLayout, index: int, detail: str) -> CheckProblem:
    """A single-copy pack's problems are the pack's; otherwise they name the shard."""
    if layout.scheme == "none":
        return CheckProblem("pack", layout.id, detail)
    return CheckProblem("shard", f"{layout.id}:{index}", detail)


def _check_shards(ctx: EngineContext, layout: PackLayout, tally: _Tally) -> None:
    """Without reading data: each shard's object exists with its recorded size."""
    damaged: dict[int, str] = {}
    bad = 0
    for sh in layout.shards:
        loc = ctx.locations.get(sh.location_id)
        where = f"shard {sh.index} ({sh.key})" if layout.scheme != "none" else f"object {sh.key}"
        if loc is None or not loc.readable:
            detail = f"{where} is on a failed or unknown location"
        elif sh.state != "ok" and layout.scheme != "none":
            detail = f"{where} is {sh.state}; run `casckpt repair`"
        else:
            try:
                size = loc.blobs.size(sh.key)
            except StorageError as exc:
                size, detail = None, f"{where} on {loc.describe()} cannot be read: {exc}"
            else:
                detail = f"{where} is missing from {loc.describe()}"
            if size == sh.size:
                continue
            if size is not None:
                detail = f"{where} on {loc.describe()} is {size} bytes, catalog says {sh.size}"
            damaged[sh.index] = "missing" if size is None else "corrupt"
        bad += 1
        tally.problems.append(_problem(layout, sh.index, detail))
    if damaged and layout.scheme != "none":
        shard_sql.mark_shards(ctx.catalog, layout.id, {
            i: (state, row.location_id, row.key) for i, state in damaged.items()
            if (row := layout.shard(i)) is not None})
        ctx.packs.forget(layout.id)
    if len(layout.shards) - bad < layout.k:
        tally.lost.add(layout.id)
        if layout.scheme != "none":  # as _read_pack says it (a lone copy's problem is the pack's already)
            tally.problems.append(CheckProblem(
                "pack", layout.id, f"cannot be rebuilt: {len(layout.shards) - bad} healthy shard(s), "
                f"{layout.k} needed"))


def _read_pack(ctx: EngineContext, layout: PackLayout, tally: _Tally) -> tuple[bytes | None, bool]:
    """Read every shard of a pack and rebuild it: (pack bytes or None, all shards healthy).

    A damaged single copy is still returned, so its chunks can be told apart.
    """
    if layout.scheme == "none":
        sh = layout.shards[0]
        loc = ctx.locations.get(sh.location_id)
        try:
            if loc is None or not loc.readable:
                raise StorageError("its location is failed or unknown")
            data = loc.blobs.get(sh.key)
        except StorageError as exc:
            tally.problems.append(CheckProblem("pack", layout.id, f"object {sh.key} is missing ({exc})"))
            tally.lost.add(layout.id)
            shard_sql.mark_pack_lost(ctx.catalog, layout.id)  # commits write its chunks again
            return None, False
        if object_id(data) == layout.id:  # also catches rot zstd would decode around
            return data, True
        tally.problems.append(CheckProblem(
            "pack", layout.id, "pack bytes do not hash to the pack id (bit rot?)"))
        tally.lost.add(layout.id)
        shard_sql.mark_pack_lost(ctx.catalog, layout.id)
        return data, False
    try:
        found = ctx.packs.examine(layout.id, read_all=True)
    except CasckptError as exc:
        tally.problems.append(CheckProblem("pack", layout.id, str(exc)))
        tally.lost.add(layout.id)
        return None, False
    for index, note in sorted(found.notes.items()):
        tally.problems.append(_problem(layout, index, note))
    if found.data is None:
        tally.lost.add(layout.id)
        tally.problems.append(CheckProblem(
            "pack", layout.id, f"cannot be rebuilt: {len(found.healthy)} healthy shard(s), "
            f"{layout.k} needed"))
    return found.data, not found.damaged


def _check_pack_data(ctx: EngineContext, layout: PackLayout, tally: _Tally) -> None:
    """Read a pack's shards in full and verify everything down to each chunk."""
    data, clean = _read_pack(ctx, layout, tally)
    if data is None:
        return
    tally.packs_read += 1
    tally.bytes_read += layout.size
    view = memoryview(data)
    try:
        index = {e.chunk_id.hex(): e for e in read_index(view)}
    except IntegrityError as exc:
        tally.problems.append(CheckProblem("pack", layout.id, str(exc)))
        return
    for row in ctx.catalog.chunks_of_pack(layout.id):
        entry = index.get(row.id)
        tally.chunks_read += 1
        if entry is None or (entry.offset, entry.stored_len, entry.raw_len, entry.codec) != (
            row.offset, row.stored_len, row.raw_len, row.codec
        ):
            tally.problems.append(CheckProblem(
                "chunk", row.id, f"pack {layout.id} footer disagrees with the catalog"))
            clean = False
            continue
        if entry.base_id is not None:  # verified once every pack is read (it needs its base)
            tally.deltas[entry.chunk_id] = entry.raw_len
            continue
        try:
            decode_entry(view[entry.offset : entry.offset + entry.span], entry, layout.id)
        except IntegrityError as exc:
            tally.problems.append(CheckProblem("chunk", row.id, str(exc)))
            tally.corrupt.add(row.id)
            clean = False
    if clean and layout.scheme == "none":
        shard_sql.mark_verified(ctx.catalog, layout.id, [0], whole_pack=True)


def _affected(ctx: EngineContext, manifests: list[Manifest], lost: set[str]) -> Iterator[CheckProblem]:
    """Name the versions and tensors that read from packs that cannot be read back."""
    if not lost:
        return
    in_lost = {row.id: pack for pack in lost for row in ctx.catalog.chunks_of_pack(pack)}
    for manifest in manifests:
        hit: dict[str, set[str]] = {}
        for tensor in manifest.tensors:
            for cid in manifest.blobs[tensor.blob].chunks:
                pack = in_lost.get(cid.hex())
                if pack is not None:
                    hit.setdefault(pack, set()).add(tensor.path)
        for pack, paths in sorted(hit.items()):
            shown = ", ".join(sorted(paths)[:10]) + (" ..." if len(paths) > 10 else "")
            detail = (f"{manifest.run}@{manifest.step} cannot be restored: tensors {shown} "
                            f"need pack {pack}, which cannot be read back")
            yield CheckProblem("version", manifest.run + "@" + str(manifest.step), detail)


_DELTA_BATCH = 256


def _check_deltas(ctx: EngineContext, tally: _Tally) -> None:
    """Decode every delta chunk read against its base chain; verify it against its id."""
    ids = list(tally.deltas)
    for i in range(0, len(ids), _DELTA_BATCH):
        batch = ids[i : i + _DELTA_BATCH]
        try:
            _decode_deltas(ctx, batch, tally)
        except (IntegrityError, MissingDataError):
            for cid in batch:  # find which ones
                try:
                    _decode_deltas(ctx, [cid], tally)
                except (IntegrityError, MissingDataError) as exc:
                    tally.problems.append(CheckProblem("chunk", cid.hex(), str(exc)))
                    tally.corrupt.add(cid.hex())


def _decode_deltas(ctx: EngineContext, ids: list[bytes], tally: _Tally) -> None:
    wanted = {cid: [memoryview(bytearray(tally.deltas[cid]))] for cid in ids}
    read_chunks(ctx, wanted, lambda cid: f"chunk {cid.hex()}", heal=False)  # check modifies nothing


def _dependents(ctx: EngineContext, manifests: list[Manifest], corrupt: set[str]) -> Iterator[CheckProblem]:
    """Name, for each corrupt chunk, the chunks delta-coded on it and the versions that need them."""
    for cid in sorted(corrupt):
        needing = dependents(ctx.catalog, [cid])
        hit = needing | {cid}
        versions = sorted({f"{m.run}@{m.step}" for m in manifests
                           if any(c.hex() in hit for b in m.blobs for c in b.chunks)})
        if not needing and not versions:
            continue
        shown = ", ".join(versions[:10]) + (" ..." if len(versions) > 10 else "")
        yield CheckProblem("chunk", cid, f"corrupt chunk: {len(needing)} chunk(s) are delta-coded on it; "
                           f"versions that need it: {shown or 'none'}")


def _scrub_set(ctx: EngineContext, subset: float) -> set[str]:
    """The packs a scrub of ``subset`` (0..1] of the stored bytes reads: least recently verified first."""
    order = shard_sql.scrub_order(ctx.catalog)
    budget = subset * sum(size for _, size in order)
    chosen: set[str] = set()
    spent = 0
    for pack_id, size in order:
        if spent >= budget:
            break
        chosen.add(pack_id)
        spent += size
    return chosen


def check(ctx: EngineContext, *, read_data: bool, progress: ProgressCallback | None,
          read_data_subset: float | None = None) -> CheckReport:
    """Check the store; see the module docstring. ``read_data_subset`` is a fraction (0, 1]."""
    tally = _Tally()
    version_ids = ctx.catalog.visible_version_ids()
    manifests = _manifests(ctx, version_ids, tally)
    packs = ctx.catalog.packs()
    layouts = shard_sql.layouts(ctx.catalog, [p.id for p in packs])
    scrub = _scrub_set(ctx, read_data_subset) if read_data_subset is not None else (
        set(layouts) if read_data else set())
    total = sum(layouts[p].size for p in scrub if p in layouts) + len(layouts)
    done = 0
    for pack in packs:
        layout = layouts.get(pack.id)
        if layout is None:
            continue
        if pack.id in scrub:
            _check_pack_data(ctx, layout, tally)
            done += layout.size
        else:
            _check_shards(ctx, layout, tally)
        done += 1
        if progress is not None:
            progress("check", done, total)
    _check_deltas(ctx, tally)
    tally.problems.extend(_affected(ctx, manifests, tally.lost))
    tally.problems.extend(_dependents(ctx, manifests, tally.corrupt))
    return CheckReport(
        versions=len(version_ids), packs=len(packs),
        chunks=ctx.catalog.totals()["chunks"], chunks_read=tally.chunks_read,
        bytes_read=tally.bytes_read, problems=tuple(tally.problems), packs_read=tally.packs_read,
    )
