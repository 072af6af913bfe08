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

import struct
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
_WORDS = struct.Struct(f"<{2 * BLOCKS}Q")  # drawn at a time: rarely fewer than BLOCKS distinct blocks
_SEED_KEY = blake3(b"casckpt 2026-12-06 hint sample offsets v1").digest()  # keyed: derived once
_PREFIX = b"casckpt hint fingerprint v1\0"  # never the bytes of a chunk of the same tensor


def sample_spans(run: str, step: int, path: str, nbytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the sampled bytes of the tensor at ``path`` (``nbytes`` long) in
    version ``run@step``, in ascending order: the whole tensor up to :data:`WHOLE` bytes,
    else :data:`BLOCKS` distinct blocks drawn (uniformly, without replacement) from a
    BLAKE3 stream seeded with ``run``, ``step`` and ``path``."""
    if nbytes <= WHOLE:
        return [(0, nbytes)] if nbytes else []
    blocks = -(-nbytes // BLOCK)
    # a run name holds no NUL (``[A-Za-z0-9._-]``) and a step is digits: the seed is unambiguous
    stream = blake3(f"{run}\0{step}\0{path}".encode("utf-8", "surrogatepass"), key=_SEED_KEY)
    chosen: dict[int, None] = {}  # the first BLOCKS distinct draws of 64-bit words mod blocks
    seek = 0
    while len(chosen) < BLOCKS:
        words = stream.digest(length=_WORDS.size, seek=seek)
        seek += len(words)
        chosen.update(dict.fromkeys([word % blocks for word in _WORDS.unpack(words)]))
    spans = [(b * BLOCK, (b + 1) * BLOCK) for b in sorted(list(chosen)[:BLOCKS])]
    if spans[-1][1] > nbytes:  # the last block is short
        spans[-1] = (spans[-1][0], nbytes)
    return spans


def fingerprint(ids: ChunkIds, parts: Iterable[bytes | memoryview]) -> bytes:
    """The fingerprint of the sampled bytes ``parts`` (in :func:`sample_spans` order), with
    the store's chunk ids ``ids`` (keyed in an encrypted store: it says nothing of the bytes
    to whoever lacks the key)."""
    return ids(b"".join((_PREFIX, *parts)))[:FINGERPRINT_BYTES]
