"""Delta coding on commit: which base each new chunk is coded against, where its bytes are,
and when a chunk gets a new keyframe.

A chunk's base is the chunk at the same tensor path and position in the
parent version (the previous version of the run, or the fork point of a new
fork). Its raw bytes must be at hand: they come from :class:`BaseCache`, the
raw chunks of this process's recent commits kept in memory (bounded by
``delta_memory``, least recently used first out; 0 turns delta coding off) --
never read back from storage on the commit path.

What the cache holds is chosen so that delta coding never makes a commit
fatter than it pays for (docs/DEFAULTS.md): only chunks of multi-byte
elements of at least :data:`MIN_BASE` bytes; a full copy only of a chunk
whose delta paid (or whose 64 KiB probe says it will), and, for a chunk seen
for the first time, of at most :data:`FIRST_FULL` bytes per commit; of every
other eligible chunk only its first 64 KiB (:data:`SAMPLE`), which the next
commit probes against to decide whether the chunk is worth a full copy. A
chunk whose delta does not pay is dropped back to its sample.

A delta is kept only when it is clearly smaller than the plain encoding and
at most half the raw chunk (:data:`DELTA_MAX_RATIO`, :data:`DELTA_MAX_RAW`; the delta
policy, :mod:`casckpt.engine.write.encodepolicy`, sets its own bounds on both and on the
chain's restore cost). Which chunk is coded how is the encode plan's choice
(:class:`~casckpt.engine.write.encodepolicy.EncodePlan`); this module holds the bases,
the chain bookkeeping and what earlier commits learned per tensor (:class:`Lesson`).
When a chunk gets a new keyframe (:class:`ChainPolicy`): with a chain length
set on the run or store, after that many deltas (a fixed depth); by default
by cost -- when the chain's estimated restore cost (:func:`level_cost` per
delta, in restores of the keyframe; a sparse delta, patching only its
changed blocks, costs far less than a dense one) would pass :data:`RESTORE_BOUND`, or its
deltas' stored bytes would pass the keyframe's, or its depth the default
chain length. Chunks that near their bound together are staggered: a chunk
takes its keyframe early when one more delta would pass a threshold drawn
(from its chunk id) between half its bound and its bound, so no commit
rewrites every chunk at once.

The cache is a hint (invariant 6): a base is used only after the catalog says
it is live, and publishing re-checks every base a version's chunks need,
transitively.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry

if TYPE_CHECKING:  # the codecs load numpy: where chunks are encoded, never at open
    from casckpt.format.codecs import Probe

DELTA_MAX_RATIO = 0.8  # a delta must be at most this fraction of the plain encoding's size ...
DELTA_MAX_RAW = 0.5  # ... and of the raw chunk: a delta that saves less costs restores more than it saves
DELTA_SURE_RATIO = 0.25  # a delta this small of the raw chunk is kept without trying the plain encoding
_PROBE = 64 << 10  # a chunk over twice this is probed on its first 64 KiB before a full delta

SAMPLE = 64 << 10  # what the cache keeps of a chunk that is not (yet) worth a full copy: the probe's bytes
MIN_BASE = 1 << 10  # smaller chunks (and chunks of 1-byte elements) are never kept as bases
FIRST_FULL = 256 << 20  # full copies per commit of chunks seen for the first time (the rest: samples)

RESTORE_BOUND = 0.5  # by cost: a chain's restore costs at most 1.5x its keyframe's (BENCHMARKS.md)
LEVEL_BASE = 0.1  # one delta level's restore cost, in keyframe restores: a pass over the chunk ...
LEVEL_PER_BYTE = 1.0  # ... plus decompressing its payload (per payload byte over raw bytes)
SPARSE_LEVEL_BASE = 0.02  # a sparse delta patches its changed blocks in place: no pass over the chunk
SPARSE_MAX = 0.25  # a delta is sparse when at most this fraction of the chunk's 64-byte blocks changed
STAGGER_FROM = 0.5  # by cost: past this fraction of its bound a chain may take its keyframe early


def level_cost(raw_len: int, payload_len: int, sparse: bool = False) -> float:
    """Estimated cost of decoding one delta level, in restores of a keyframe of the same chunk."""
    return (SPARSE_LEVEL_BASE if sparse else LEVEL_BASE) + LEVEL_PER_BYTE * payload_len / max(raw_len, 1)


@dataclass(frozen=True, slots=True)
class CachedChunk:
    """A committed chunk's raw bytes (only the first :data:`SAMPLE` bytes when ``sample``) and
    the state of the chain it ends: deltas deep (0: a keyframe), estimated restore cost, stored
    bytes of its deltas since the keyframe, and the keyframe's stored bytes."""

    data: memoryview
    depth: int
    sample: bool = False
    cost: float = 0.0
    delta_bytes: int = 0
    key_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ChainPolicy:
    """When a chunk gets a new keyframe (see the module docstring).

    ``chain``: the most deltas deep a chunk may be; ``by_cost``: also bound each chain's
    restore cost (``restore_bound``) and its deltas' bytes (the keyframe's), staggered.
    """

    chain: int
    by_cost: bool = False
    restore_bound: float = RESTORE_BOUND
    max_raw: float = DELTA_MAX_RAW

    def fraction(self, state: CachedChunk) -> float:
        """How far along its bounds the chain ending in ``state`` is (1: at a bound)."""
        if not self.by_cost:
            return state.depth / max(self.chain, 1)
        return max(state.cost / self.restore_bound, state.delta_bytes / max(state.key_bytes, 1),
                   state.depth / max(self.chain, 1))

    def due(self, base: CachedChunk, cid: bytes) -> bool:
        """Whether the chunk ``cid``, whose base is ``base``, takes a keyframe without trying a
        delta: its base is at the depth bound, or (by cost) one more delta like the chain's
        average would take it past a threshold drawn between :data:`STAGGER_FROM` and 1 of its
        bounds (``cid`` draws it, so chunks nearing their bounds together take their keyframes
        over several commits)."""
        if base.depth >= self.chain:
            return True
        if not self.by_cost or base.depth == 0:
            return False
        draw = int.from_bytes(cid[:8], "little") / float(1 << 64)
        threshold = STAGGER_FROM + (1.0 - STAGGER_FROM) * draw
        return self.fraction(base) * (base.depth + 1) / base.depth >= threshold

    def extend(self, base: CachedChunk, raw_len: int, payload_len: int,
               sparse: bool = False) -> CachedChunk | None:
        """The chain state after a delta of ``payload_len`` bytes (``sparse``: a sparse one) on
        ``base`` (data left empty), or None if that chain would pass the policy's bounds."""
        state = CachedChunk(memoryview(b""), base.depth + 1, False,
                            base.cost + level_cost(raw_len, payload_len, sparse),
                            base.delta_bytes + payload_len, base.key_bytes)
        if state.depth > self.chain:
            return None
        if self.by_cost and (state.cost > self.restore_bound or state.delta_bytes > state.key_bytes):
            return None
        return state

    def probe_limit(self, base: CachedChunk, raw_len: int) -> float:
        """The largest delta, as a fraction of the raw chunk, that may still extend ``base``'s chain."""
        if not self.by_cost:
            return self.max_raw
        by_cost = (self.restore_bound - base.cost - SPARSE_LEVEL_BASE) / LEVEL_PER_BYTE
        by_bytes = (base.key_bytes - base.delta_bytes) / max(raw_len, 1)
        return min(self.max_raw, by_cost, by_bytes)


