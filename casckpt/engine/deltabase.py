"""Delta coding on commit: which base each new chunk is coded against, and where its bytes are.

A chunk's base is the chunk at the same tensor path and position in the
parent version (the previous version of the run, or the fork point of a new
fork). Its raw bytes must be at hand: they come from :class:`BaseCache`, the
raw chunks of this process's recent commits kept in memory (bounded by
``delta_memory``, least recently used first out) -- never read back from
storage on the commit path. A chunk whose base is not cached, not live in the
catalog, or already at the end of a chain of ``delta_chain`` deltas is stored
plainly (a keyframe). A delta is kept only when it is clearly smaller than the
plain encoding and at most half the raw chunk (:data:`DELTA_MAX_RATIO`,
:data:`DELTA_MAX_RAW`): a delta that saves less than that would cost every
restore of the chain more than it saves.

The cache is a hint (invariant 6): a base is used only after the catalog says
it is live, and publishing re-checks every base a version's chunks need,
transitively.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from casckpt.format.codecs import delta_ratio_probe, encode_delta
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry

DELTA_MAX_RATIO = 0.8  # a delta must be at most this fraction of the plain encoding's size ...
DELTA_MAX_RAW = 0.5  # ... and of the raw chunk: a delta that saves less costs restores more than it saves
DELTA_SURE_RATIO = 0.25  # a delta this small of the raw chunk is kept without trying the plain encoding
_PROBE = 64 << 10  # a chunk over twice this is probed on its first 64 KiB before a full delta


@dataclass(frozen=True, slots=True)
class CachedChunk:
    """A committed chunk's raw bytes and how many deltas deep it is stored (0: plainly)."""

    data: memoryview
    depth: int


class BaseCache:
    """Raw bytes of recently committed chunks, by chunk id, for delta-coding later commits.

    Thread-safe. Holds at most ``budget`` bytes; the least recently used chunks
    leave first. Also remembers the last manifest this process committed for
    each run (a background commit's parent may not be visible yet).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._chunks: OrderedDict[bytes, CachedChunk] = OrderedDict()
        self._bytes = 0
        self._manifests: dict[str, tuple[str, Manifest]] = {}
        self._lock = threading.Lock()

    def get(self, cid: bytes) -> CachedChunk | None:
        """The cached chunk (marked recently used), or None."""
        with self._lock:
            found = self._chunks.get(cid)
            if found is not None:
                self._chunks.move_to_end(cid)
            return found

    def keep(self, chunks: Mapping[bytes, CachedChunk], used: Iterable[bytes] = ()) -> None:
        """Add a committed version's new chunks; mark the chunks it reused (``used``) as recent."""
        with self._lock:
            for cid in used:
                if cid in self._chunks:
                    self._chunks.move_to_end(cid)
            for cid, chunk in chunks.items():
                if cid in self._chunks or len(chunk.data) > self.budget:
                    continue
                self._chunks[cid] = chunk
                self._bytes += len(chunk.data)
            while self._bytes > self.budget and self._chunks:
                _, old = self._chunks.popitem(last=False)
                self._bytes -= len(old.data)

    def drop(self, ids: Iterable[bytes]) -> None:
        """Forget chunks no later commit will be coded against."""
        with self._lock:
            for cid in ids:
                gone = self._chunks.pop(cid, None)
                if gone is not None:
                    self._bytes -= len(gone.data)

    def remember(self, run: str, version_id: str, manifest: Manifest) -> None:
        """The manifest of ``run``'s latest version snapshotted by this process."""
        with self._lock:
            self._manifests[run] = (version_id, manifest)

    def manifest(self, run: str, version_id: str) -> Manifest | None:
        """The remembered manifest of ``run`` if it is the version ``version_id``."""
        with self._lock:
            found = self._manifests.get(run)
        return found[1] if found is not None and found[0] == version_id else None


