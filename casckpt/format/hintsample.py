"""Fingerprints of hinted tensors: a sample of a tensor's bytes, taken where a change hint
let a commit reuse the parent's chunks, so ``check --read-data`` can tell a wrong hint.

A commit that reuses a tensor's chunk ids because its caller vouched for it (a change
hint, :mod:`casckpt.engine.write.hint`) never reads the bytes it stores under them. It
records instead, in the version's manifest (``"hinted"``), a fingerprint of the bytes the
caller handed it: the store's chunk id (keyed in an encrypted store) of :data:`BLOCKS`
blocks of :data:`BLOCK` bytes (the whole tensor when it is at most :data:`WHOLE` bytes),
truncated to :data:`FINGERPRINT_BYTES`. Which blocks is drawn from the version's run, step
and the tensor's path (:func:`sample_spans`), so the check can recompute it from the
stored chunks, and a tensor is sampled elsewhere at every step.

It is a sample: a hint that was wrong about every block of a tensor (any dense update) is
caught, one wrong about ``k`` of its ``n`` blocks is missed with probability
``C(n-k, 16) / C(n, 16)`` (about ``(1 - 16/n)**k``): see docs/ARCHITECTURE.md ("Change
hints").

No I/O, no torch: the commit gathers the bytes, the check reads them from chunks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from blake3 import blake3

from casckpt.format.chunks import ChunkIds

BLOCK = 4096
"""Bytes per sampled block (blocks start at multiples of it; the last may be shorter)."""
BLOCKS = 16
"""Blocks sampled from a tensor of more than :data:`WHOLE` bytes."""
WHOLE = BLOCK * BLOCKS
"""A tensor of at most this many bytes is fingerprinted whole."""
FINGERPRINT_BYTES = 16
SCHEME = 1
"""The sampling written (``"v"`` of the manifest's ``"hinted"``): another is not checked."""
_SEED_CONTEXT = "casckpt 2026-12-06 hint sample offsets v1"
_PREFIX = b"casckpt hint fingerprint v1\0"  # never the bytes of a chunk of the same tensor


def sample_spans(run: str, step: int, path: str, nbytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the sampled bytes of the tensor at ``path`` (``nbytes`` long) in
    version ``run@step``, in ascending order: the whole tensor up to :data:`WHOLE` bytes,
    else :data:`BLOCKS` distinct blocks drawn (uniformly, without replacement) from a
    BLAKE3 stream seeded with ``run``, ``step`` and ``path``."""
    if nbytes <= WHOLE:
        return [(0, nbytes)] if nbytes else []
    blocks = -(-nbytes // BLOCK)
    stream = blake3(json.dumps([run, step, path]).encode("utf-8"), derive_key_context=_SEED_CONTEXT)
    chosen: set[int] = set()
    seek = 0
    while len(chosen) < BLOCKS:
        words = stream.digest(length=8 * BLOCKS, seek=seek)
        seek += len(words)
        for i in range(0, len(words), 8):
            chosen.add(int.from_bytes(words[i : i + 8], "little") % blocks)
            if len(chosen) == BLOCKS:
                break
    return [(b * BLOCK, min(nbytes, (b + 1) * BLOCK)) for b in sorted(chosen)]


def fingerprint(ids: ChunkIds, parts: Iterable[bytes | memoryview]) -> bytes:
    """The fingerprint of the sampled bytes ``parts`` (in :func:`sample_spans` order), with
    the store's chunk ids ``ids`` (keyed in an encrypted store: it says nothing of the bytes
    to whoever lacks the key)."""
    return ids(b"".join((_PREFIX, *parts)))[:FINGERPRINT_BYTES]
