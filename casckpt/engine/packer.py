"""Packs encoded chunks into pack objects and makes them durable.

A pack is written to a staging file, finished (footer, trailer, id), stored in
the blob store under its content-addressed key, and only then recorded in the
catalog and the index cache. A crash at any point leaves at worst an object or
chunk rows no version references, which GC reclaims.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import BinaryIO

from casckpt.catalog import PackRecord
from casckpt.engine.context import EngineContext, pack_key
from casckpt.format.pack import PackEntry, PackWriter


class Packer:
    """Accumulates chunks into packs of about ``config.pack_size`` bytes. Not thread-safe."""

    def __init__(self, ctx: EngineContext) -> None:
        self._ctx = ctx
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._writer: PackWriter | None = None
        self.stored_bytes = 0
        self.packs: list[PackRecord] = []

    def add(self, cid: bytes, codec: int, raw_len: int, payload: bytes | memoryview) -> None:
        """Append one encoded chunk, closing the current pack when it is full."""
        if self._writer is None:
            self._path = self._ctx.staging / f"{uuid.uuid4().hex}.pack"
            self._file = open(self._path, "wb")  # noqa: SIM115 - closed in flush()/abort()
            self._writer = PackWriter(self._file)
        self._writer.add(cid, codec, raw_len, payload)
        self.stored_bytes += len(payload)
        if self._writer.size >= self._ctx.config.pack_size:
            self.flush()

    def flush(self) -> None:
        """Finish the open pack (if any), store it, and record it in the catalog and cache."""
        if self._writer is None or self._file is None or self._path is None:
            return
        pack_id = self._writer.finish()
        entries = self._writer.entries
        size = self._writer.size
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        path, self._writer, self._file, self._path = self._path, None, None, None
        record = PackRecord(pack_id, pack_key(pack_id), size, entries)
        try:
            self._ctx.blobs.put_file(record.key, path)
        finally:
            path.unlink(missing_ok=True)
        self._ctx.catalog.add_pack(record)
        self._ctx.cache.put_many(_cache_items(pack_id, entries))
        self.packs.append(record)

    def abort(self) -> None:
        """Drop the open pack's staging file (after a failure)."""
        if self._file is not None:
            self._file.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        self._writer, self._file, self._path = None, None, None


def _cache_items(pack_id: str, entries: list[PackEntry]) -> list[tuple[bytes, str, int, int, int, int]]:
    return [(e.chunk_id, pack_id, e.offset, e.stored_len, e.raw_len, e.codec) for e in entries]
