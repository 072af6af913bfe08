"""Change hints: tensors a caller vouches have not changed since the run's previous version.

By default a commit hashes every byte of the state: what it stores is verified against
what the state holds. A caller that knows what it mutated can say so
(``Store.commit(..., unchanged=..., trust_versions=...)``); the commit then reuses the
previous version's chunk ids for those tensors without reading them. This module decides
which extents may be reused (:func:`reusable`); :mod:`casckpt.engine.write.commitchunks`
skips hashing them.

What a hint may reuse, and what it never does:

* Only a tensor that is alone in its extent (not packed with small neighbours, not a
  view sharing storage with another leaf) and that the run's previous version (the
  commit's parent) holds at the same path with the same kind, dtype and shape. Any other
  declared tensor is hashed as usual (a tensor new to the run, a first commit).
* A declared tensor whose dtype or shape differs from the previous version's is refused
  (:class:`~casckpt.errors.ChangeHintError`): the hint is demonstrably wrong.
* The parent must be the version the run's last commit in this process made, if there was
  one (:func:`casckpt.engine.write.commit.snapshot` ignores the hint otherwise: that commit
  failed, or its version was deleted meanwhile, and an older parent's chunks may hold
  older bytes of a tensor the caller rightly vouches for).
* Reused chunks must still be held by the store (cache entry, then catalog) or by a
  commit in flight in this process; otherwise the tensor is hashed.
* ``trust_versions``: a tensor counts as unchanged when it has the same storage address,
  dtype, shape, strides and storage offset as at the run's previous commit in this
  process, and its ``_version`` counter has not moved. The commit keeps a reference to
  each such tensor until the run's next commit (so the address cannot be reused by
  another allocation meanwhile); no reference is kept without ``trust_versions``.

A background commit (``block=False``) evaluates the hint on the caller's thread, against the
live tensors, and does not copy a vouched tensor whose staged bytes are still current; its
worker's snapshot then gets the vouched paths as :attr:`ChangeHint.counted` (see
:mod:`casckpt.engine.write.background`).

A wrong hint stores the previous version's bytes for that tensor (and restores them): the
stored bytes match their ids, so nothing is corrupt. To tell it, a commit records, for every
tensor it reuses on a hint, a fingerprint of a sample of the bytes the caller handed it
(:func:`fingerprints`, :mod:`casckpt.format.hintsample`: at most 64 KiB per tensor, copied on
the thread that holds the live bytes), which ``check --read-data`` recomputes from the stored
chunks. A change the sample misses (a sparse one) stays undetected. See docs/ARCHITECTURE.md
("Change hints") for what bypasses version counters.
"""

from __future__ import annotations

import ctypes
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from casckpt.engine.context import EngineContext
from casckpt.engine.versions.extents import ExtentSource, flat_bytes, pack_limit, packable
from casckpt.errors import ChangeHintError, InvalidArgumentError
from casckpt.format.chunks import ChunkIds, aligned_chunk_size
from casckpt.format.hintsample import fingerprint, sample_spans
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry
from casckpt.format.state import TensorLeaf

PathSpec = str | Iterable[str] | Callable[[str], bool]
"""Tensor paths: one dotted path or glob (``fnmatch``: ``model.blocks.*``), several, or a
predicate called with each tensor's dotted path."""


def _matcher(spec: PathSpec | bool | None, what: str) -> Callable[[str], bool] | None:
    if spec is None or spec is False:
        return None
    if spec is True:
        return lambda _path: True
    if callable(spec):
        return spec
    patterns = [spec] if isinstance(spec, str) else list(spec)
    if not all(isinstance(p, str) for p in patterns):
        raise InvalidArgumentError(
            f"{what} takes tensor paths or glob patterns (str), or a predicate path -> bool; "
            f"got {spec!r}"
        )
    exact = {p for p in patterns if not any(c in p for c in "*?[")}
    globs = [p for p in patterns if p not in exact]
    if not globs:
        return exact.__contains__
    return lambda path: path in exact or any(fnmatch.fnmatchcase(path, g) for g in globs)


@dataclass(frozen=True, slots=True)
class ChangeHint:
    """What the caller vouches for (see module docstring): ``unchanged`` matches tensors
    unchanged since the run's previous version; ``versions`` matches tensors whose
    version counters may be trusted."""

    unchanged: Callable[[str], bool] | None = None
    versions: Callable[[str], bool] | None = None
    counted: Callable[[str], bool] | None = None
    """Tensors a background commit found unchanged by their version counters on the
    caller's thread (see :mod:`casckpt.engine.write.background`): reused like ``versions``
    ones whose counters held, never refused."""
    sampled: Mapping[str, tuple[bytes, ...]] | None = None
    """The sampled bytes the caller's thread of a background commit took of the live tensors
    its staging did not copy (:func:`skipped_samples`): the worker sees stale staged bytes
    for those, and fingerprints these instead."""


