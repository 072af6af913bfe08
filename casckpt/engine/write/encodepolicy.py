"""How a commit encodes its new chunks: plain, byte planes, full-frame zstd or an XOR delta,
chosen per tensor from what earlier commits of the run learned.

Tensors of a training state change in ways their role predicts (:func:`role`): weights move a
little each step, so a delta on the last commit's bytes can pay; optimizer moments are
decayed every step, so their deltas never do; every float's sign/exponent plane compresses,
its mantissa planes do not. What the last commit found for each run and tensor (a
:class:`Lesson`: the probe, the codec chosen, its ratio and the delta's ratio to the plain
encoding) is kept on the process's :class:`~casckpt.engine.memory.deltabase.BaseCache`, so
the next commit skips the probes and deltas whose outcome it knows, and re-probes one chunk
in :data:`REPROBE` of each tensor to follow drift. A process with no lessons starts from
priors by role.

The delta policy (:data:`POLICIES`, a store or run setting) bounds what a delta may cost a
restore: ``off`` stores no deltas; ``balanced`` (the default) keeps every chain's estimated
restore within 1.2x a keyframe's and codes dense deltas only for tensors whose deltas were
at most :data:`BALANCED_DENSE` of their plain encoding; ``max`` keeps chains within 2x a
keyframe. A chain length set on the run or store (``set_delta_chain``) overrides the policy's
bound with a fixed depth.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from casckpt.catalog.deltas import delta_policy_for, delta_policy_name
from casckpt.engine.context import EngineContext
from casckpt.engine.memory import deltabase
from casckpt.engine.memory.deltabase import (
    _PROBE,
    DELTA_MAX_RATIO,
    DELTA_MAX_RAW,
    DELTA_SURE_RATIO,
    MIN_BASE,
    SPARSE_MAX,
    BaseCache,
    CachedChunk,
    ChainPolicy,
    Lesson,
    candidate_bases,
)
from casckpt.format.codecs import (
    _SAMPLE_BYTES,
    CompressionPolicy,
    Probe,
    delta_ratio_probe,
    encode_delta,
    encode_probed,
    probe,
    sparse_delta,
)
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry

REPROBE = 16  # one chunk in this many (drawn from its id) is probed again though its lesson is known
BALANCED_DENSE = 0.6  # balanced: a dense delta must be at most this fraction of the plain encoding


class Role(enum.Enum):
    """What a tensor is to training, which predicts how it changes between commits."""

    WEIGHT = "weight"  # moves a little each step: deltas may pay
    MOMENT1 = "moment1"  # first moment (exp_avg, momentum_buffer): decayed every step
    MOMENT2 = "moment2"  # second moment (exp_avg_sq): decayed every step
    OTHER = "other"  # steps, counters, buffers


def role(path: str) -> Role:
    """The role of the tensor at ``path`` in a saved state (its key path, ``/``- or ``.``-joined)."""
    leaf = path.replace("/", ".").rsplit(".", 1)[-1]
    if leaf in ("exp_avg", "momentum_buffer"):
        return Role.MOMENT1
    if leaf in ("exp_avg_sq", "max_exp_avg_sq"):
        return Role.MOMENT2
    if leaf in ("step", "state_step") or "optim" in path.split(".", 1)[0].split("/", 1)[0]:
        return Role.OTHER
    return Role.WEIGHT


@dataclass(frozen=True, slots=True)
class DeltaPolicy:
    """A named delta policy: may deltas be tried at all, the bound on a chain's estimated
    restore cost (in keyframe restores over one), and how small a dense delta must be."""

    name: str
    deltas: bool
    restore_bound: float
    dense_max: float
    max_raw: float = DELTA_MAX_RAW  # and at most this fraction of the raw chunk


POLICIES: Mapping[str, DeltaPolicy] = {
    "off": DeltaPolicy("off", False, 0.0, 0.0),
    "balanced": DeltaPolicy("balanced", True, 0.2, BALANCED_DENSE),
    "max": DeltaPolicy("max", True, 1.0, DELTA_MAX_RATIO, 0.9),
}
"""The delta policies by name; restore cost of a chain's end at most 1x, 1.2x and 2x a keyframe's."""
DEFAULT_POLICY = "balanced"


def encode_plan(ctx: EngineContext, run: str, parent_manifest: Manifest | None,
                entries: Sequence[TensorEntry], extents: Sequence[ExtentEntry], new_ids: Iterable[bytes],
                *, bases: Mapping[bytes, bytes] | None = None) -> EncodePlan:
    """How one commit to ``run`` encodes ``new_ids`` (chunks of ``entries``' ``extents``): delta
    bases from ``parent_manifest`` (or the candidate ``bases`` already found), the run's delta
    policy, and the lessons earlier commits of the run left."""
    chain, by_cost = delta_policy_for(ctx.catalog, run)
    policy = POLICIES[delta_policy_name(ctx.catalog, run)]
    deltas = chain > 0 and ctx.bases.budget > 0 and (policy.deltas or not by_cost)
    if not deltas:
        found: Mapping[bytes, bytes] = {}
    elif bases is not None:
        found = bases
    else:
        found = candidate_bases(parent_manifest, entries, extents, new_ids) if parent_manifest else {}
    cost = policy.restore_bound if by_cost else 1e9
    plan = EncodePlan(ctx.bases, run, found, live_bases(ctx, found) if found else set(),
                      ChainPolicy(chain, by_cost, cost, policy.max_raw) if deltas else None,
                      policy, CompressionPolicy(level=ctx.config.zstd_level, enabled=ctx.config.compress))
    plan.name(entries, extents)
    return plan


def plain_plan(ctx: EngineContext) -> EncodePlan:
    """A plan for chunks of no run (tree migration, rewrites of lost chunks): no deltas, no
    lessons, every chunk probed."""
    return EncodePlan(ctx.bases, "", {}, set(), None, POLICIES["off"],
                      CompressionPolicy(level=ctx.config.zstd_level, enabled=ctx.config.compress))


def live_bases(ctx: EngineContext, bases: Mapping[bytes, bytes]) -> set[bytes]:
    """The candidate ``bases`` held in memory whose chunks are still live in the store."""
    cached = [b for b in set(bases.values()) if ctx.bases.get(b) is not None]
    return {bytes.fromhex(h) for h in ctx.catalog.find_chunks((b.hex() for b in cached), live_only=True)}


Encoding = tuple[int, "bytes | memoryview", "bytes | None"]  # codec, payload, base id


class EncodePlan:
    """How one commit encodes its new chunks, and the raw copies and lessons it keeps for the next.

    Thread-safe: the encode pool calls :meth:`encode` concurrently.
    """

    def __init__(self, bases: BaseCache, run: str, candidates: Mapping[bytes, bytes], live: set[bytes],
                 chain: ChainPolicy | None, policy: DeltaPolicy, compression: CompressionPolicy) -> None:
        self.bases, self.run, self.candidates, self.live = bases, run, candidates, live
        self.chain, self.policy, self.compression = chain, policy, compression
        self.paths: dict[bytes, str] = {}
        self.known = bases.lessons(run) if run else {}  # what earlier commits learned, as of now
        self.level = compression.level
        self.fresh: dict[bytes, CachedChunk] = {}
        self.probes_skipped = 0
        self._deltas: dict[str, float] = {}  # path -> the best delta / plain ratio this commit saw
        self._fresh_bytes = 0
        self._first_full = deltabase.FIRST_FULL
        self._lock = threading.Lock()

    def name(self, entries: Sequence[TensorEntry], extents: Sequence[ExtentEntry]) -> None:
        """Say which tensor each chunk of ``entries``' ``extents`` belongs to (for its lesson)."""
        for t in entries:
            for cid in extents[t.extent].chunks:
                self.paths.setdefault(cid, t.path)

    # -- plain encoding ----------------------------------------------------------------------

    def plain(self, cid: bytes, data: memoryview, align: int) -> tuple[int, bytes | memoryview]:
        """The plain (non-delta) encoding: probed, unless the tensor's lesson says what pays."""
        path = self.paths.get(cid)
        lesson = self.known.get(path) if path is not None else None
        width = align if align in (2, 4, 8) and len(data) % align == 0 else 1
        if lesson is not None and lesson.probe is not None and lesson.probe.width == width \
                and cid[0] % REPROBE and self.compression.enabled:
            with self._lock:
                self.probes_skipped += 1
            found = lesson.probe
        else:
            sample = memoryview(data)[: min(len(data), _SAMPLE_BYTES) // width * width]
            found = probe(sample, width, self.level) if len(data) >= 64 and self.compression.enabled \
                else Probe(width, 0, 1.0, 1.0)
        codec, payload = encode_probed(data, width, found, self.compression)
        if path is not None and len(data) >= 64:
            self.bases.learn(self.run, path, probe=found, codec=int(codec), ratio=len(payload) / len(data))
        return int(codec), payload

    # -- deltas ------------------------------------------------------------------------------

    def _tries_delta(self, cid: bytes, path: str | None) -> bool:
        """Whether a delta is worth trying for ``cid``: never for moments under ``balanced``
        (decayed every step: they never pay), never for a tensor whose last deltas did not pay
        (re-tried one chunk in :data:`REPROBE`)."""
        if self.chain is None:
            return False
        if path is None:
            return True
        moment = role(path) in (Role.MOMENT1, Role.MOMENT2)
        if moment and self.policy.name == "balanced" and self.chain.by_cost:
            return False
        lesson = self.known.get(path)
        base = self.candidates.get(cid)
        if lesson is None or lesson.delta is None or (base is not None and not base[0] % REPROBE):
            return True  # nothing learned yet, or a chunk drawn (by its base) to re-try
        return lesson.delta <= self.policy.dense_max or not self.chain.by_cost

    def encode(self, cid: bytes, data: memoryview, align: int, owned: bool) -> Encoding:
        """``(codec, payload, base id)``: a delta when its base is at hand and it pays within the
        policy's bound, else the plain encoding (not even computed when the delta is tiny)."""
        path, chain = self.paths.get(cid), self.chain
        if chain is None or not self._tries_delta(cid, path):
            codec, payload = self.plain(cid, data, align)
            if chain is not None and not cid[0] % REPROBE and align > 1 and len(data) >= MIN_BASE:
                self._keep(cid, data, owned, CachedChunk(data, 0, sample=True))  # the next re-try's base
            return codec, payload, None
        base = self.candidates.get(cid)
        cached = self.bases.get(base) if base is not None and base in self.live else None
        if cached is not None and cached.sample:
            return self._plain(cid, data, align, owned, cached)
        if cached is None or len(cached.data) != len(data):
            return self._plain(cid, data, align, owned, None)
        if chain.due(cached, cid):
            return self._keyframe(cid, data, align, owned)
        limit = chain.probe_limit(cached, len(data))
        if limit <= 0:
            return self._no_delta(cid, data, align, owned, cached)
        if len(data) > 2 * _PROBE:
            guess = delta_ratio_probe(data, cached.data, align, self.level)
            if guess > limit:
                self._saw(path, guess)  # of the raw bytes: under the ratio to plain, so re-tried sooner
                return self._no_delta(cid, data, align, owned, cached)
        sparse = sparse_delta(data, cached.data, align, self.level, SPARSE_MAX)
        delta_codec, delta = sparse if sparse is not None else \
            encode_delta(data, cached.data, align, self.level)
        if len(delta) > DELTA_SURE_RATIO * len(data):  # compare with the plain encoding
            codec, payload = self.plain(cid, data, align)
            self._saw(path, len(delta) / max(len(payload), 1))
            dense_max = self.policy.dense_max if chain.by_cost else DELTA_MAX_RATIO
            if len(delta) > min(dense_max * len(payload), limit * len(data)):
                self._keep(cid, data, owned, CachedChunk(data, 0, sample=True))
                return codec, payload, None
        else:
            self._saw(path, len(delta) / len(data))  # a small delta: it pays, whatever the plain size
        state = chain.extend(cached, len(data), len(delta), sparse is not None)
        if state is None:
            return self._no_delta(cid, data, align, owned, cached)
        self._keep(cid, data, owned, state)
        return int(delta_codec), delta, base

    def _saw(self, path: str | None, ratio: float) -> None:
        """Note a delta's size over the plain encoding for ``path``'s lesson: a tensor's lesson is
        the best of its chunks' (a table whose other rows changed still deltas where few did)."""
        if path is not None:
            with self._lock:
                self._deltas[path] = min(ratio, self._deltas.get(path, ratio))

    def _no_delta(self, cid: bytes, data: memoryview, align: int, owned: bool,
                  base: CachedChunk) -> Encoding:
        """No delta on ``base``: a chain ended (a keyframe, kept in full to start the next one),
        or even one delta does not fit (the chunk drops back to a sample)."""
        if base.depth > 0:
            return self._keyframe(cid, data, align, owned)
        codec, payload = self.plain(cid, data, align)
        self._keep(cid, data, owned, CachedChunk(data, 0, sample=True))
        return codec, payload, None

    def _keyframe(self, cid: bytes, data: memoryview, align: int, owned: bool) -> Encoding:
        codec, payload = self.plain(cid, data, align)
        self._keep(cid, data, owned, CachedChunk(data, 0, key_bytes=len(payload)))
        return codec, payload, None

    def _plain(self, cid: bytes, data: memoryview, align: int, owned: bool,
               sample: CachedChunk | None) -> Encoding:
        """A chunk with no full base: stored plainly; kept in full if a delta on it promises to
        pay (its base's sample says so, or, seen for the first time, while this commit's
        :data:`FIRST_FULL` lasts), else as a sample."""
        codec, payload = self.plain(cid, data, align)
        if align <= 1 or len(data) < MIN_BASE or self.chain is None:
            return codec, payload, None
        if sample is not None:
            size = min(len(sample.data), len(data))
            size -= size % align
            full = size > 0 and delta_ratio_probe(data[:size], sample.data[:size], align, self.level) \
                <= self.chain.probe_limit(CachedChunk(data, 0, key_bytes=len(payload)), len(data))
        else:
            with self._lock:
                full = self._first_full >= len(data)
                if full:
                    self._first_full -= len(data)
        self._keep(cid, data, owned, CachedChunk(data, 0, sample=not full, key_bytes=len(payload)))
        return codec, payload, None

    def _keep(self, cid: bytes, data: memoryview, owned: bool, state: CachedChunk) -> None:
        """Keep ``data`` (its sample when ``state.sample``) for the next commit, with ``state``."""
        size = min(len(data), deltabase.SAMPLE) if state.sample else len(data)
        with self._lock:
            if self._fresh_bytes + size > self.bases.budget:
                return
            self._fresh_bytes += size
        if owned and not state.sample:
            copy = data
        else:  # a sample is always copied: a slice would hold a background commit's whole copy
            copy = memoryview(np.frombuffer(data[:size], dtype=np.uint8).copy())  # type: ignore[arg-type]
        kept = CachedChunk(copy, state.depth, state.sample, state.cost, state.delta_bytes, state.key_bytes)
        with self._lock:
            self.fresh[cid] = kept

    def published(self, used: Iterable[bytes]) -> None:
        """The version is visible: its new chunks become bases for the next commit, and the
        parent's chunks they replace are dropped (the next commit is coded against this one)."""
        for path, ratio in self._deltas.items():
            self.bases.learn(self.run, path, delta=ratio)
        if self.chain is None:
            return
        kept = set(used)
        self.bases.keep(self.fresh, kept)
        self.bases.drop(base for base in set(self.candidates.values()) if base not in kept)


__all__ = ["DEFAULT_POLICY", "POLICIES", "DeltaPolicy", "EncodePlan", "Lesson", "Role", "encode_plan",
           "live_bases", "plain_plan", "role"]
