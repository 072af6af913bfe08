"""Erasure coding of packs: a pack's bytes to the objects it is stored as, and back.

A pack under ``none`` or ``replicate`` is stored as whole copies, checked
against the pack id itself; under ``ec:K+M`` as K+M shards, each a header
(:mod:`casckpt.format.shard`) naming its pack, index and the BLAKE3 of its
payload, then the fragment. Nothing here reads or writes a location.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

from casckpt.catalog import PackLayout
from casckpt.errors import CorruptPackError, StorageError
from casckpt.format import objectnames
from casckpt.format.chunks import object_id
from casckpt.format.shard import ShardHeader, encode_shard_header, payload_checksum
from casckpt.storage.base import BlobStore
from casckpt.storage.ecpool import EncodePool, ShardFile, WorkersUnavailableError
from casckpt.storage.erasure import DEFAULT_ALGORITHM, ErasureCode, Redundancy

log = logging.getLogger(__name__)

_SUBSETS_TRIED = 64  # K-subsets tried when shards pass their checksums yet do not decode


@dataclass(frozen=True, slots=True)
class ShardPayload:
    """One object of a pack to write: a copy, or a shard (header + fragment) and its checksum.

    ``data`` holds its bytes, or is the staging file holding them (made by an encoding
    worker), which :meth:`put` may consume; ``size`` is the object's length either way.
    """

    data: bytes | memoryview | Path
    checksum: str | None
    size: int

    @classmethod
    def of(cls, data: bytes | memoryview, checksum: str | None) -> ShardPayload:
        """A payload held in memory."""
        return cls(data, checksum, len(data))

    def put(self, blobs: BlobStore, key: str) -> None:
        """Write the object under ``key`` (a staging file is moved or uploaded).

        Raises:
            StorageError: the location refused it.
        """
        if isinstance(self.data, Path):
            blobs.put_file(key, self.data)
        else:
            blobs.put(key, self.data)


def object_key(layout: PackLayout, index: int) -> str:
    """The key of object ``index`` of a pack: copies share the pack's key, shards have their own."""
    return layout.key if layout.scheme != "ec" else objectnames.shard_name(layout.id, index)


