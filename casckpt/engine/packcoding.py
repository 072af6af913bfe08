"""Erasure coding of packs: a pack's bytes to the objects it is stored as, and back.

A pack under ``none`` or ``replicate`` is stored as whole copies, checked
against the pack id itself; under ``ec:K+M`` as K+M shards, each a header
(:mod:`casckpt.format.shard`) naming its pack, index and the BLAKE3 of its
payload, then the fragment. Nothing here reads or writes a location.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from threading import Lock

from casckpt.catalog import PackLayout
from casckpt.errors import CorruptPackError
from casckpt.format import keys
from casckpt.format.chunks import object_id
from casckpt.format.shard import ShardHeader, encode_shard_header, payload_checksum
from casckpt.storage.erasure import DEFAULT_ALGORITHM, ErasureCode, Redundancy

_SUBSETS_TRIED = 64  # K-subsets tried when shards pass their checksums yet do not decode


@dataclass(frozen=True, slots=True)
class ShardPayload:
    """One object of a pack to write: a copy, or a shard (header + fragment) and its checksum."""

    data: bytes | memoryview
    checksum: str | None


def object_key(layout: PackLayout, index: int) -> str:
    """The key of object ``index`` of a pack: copies share the pack's key, shards have their own."""
    return layout.key if layout.scheme != "ec" else keys.shard_key(layout.id, index)


class ErasureCoder:
    """Encodes packs into the objects they are stored as and reconstructs packs from them.

    One :class:`ErasureCode` per (k, m, algorithm) is built on first use and
    kept for the life of the coder. Thread-safe.
    """

    def __init__(self) -> None:
        self._codes: dict[tuple[int, int, str], ErasureCode] = {}
        self._lock = Lock()

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
        key = keys.pack_key(pack_id)
        wanted = set(range(redundancy.shards) if only is None else only)
        if redundancy.kind != "ec":  # a copy is checked against the pack id itself
            layout = PackLayout(pack_id, key, len(data), redundancy.kind, 1, redundancy.m)
            return layout, {i: ShardPayload(data, None) for i in sorted(wanted)}
        code = self.code(redundancy.k, redundancy.m, algorithm)
        fragments, stripe, offset = code.encode(data)
        payloads: dict[int, ShardPayload] = {}
        for index, fragment in enumerate(fragments):
            fragments[index] = b""  # bound peak memory: each fragment is held once
            if index in wanted:
                checksum = payload_checksum(fragment)
                header = ShardHeader(pack_id, index, code.k, code.m, code.algorithm, len(data),
                                     len(fragment), offset, checksum)
                payloads[index] = ShardPayload(encode_shard_header(header) + fragment, checksum)
            del fragment
        layout = PackLayout(pack_id, key, len(data), "ec", code.k, code.m, code.algorithm, stripe, offset)
        return layout, payloads

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
            payloads[index] = ShardPayload(encode_shard_header(header) + fragment, checksum)
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