def _extents_by_path(manifest: Manifest) -> dict[tuple[str, int | None], ExtentEntry]:
    users: dict[int, int] = {}
    for t in manifest.tensors:
        users[t.extent] = users.get(t.extent, 0) + 1
    return {(t.path, t.rank): manifest.extents[t.extent] for t in manifest.tensors
            if users[t.extent] == 1 and not t.is_shard}


def candidate_bases(parent: Manifest, tensors: Sequence[TensorEntry], extents: Sequence[ExtentEntry],
                    new_ids: Iterable[bytes]) -> dict[bytes, bytes]:
    """New chunk id -> the parent's chunk at the same tensor path and position (same length)."""
    before = _extents_by_path(parent)
    wanted = set(new_ids)
    found: dict[bytes, bytes] = {}
    for t in tensors:
        old = before.get((t.path, t.rank))
        extent = extents[t.extent]
        if old is None or t.is_shard or old.chunk_size != extent.chunk_size or old.phase != extent.phase:
            continue
        old_spans = old.spans()
        for i, ((start, end), cid) in enumerate(zip(extent.spans(), extent.chunks, strict=True)):
            if cid not in wanted or cid in found or i >= len(old.chunks):
                continue
            if old_spans[i] == (start, end) and old.chunks[i] != cid:
                found[cid] = old.chunks[i]
    return found


class DeltaPlan:
    """How one commit delta-codes its new chunks, and the raw copies it keeps for the next.

    Thread-safe: the encode pool calls :meth:`encode` concurrently.
    """

    def __init__(self, bases: BaseCache, candidates: Mapping[bytes, bytes], live: set[bytes],
                 chain: int, level: int) -> None:
        self.bases, self.candidates, self.live, self.chain, self.level = bases, candidates, live, chain, level
        self.fresh: dict[bytes, CachedChunk] = {}
        self._fresh_bytes = 0
        self._lock = threading.Lock()

    def encode(self, cid: bytes, data: memoryview, align: int, owned: bool,
               plain: Callable[[], tuple[int, bytes | memoryview]],
               ) -> tuple[int, bytes | memoryview, bytes | None]:
        """``(codec, payload, base id)``: a delta when its base is at hand and it pays, else the
        ``plain()`` encoding (not even computed when the delta is tiny)."""
        base = self.candidates.get(cid)
        cached = self.bases.get(base) if base is not None and base in self.live else None
        unpromising = len(data) > 2 * _PROBE and cached is not None and len(cached.data) == len(data) \
            and delta_ratio_probe(data, cached.data, align, self.level) > DELTA_MAX_RAW
        if cached is None or cached.depth >= self.chain or len(cached.data) != len(data) or unpromising:
            self._keep(cid, data, owned, 0)
            return (*plain(), None)
        delta_codec, delta = encode_delta(data, cached.data, align, self.level)
        if len(delta) > DELTA_SURE_RATIO * len(data):  # compare with the plain encoding
            codec, payload = plain()
            if len(delta) > min(DELTA_MAX_RATIO * len(payload), DELTA_MAX_RAW * len(data)):
                self._keep(cid, data, owned, 0)
                return codec, payload, None
        self._keep(cid, data, owned, cached.depth + 1)
        return int(delta_codec), delta, base

    def _keep(self, cid: bytes, data: memoryview, owned: bool, depth: int) -> None:
        with self._lock:
            if self._fresh_bytes + len(data) > self.bases.budget:
                return
            self._fresh_bytes += len(data)
        copy = data if owned else memoryview(np.frombuffer(data, dtype=np.uint8).copy())  # type: ignore[arg-type]
        with self._lock:
            self.fresh[cid] = CachedChunk(copy, depth)

    def published(self, used: Iterable[bytes]) -> None:
        """The version is visible: its new chunks become bases for the next commit, and the
        parent's chunks they replace are dropped (the next commit is coded against this one)."""
        kept = set(used)
        self.bases.keep(self.fresh, kept)
        self.bases.drop(base for base in set(self.candidates.values()) if base not in kept)