class ErasureCoder:
    """Encodes packs into the objects they are stored as and reconstructs packs from them.

    One :class:`ErasureCode` per (k, m, algorithm) is built on first use and
    kept for the life of the coder. With ``workers`` > 0, :meth:`encode_file`
    encodes in up to that many worker processes (at most half the CPUs; the
    first starts when :meth:`prepare` or :meth:`encode_file` first needs it,
    see :class:`~casckpt.storage.ecpool.EncodePool`), so encoding never holds
    this process's GIL and, with four cores or more, the packs a commit has in
    flight are encoded side by side; everything else runs here. Thread-safe;
    call :meth:`close` last.
    """

    def __init__(self, workers: int = 0) -> None:
        self._codes: dict[tuple[int, int, str], ErasureCode] = {}
        self._lock = Lock()
        # at most half the cores: a worker's first pack faults in ~4 packs' bytes of fresh
        # memory, and on 2 cores a second worker measured +0.25 to +1.5 CPU-s per commit for
        # no wall time (docs/perf/erasure2.md): the hashing and compression hold the other core
        workers = min(workers, max(1, (os.cpu_count() or 2) // 2))
        self._pool = EncodePool(workers) if workers > 0 else None

    def prepare(self, redundancy: Redundancy, packs: int = 1) -> None:
        """About to fill a pack of ``redundancy`` with ``packs`` of them (this one included)
        to be encoded at once: start an encoding worker if that many need one more."""
        if redundancy.kind == "ec" and self._pool is not None:
            self._pool.warm(packs)

    def worker_pids(self) -> list[int]:
        """The process ids of the encoding workers now idle (none before the first is needed)."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def code(self, k: int, m: int, algorithm: str) -> ErasureCode:
        """The code for ``k`` data and ``m`` parity fragments (cached).

        Raises:
            InvalidArgumentError: pyeclib lacks the algorithm or refuses k, m.
        """
        with self._lock:
            code = self._codes.get((k, m, algorithm))
            if code is None:
                code = self._codes[(k, m, algorithm)] = ErasureCode(k, m, algorithm)
            return code

    def encode(self, pack_id: str, data: bytes, redundancy: Redundancy,
               algorithm: str = DEFAULT_ALGORITHM, only: Sequence[int] | None = None,
               ) -> tuple[PackLayout, dict[int, ShardPayload]]:
        """The objects a pack is stored as, by index (only ``only``, if given), and the
        layout they make (its shard rows still empty: placement fills them)."""
        key = objectnames.pack_name(pack_id)
        wanted = set(range(redundancy.shards) if only is None else only)
        if redundancy.kind != "ec":  # a copy is checked against the pack id itself
            layout = PackLayout(pack_id, key, len(data), redundancy.kind, 1, redundancy.m)
            return layout, {i: ShardPayload.of(data, None) for i in sorted(wanted)}
        code = self.code(redundancy.k, redundancy.m, algorithm)
        stripe, offset, shards = code.shards(pack_id, data, wanted)
        payloads = {shard.index: ShardPayload.of(shard.header + shard.fragment, shard.checksum)
                    for shard in shards}
        layout = PackLayout(pack_id, key, len(data), "ec", code.k, code.m, code.algorithm, stripe, offset)
        return layout, payloads

    def encode_file(self, pack_id: str, path: Path, size: int, redundancy: Redundancy,
                    ) -> tuple[PackLayout, dict[int, ShardPayload]]:
        """Like :meth:`encode`, of the finished pack file ``path`` (``size`` bytes), which is
        removed once encoded.

        An erasure-coded pack is encoded by a worker process when the coder has
        workers: its payloads are then staging files beside ``path`` (the same bytes
        :meth:`encode` gives), which storing them may consume; the caller removes what
        is left. Where no worker can start, this warns once and encodes here.

        Raises:
            EncodeWorkerError: the worker died while encoding (nothing was stored).
            StorageFullError: no room for the shard files beside ``path``.
            StorageError: ``path`` cannot be read, or the encode failed.
        """
        pool = self._pool
        if redundancy.kind == "ec" and pool is not None:
            out = [path.with_name(f"{path.name}.s{i}") for i in range(redundancy.shards)]
            try:
                encoded = pool.encode(path, pack_id, size, redundancy.k, redundancy.m,
                                      DEFAULT_ALGORITHM, out)
                _check_shard_files(pack_id, encoded.shards)
            except BaseException as exc:
                for shard in out:  # what a worker that died mid-write left behind
                    shard.unlink(missing_ok=True)
                if not isinstance(exc, WorkersUnavailableError):
                    raise
                with self._lock:  # the upload threads may all find out at once: say it once
                    first, self._pool = self._pool is pool, None
                if first:
                    log.warning("%s; erasure coding runs in this process instead (slower: it "
                                "holds the GIL)", exc)
            else:
                path.unlink(missing_ok=True)
                layout = PackLayout(pack_id, objectnames.pack_name(pack_id), size, "ec", redundancy.k,
                                    redundancy.m, DEFAULT_ALGORITHM, encoded.stripe, encoded.offset)
                return layout, {s.index: ShardPayload(s.path, s.checksum, s.size) for s in encoded.shards}
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read the staging pack {path}: {exc}") from exc
        path.unlink(missing_ok=True)
        return self.encode(pack_id, data, redundancy)

    def payloads_from_fragments(self, layout: PackLayout, indexes: Sequence[int],
                                fragments: dict[int, bytes]) -> dict[int, ShardPayload] | None:
        """Shard objects for ``indexes`` from fragments at hand (reconstructing the others),
        each checked against the checksum the catalog recorded; None: encode instead."""
        if layout.scheme != "ec" or len(fragments) < layout.k:
            return None
        code = self.code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
        try:
            have = dict(fragments)
            have.update(code.reconstruct(fragments, [i for i in indexes if i not in have],
                                         f"pack {layout.id}"))
        except CorruptPackError:
            return None
        payloads = {}
        for index in indexes:
            row, fragment = layout.shard(index), have[index]
            checksum = payload_checksum(fragment)
            if row is None or row.checksum != checksum:
                return None
            header = ShardHeader(layout.id, index, layout.k, layout.m, code.algorithm, layout.size,
                                 len(fragment), layout.data_offset or 0, checksum)
            payloads[index] = ShardPayload.of(encode_shard_header(header) + fragment, checksum)
        return payloads

    def reconstruct(self, layout: PackLayout, payloads: dict[int, bytes],
                    fragments: dict[int, bytes]) -> tuple[bytes | None, set[int]]:
        """Reconstruct the pack from verified payloads: (pack or None, payloads inconsistent
        with it). The pack returned always hashes to its id.

        Fast path: the data fragments at hand, plus the missing ones
        reconstructed (kept in ``fragments`` with the healthy ones, for
        healing). Payloads are checked against their checksums, but one
        damaged before it was hashed would still pass; so when that does
        not give the pack id, all of them are decoded together, then subsets
        of K, and the payloads the winning pack does not re-encode to are reported.
        """
        if not payloads:
            return None, set()
        if layout.scheme != "ec":
            return next(iter(payloads.values())), set()
        if len(payloads) < layout.k:
            return None, set()
        code = self.code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
        fragments.update(payloads)
        try:
            fragments.update(code.reconstruct(
                payloads, [i for i in range(layout.k) if i not in payloads], f"pack {layout.id}"))
            start, stripe = layout.data_offset or 0, layout.stripe or 0
            data = b"".join(memoryview(fragments[i])[start : start + stripe]
                            for i in range(layout.k))[: layout.size]
            if object_id(data) == layout.id:
                return data, set()
        except CorruptPackError:
            pass
        fragments.clear()

        def attempt(subset: dict[int, bytes]) -> bytes | None:
            try:
                data = code.decode(subset, layout.size, f"pack {layout.id}")
            except CorruptPackError:
                return None
            return data if object_id(data) == layout.id else None

        whole = attempt(payloads)
        if whole is not None:
            return whole, set()
        for combo in itertools.islice(itertools.combinations(sorted(payloads), layout.k), _SUBSETS_TRIED):
            whole = attempt({i: payloads[i] for i in combo})
            if whole is not None:
                encoded, _, _ = code.encode(whole)
                return whole, {i for i, p in payloads.items() if p != encoded[i]}
        return None, set()


def _check_shard_files(pack_id: str, shards: Sequence[ShardFile]) -> None:
    """A worker's shard files are as long as it says (a stat each; their bytes are not read
    back): a short or missing one is never stored under a checksum it does not match.

    Raises:
        StorageError: a shard file is missing or of another length.
    """
    for shard in shards:
        try:
            found: int | str = shard.path.stat().st_size
        except OSError as exc:
            found = f"unreadable ({exc})"
        if found != shard.size:
            raise StorageError(
                f"the erasure-coding worker's shard {shard.index} of pack {pack_id} ({shard.path}) "
                f"is {found} bytes, not the {shard.size} it reported: nothing was published; "
                "commit again, and check the disk holding the store's staging directory")