def make_hint(unchanged: PathSpec | None, trust_versions: PathSpec | bool) -> ChangeHint | None:
    """The hint of ``Store.commit``'s arguments (None: no hint, the verified default).

    Raises:
        InvalidArgumentError: an argument is neither paths, patterns nor a predicate.
    """
    hint = ChangeHint(_matcher(unchanged, "unchanged="), _matcher(trust_versions, "trust_versions="))
    return hint if hint.unchanged is not None or hint.versions is not None else None


_Key = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int, str, bool, bool]


def _key(t: torch.Tensor) -> _Key:
    # the conjugate and negative bits too: flipping one moves no counter, yet changes what
    # the tensor reads as
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), str(t.device),
            t.is_conj(), t.is_neg())


@dataclass(slots=True)
class Counters:
    """The version counters of the trusted tensors of one commit (``version_id``): each
    tensor (held, so its storage stays where it was), its strides and its ``_version``."""

    version_id: str
    tensors: dict[str, tuple[torch.Tensor, _Key, int]] = field(default_factory=dict)

    def unchanged(self, path: str, t: torch.Tensor) -> bool:
        """Whether ``t`` is the tensor recorded at ``path``, its counter not moved since."""
        found = self.tensors.get(path)
        return found is not None and found[1] == _key(t) and found[2] == t._version


def trusted_counters(hint: ChangeHint | None, version_id: str,
                    leaves: Sequence[TensorLeaf]) -> Counters | None:
    """The counters a later commit of the run may trust (None without ``trust_versions``)."""
    if hint is None or hint.versions is None:
        return None
    out = Counters(version_id)
    for leaf in leaves:
        t = leaf.value
        if isinstance(t, torch.Tensor) and hint.versions(leaf.path):
            out.tensors[leaf.path] = (t.detach(), _key(t), t._version)
    return out


def vouched(before: Counters | None, hint: ChangeHint | None, leaves: Sequence[TensorLeaf],
            ) -> tuple[set[str], Counters]:
    """A background commit's hint evaluated on the live tensors, on the caller's thread: the
    paths whose staged copy is current (a version counter unmoved since ``before``, the
    counters of the run's last staging), and the counters the run's next staging compares
    with. A vouched tensor's entry is carried over as it is (same tensor, same counter): it
    costs a lookup, not a new record.

    Only counters spare a copy: an ``unchanged`` promise is about the run's previous
    VERSION, which a blocking, group or DCP commit (or a failed one) may have made from
    other bytes than the staging holds; the worker still uses it to skip hashing."""
    if hint is None or hint.versions is None:
        return set(), Counters("")
    counted = set[str]()
    if before is not None:
        counted = {leaf.path for leaf in leaves if isinstance(leaf.value, torch.Tensor)
                   and hint.versions(leaf.path) and before.unchanged(leaf.path, leaf.value)}
    after = cast(Counters, trusted_counters(hint, "", [leaf for leaf in leaves if leaf.path not in counted]))
    if before is not None:
        after.tensors.update((path, before.tensors[path]) for path in counted)
    return counted, after


def _previous(manifest: Manifest) -> tuple[dict[str, TensorEntry], dict[str, ExtentEntry]]:
    """The previous version's tensors by path, and the extents of those alone in theirs."""
    users = Counter(t.extent for t in manifest.tensors)
    tensors = {t.path: t for t in manifest.tensors if not t.is_shard and t.rank is None}
    extents = {t.path: manifest.extents[t.extent] for t in tensors.values()
               if users[t.extent] == 1 and not manifest.extents[t.extent].packed
               and not t.offset and t.stride is None}
    return tensors, extents


