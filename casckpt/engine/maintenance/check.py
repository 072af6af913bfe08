"""Consistency checks and scrubbing: what ``check`` proves.

Without reading data (:mod:`casckpt.engine.maintenance.checkmeta`): the locations carry
the catalog's identity; every visible version's manifest in the catalog
decodes, matches its id and its row, and has a copy on every active
location; the catalog's derived rows (tensors, contents, chunk
references, delta bases) say what the manifests say; the ``refs/`` records
the catalog implies are on every active location; every shard the catalog
records is listed with its recorded size; no pack has two shards in one
failure domain.

Reading data (all packs, or a scrub of the least recently verified share;
:mod:`casckpt.engine.maintenance.scrub`): every copy or shard of a pack is streamed in
bounded memory and verified (shard header and checksum, or a copy's hash
against the pack id), the pack's bytes are verified against its id, its
footer compared with the catalog and every chunk decoded and verified;
every manifest copy on the locations is read and compared with the
catalog's. Damaged shards are recorded in the catalog, which queues them
for ``repair``; verified packs and shards get ``verified_at``. Nothing
stored is modified.

Delta-coded chunks are verified after every pack, through the reader: each
is decoded against its (verified, decoded) base chain, and its bytes checked
against its id. A chunk found corrupt is reported with every chunk
delta-coded on it and every version that needs any of them.

Change hints (``read_data`` only, not a subset): a tensor a commit reused on its
caller's hint (:mod:`casckpt.engine.write.hint`) has a fingerprint of a sample of
the bytes it was handed in its manifest; each is recomputed from the stored chunks
(:mod:`casckpt.engine.maintenance.checkhint`: read through the reader, so verified)
and a mismatch is reported as a ``hint`` problem: the hint was wrong, and the version
holds its parent's bytes for that tensor. A sample misses a change outside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from casckpt.catalog import PackLayout, inventory
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.deltas import dependents
from casckpt.engine.context import EngineContext
from casckpt.engine.maintenance import checkhint, checkmeta, scrub
from casckpt.engine.maintenance.checkmeta import Findings
from casckpt.engine.read.reader import read_chunks
from casckpt.errors import IntegrityError, MissingDataError, StoreUnavailableError
from casckpt.format.manifest import Manifest
from casckpt.types import CheckProblem, CheckReport, ProgressCallback


@dataclass(slots=True)
class _Tally:
    lost: set[str] = field(default_factory=set)  # packs that cannot be read back
    deltas: dict[bytes, int] = field(default_factory=dict)  # delta chunks to verify: id -> raw length
    corrupt: set[str] = field(default_factory=set)  # chunks that failed verification
    packs_read: int = 0
    chunks_read: int = 0
    bytes_read: int = 0


def _problem(layout: PackLayout, index: int | None, detail: str) -> CheckProblem:
    """A single-copy pack's problems are the pack's; otherwise they name the shard."""
    if layout.scheme == "none" or index is None:
        return CheckProblem("pack", layout.id, detail)
    return CheckProblem("shard", f"{layout.id}:{index}", detail)


def _check_pack_data(ctx: EngineContext, layout: PackLayout, found: Findings, tally: _Tally) -> None:
    """Read a pack back (bounded memory) and verify everything down to each chunk."""
    verdict = scrub.scrub(ctx, layout, found.listed)
    tally.bytes_read += verdict.read
    for index, note in verdict.notes:
        found.problems.append(_problem(layout, index, note))
    if not verdict.ok and verdict.unreachable:  # unreached shards may well hold it: not lost
        found.add("pack", layout.id, f"could not be verified: shard(s) {sorted(verdict.unreachable)} "
                  "could not be reached; check again once their locations can be")
    elif not verdict.ok:
        tally.lost.add(layout.id)
        if layout.scheme != "none":
            healthy = len(layout.shards) - len(verdict.damaged)
            found.add("pack", layout.id,
                      f"cannot be reconstructed: {healthy} healthy shard(s), {layout.k} needed")
        elif not verdict.notes:
            found.add("pack", layout.id, "pack bytes do not hash to the pack id (bit rot?)")
    if verdict.ok or verdict.entries:
        tally.packs_read += 1
    footer = {e.chunk_id.hex(): e for e in verdict.entries}
    for row in inventory.chunks_of_pack(ctx.catalog, layout.id):
        entry = footer.get(row.id)
        tally.chunks_read += 1
        if entry is None or (entry.offset, entry.stored_len, entry.raw_len, entry.codec,
                             entry.base_id.hex() if entry.base_id else None) != (
                row.offset, row.stored_len, row.raw_len, row.codec, row.base_id):
            if verdict.entries:
                found.add("chunk", row.id, f"pack {layout.id} footer disagrees with the catalog")
            continue
        if row.id in verdict.corrupt_chunks:
            found.add("chunk", row.id, verdict.corrupt_chunks[row.id])
            tally.corrupt.add(row.id)
        if entry.base_id is not None:  # verified once every pack is read (it needs its base)
            tally.deltas[entry.chunk_id] = entry.raw_len


def _affected(ctx: EngineContext, manifests: list[tuple[str, Manifest]],
              lost: set[str]) -> Iterator[CheckProblem]:
    """Name the versions and tensors that read from packs that cannot be read back."""
    if not lost:
        return
    in_lost = {row.id: pack for pack in lost for row in inventory.chunks_of_pack(ctx.catalog, pack)}
    for _, manifest in manifests:
        hit: dict[str, set[str]] = {}
        for tensor in manifest.tensors:
            for cid in manifest.extents[tensor.extent].chunks:
                pack = in_lost.get(cid.hex())
                if pack is not None:
                    hit.setdefault(pack, set()).add(tensor.path)
        for pack, paths in sorted(hit.items()):
            shown = ", ".join(sorted(paths)[:10]) + (" ..." if len(paths) > 10 else "")
            detail = (f"{manifest.run}@{manifest.step} cannot be restored: tensors {shown} "
                      f"need pack {pack}, which cannot be read back")
            yield CheckProblem("version", manifest.run + "@" + str(manifest.step), detail)


_DELTA_BATCH = 256


def _check_deltas(ctx: EngineContext, found: Findings, tally: _Tally) -> None:
    """Decode every delta chunk read against its base chain; verify it against its id."""
    ids = list(tally.deltas)
    for i in range(0, len(ids), _DELTA_BATCH):
        batch = ids[i : i + _DELTA_BATCH]
        try:
            _decode_deltas(ctx, batch, tally)
        except StoreUnavailableError as exc:  # not verified, not lost
            found.add("chunk", batch[0].hex(), f"{len(batch)} delta-coded chunk(s) from here on "
                      f"could not be verified: {exc}")
        except (IntegrityError, MissingDataError):
            for cid in batch:  # find which ones
                try:
                    _decode_deltas(ctx, [cid], tally)
                except (IntegrityError, MissingDataError) as exc:
                    found.add("chunk", cid.hex(), str(exc))
                    tally.corrupt.add(cid.hex())


def _decode_deltas(ctx: EngineContext, ids: list[bytes], tally: _Tally) -> None:
    wanted = {cid: [memoryview(bytearray(tally.deltas[cid]))] for cid in ids}
    read_chunks(ctx, wanted, lambda cid: f"chunk {cid.hex()}", heal=False)  # check modifies nothing


def _dependents(ctx: EngineContext, manifests: list[tuple[str, Manifest]],
                corrupt: set[str]) -> Iterator[CheckProblem]:
    """Name, for each corrupt chunk, the chunks delta-coded on it and the versions that need them."""
    for cid in sorted(corrupt):
        needing = dependents(ctx.catalog, [cid])
        hit = needing | {cid}
        versions = sorted({f"{m.run}@{m.step}" for _, m in manifests
                           if any(c.hex() in hit for b in m.extents for c in b.chunks)})
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
    found = Findings()
    checkmeta.check_identity(ctx, found)
    checkmeta.list_locations(ctx, found)
    checkmeta.check_manifests(ctx, found, read_data=read_data)
    checkmeta.check_rows(ctx, found)
    checkmeta.check_records(ctx, found)
    packs = inventory.live_packs(ctx.catalog)
    layouts = shard_sql.layouts(ctx.catalog, [p.id for p in packs])
    scrub_set = _scrub_set(ctx, read_data_subset) if read_data_subset is not None else (
        set(layouts) if read_data else set())
    # a pack read back is judged by what reading it finds (presence, sizes and all)
    unusable = checkmeta.check_presence(
        ctx, [layout for p, layout in layouts.items() if p not in scrub_set], found)
    checkmeta.check_domains(ctx, [layouts[p] for p in scrub_set if p in layouts], found)
    total = sum(layouts[p].size for p in scrub_set if p in layouts) + len(layouts)
    done = 0
    for pack in packs:
        layout = layouts.get(pack.id)
        if layout is None:
            continue
        if pack.id in scrub_set:
            _check_pack_data(ctx, shard_sql.layouts(ctx.catalog, [pack.id])[pack.id], found, tally)
            done += layout.size
        elif len(layout.shards) - unusable.get(pack.id, 0) < layout.k:
            tally.lost.add(pack.id)
            if layout.scheme != "none":
                found.add("pack", pack.id, "cannot be reconstructed: "
                          f"{len(layout.shards) - unusable[pack.id]} healthy shard(s), {layout.k} needed")
        done += 1
        if progress is not None:
            progress("check", done, total)
    _check_deltas(ctx, found, tally)
    if read_data:
        checkhint.check_hints(ctx, found)
    found.problems.extend(_affected(ctx, found.manifests, tally.lost))
    found.problems.extend(_dependents(ctx, found.manifests, tally.corrupt))
    tier = ctx.packs.tier
    return CheckReport(
        versions=len(found.manifests), packs=len(packs),
        chunks=inventory.live_chunk_count(ctx.catalog), chunks_read=tally.chunks_read,
        bytes_read=tally.bytes_read, problems=tuple(found.problems), packs_read=tally.packs_read,
        warnings=tuple(f"fast tier {tier.dir.root}: {w}" for w in tier.disk_problems())
        if tier is not None else (),
    )