@dataclass(frozen=True, slots=True)
class Lesson:
    """What the last commits learned about one tensor of a run (see
    :mod:`casckpt.engine.write.encodepolicy`): its plain probe (which planes pay), the codec
    and ratio its chunks got, and its last delta's size over its plain encoding."""

    probe: Probe | None = None
    codec: int | None = None
    ratio: float | None = None
    delta: float | None = None


LESSONS = 1 << 16  # tensors of a run whose lessons a process keeps, least recently learned first out


class BaseCache:
    """Raw bytes of recently committed chunks, by chunk id, for delta-coding later commits.

    Thread-safe. Holds at most ``budget`` bytes (0: delta coding off); the least
    recently used chunks leave first. Also remembers the last manifest this
    process committed for each run (a background commit's parent may not be
    visible yet).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._chunks: OrderedDict[bytes, CachedChunk] = OrderedDict()
        self._bytes = 0
        self._manifests: dict[str, tuple[str, Manifest]] = {}
        self._lessons: dict[str, dict[str, Lesson]] = {}
        self._lock = threading.Lock()

    def lessons(self, run: str) -> dict[str, Lesson]:
        """What earlier commits of ``run`` learned, by tensor path (a copy: a commit plans with
        what was known when it began, whatever its chunks learn meanwhile)."""
        with self._lock:
            return dict(self._lessons.get(run, {}))

    def learn(self, run: str, path: str, *, probe: Probe | None = None, codec: int | None = None,
              ratio: float | None = None, delta: float | None = None) -> None:
        """Record what a commit found for the tensor at ``path`` of ``run`` (fields left None keep
        what was known)."""
        with self._lock:
            known = self._lessons.setdefault(run, {})
            old = known.pop(path, None) or Lesson()
            known[path] = Lesson(probe if probe is not None else old.probe,
                                 codec if codec is not None else old.codec,
                                 ratio if ratio is not None else old.ratio,
                                 delta if delta is not None else old.delta)
            while len(known) > LESSONS:  # least recently learned first out
                del known[next(iter(known))]

    @property
    def held(self) -> int:
        """Bytes the cache holds now."""
        with self._lock:
            return self._bytes

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


def _extents_by_path(manifest: Manifest) -> dict[tuple[str, int | None, tuple[int, ...] | None], ExtentEntry]:
    users = Counter(t.extent for t in manifest.tensors)
    return {(t.path, t.rank, t.global_offset): manifest.extents[t.extent] for t in manifest.tensors
            if users[t.extent] == 1}


def candidate_bases(parent: Manifest, tensors: Sequence[TensorEntry], extents: Sequence[ExtentEntry],
                    new_ids: Iterable[bytes]) -> dict[bytes, bytes]:
    """New chunk id -> the parent's chunk at the same tensor path (and rank, and piece offset for
    a piece of a tensor) and position (same length)."""
    before = _extents_by_path(parent)
    wanted = set(new_ids)
    found: dict[bytes, bytes] = {}
    for t in tensors:
        old = before.get((t.path, t.rank, t.global_offset))
        extent = extents[t.extent]
        if old is None or old.chunk_size != extent.chunk_size or old.phase != extent.phase:
            continue
        old_spans = old.spans()
        for i, ((start, end), cid) in enumerate(zip(extent.spans(), extent.chunks, strict=True)):
            if cid not in wanted or cid in found or i >= len(old.chunks):
                continue
            if old_spans[i] == (start, end) and old.chunks[i] != cid:
                found[cid] = old.chunks[i]
    return found