def reusable(
    hint: ChangeHint, leaves: Sequence[TensorLeaf], entries: Sequence[TensorEntry],
    sources: Sequence[ExtentSource], chunk_size: int, parent: Manifest | None,
    counters: Counters | None,
) -> dict[int, ExtentEntry]:
    """The extents (by index into ``sources``) whose previous entries ``hint`` lets the
    commit reuse; ``entries`` are :func:`~casckpt.engine.versions.extents.plan_extents`' (leaf order),
    ``parent`` the manifest of the commit's parent, ``counters`` those recorded by the
    commit that made ``parent`` (the caller checks).

    Raises:
        ChangeHintError: a tensor declared ``unchanged`` has another dtype or shape than
            in the previous version.
    """
    if parent is None:
        return {}
    before, alone = _previous(parent)
    users = Counter(e.extent for e in entries)
    out: dict[int, ExtentEntry] = {}
    for leaf, entry in zip(leaves, entries, strict=True):
        declared = hint.unchanged is not None and hint.unchanged(leaf.path)
        old = before.get(leaf.path)
        if declared and old is not None and (old.kind, old.dtype, old.shape) != (entry.kind, entry.dtype,
                                                                                 entry.shape):
            raise ChangeHintError(
                f"tensor {leaf.path!r} was declared unchanged, but it is {entry.kind} {entry.dtype} "
                f"{list(entry.shape)} and the run's previous version has {old.kind} {old.dtype} "
                f"{list(old.shape)}; leave it out of unchanged= (nothing was written)"
            )
        source = sources[entry.extent]
        extent = alone.get(leaf.path)
        if (extent is None or old is None or users[entry.extent] != 1 or source.packed or entry.offset
                or entry.stride is not None
                or (old.kind, old.dtype, old.shape) != (entry.kind, entry.dtype, entry.shape)):
            continue  # new to the run, or not alone in its extent: hashed
        counted = not declared and (
            (hint.counted is not None and hint.counted(leaf.path))
            or (counters is not None and hint.versions is not None
                and isinstance(leaf.value, torch.Tensor) and hint.versions(leaf.path)
                and counters.unchanged(leaf.path, leaf.value)))
        if not (declared or counted):
            continue
        size = aligned_chunk_size(chunk_size, source.align)
        phase = source.grid_offset % size
        if (extent.nbytes, extent.chunk_size, extent.phase) == (source.nbytes, size, phase):
            out[entry.extent] = extent
    return out


def sample(run: str, step: int, path: str, value: object) -> tuple[bytes, ...] | None:
    """The sampled bytes (:mod:`casckpt.format.hintsample`) of what a commit of ``run@step``
    stores for the leaf ``value`` at ``path``, span by span (None: an empty leaf, nothing to
    tell, or not a tensor). At most 64 KiB: a CPU tensor's blocks are read in place
    (a non-contiguous one is made contiguous first); a device tensor's are gathered on its
    device and copied to the host in one piece."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        spans = sample_spans(run, step, path, array.nbytes)
        view = memoryview(array)  # type: ignore[arg-type]  # numpy exports the buffer protocol
        return tuple(view[s:e].tobytes() for s, e in spans) if spans else None
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_cpu and value.is_contiguous() and not (value.is_conj() or value.is_neg()):
        # its bytes are one run from data_ptr(): read in place, without a torch op per tensor
        spans = sample_spans(run, step, path, value.nbytes)
        if not spans:
            return None
        whole = memoryview((ctypes.c_char * value.nbytes).from_address(value.data_ptr())).cast("B")
        return tuple(whole[s:e].tobytes() for s, e in spans)
    data = flat_bytes(value, path)
    spans = sample_spans(run, step, path, data.numel())
    if not spans:
        return None
    if data.device.type != "cpu":
        return (torch.cat([data[s:e] for s, e in spans]).cpu().numpy().tobytes(),)
    view = memoryview(data.numpy())  # type: ignore[arg-type]  # numpy exports the buffer protocol
    return tuple(view[s:e].tobytes() for s, e in spans)


def fingerprints(ids: ChunkIds, run: str, step: int, hint: ChangeHint, leaves: Sequence[TensorLeaf],
                 entries: Sequence[TensorEntry], reuse: Mapping[int, ExtentEntry]) -> dict[str, bytes]:
    """The manifest's ``hinted`` (path -> fingerprint) of a snapshot of ``run@step`` that
    reuses ``reuse`` (:func:`reusable`): each of the bytes ``hint.sampled`` holds where the
    caller's thread took them, else of the leaf's (in a blocking commit the live tensor; in
    a background one the staged copy, made on the caller's thread)."""
    out: dict[str, bytes] = {}
    if not reuse:
        return out
    for leaf, entry in zip(leaves, entries, strict=True):
        if entry.extent not in reuse:
            continue
        taken = hint.sampled.get(leaf.path) if hint.sampled is not None else None
        if taken is None:
            taken = sample(run, step, leaf.path, leaf.value)
        if taken is not None:
            out[leaf.path] = fingerprint(ids, taken)
    return out


def skipped_samples(ctx: EngineContext, run: str, step: int, leaves: Sequence[TensorLeaf],
                    skipped: set[str]) -> dict[str, tuple[bytes, ...]]:
    """The sampled bytes of the live tensors a background commit's staging did not copy
    (``skipped``: vouched for by their counters), taken on the caller's thread before
    ``commit`` returns, for :attr:`ChangeHint.sampled` (the worker hashes them: at most
    64 KiB each is copied here). Tensors a snapshot never reuses on a hint (packed with
    small neighbours) are left out."""
    if not skipped:
        return {}
    pack = pack_limit(ctx.config.chunk_size)
    return {leaf.path: taken for leaf in leaves
            if leaf.path in skipped and isinstance(leaf.value, torch.Tensor)
            and not packable(leaf.value, pack)
            and (taken := sample(run, step, leaf.path, leaf.value)) is not None}
