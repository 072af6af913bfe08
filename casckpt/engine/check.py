"""Consistency checks between the catalog and the blob store.

Without ``read_data``: every visible version's manifest decodes and matches
its id, every chunk it references is live in the catalog, every live pack
exists with its recorded size. With ``read_data``: every live pack is read in
full, its footer compared with the catalog, and every chunk decoded and
verified against its id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from casckpt.engine.context import EngineContext, manifest_key
from casckpt.errors import CasckptError, IntegrityError
from casckpt.format.chunks import object_id
from casckpt.format.manifest import decode_manifest
from casckpt.format.pack import decode_entry, read_index
from casckpt.types import CheckProblem, CheckReport, ProgressCallback


def _check_versions(ctx: EngineContext, version_ids: list[str]) -> Iterator[CheckProblem]:
    for version_id in version_ids:
        try:
            manifest = decode_manifest(ctx.catalog.manifest(version_id), version_id)
        except IntegrityError as exc:
            yield CheckProblem("manifest", version_id, str(exc))
            continue
        if ctx.blobs.size(manifest_key(version_id)) is None:
            yield CheckProblem("manifest", version_id, "manifest object is missing from the blob store")
        ids = {cid.hex() for blob in manifest.blobs for cid in blob.chunks}
        known = ctx.catalog.find_chunks(ids, live_only=False)  # condemned ones are still stored
        for cid in sorted(ids - set(known)):
            yield CheckProblem(
                "chunk", cid, f"referenced by {manifest.run}@{manifest.step} but not in the catalog"
            )


def _check_pack_data(ctx: EngineContext, pack: Any) -> Iterator[CheckProblem]:
    try:
        data = memoryview(ctx.blobs.get(pack.key))
        index = {e.chunk_id.hex(): e for e in read_index(data)}
    except CasckptError as exc:
        yield CheckProblem("pack", pack.id, str(exc))
        return
    if object_id(data) != pack.id:  # also catches rot zstd would decode around
        yield CheckProblem("pack", pack.id, "pack bytes do not hash to the pack id (bit rot?)")
    for row in ctx.catalog.chunks_of_pack(pack.id):
        entry = index.get(row.id)
        if entry is None or (entry.offset, entry.stored_len, entry.raw_len, entry.codec) != (
            row.offset, row.stored_len, row.raw_len, row.codec
        ):
            yield CheckProblem("chunk", row.id, f"pack {pack.id} footer disagrees with the catalog")
            continue
        try:
            decode_entry(data[entry.offset : entry.offset + entry.span], entry, pack.id)
        except IntegrityError as exc:
            yield CheckProblem("chunk", row.id, str(exc))


def check(ctx: EngineContext, *, read_data: bool, progress: ProgressCallback | None) -> CheckReport:
    """Check the store; see the module docstring. Never modifies data."""
    version_ids = ctx.catalog.visible_version_ids()
    problems = list(_check_versions(ctx, version_ids))
    packs = ctx.catalog.packs()
    chunks_read = bytes_read = 0
    verified: list[str] = []
    total = sum(p.size for p in packs) if read_data else len(packs)
    done = 0
    for pack in packs:
        size = ctx.blobs.size(pack.key)
        if size is None:
            problems.append(CheckProblem("pack", pack.id, f"object {pack.key} is missing"))
        elif size != pack.size:
            problems.append(
                CheckProblem("pack", pack.id, f"object is {size} bytes, catalog says {pack.size}")
            )
        elif read_data:
            found = list(_check_pack_data(ctx, pack))
            problems.extend(found)
            chunks_read += pack.chunks
            bytes_read += size
            if not found:
                verified.append(pack.id)
        done += pack.size if read_data else 1
        if progress is not None:
            progress("check", done, total)
    if verified:
        ctx.catalog.mark_verified(verified)
    return CheckReport(
        versions=len(version_ids), packs=len(packs),
        chunks=ctx.catalog.totals()["chunks"], chunks_read=chunks_read, bytes_read=bytes_read,
        problems=tuple(problems),
    )
