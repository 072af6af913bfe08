"""``Store.commit(state, group=...)``: one version made of every rank's own state.

Each rank of the process group commits its own state (its model replica or
shard, its RNG, its data-loader position); the version holds one state per
rank and is restored rank by rank (``Store.restore(ref, group=...)``). The
two-phase protocol of :mod:`casckpt.engine.write.distributed`, over the group's
collectives (gloo or any backend with object collectives):

1. the coordinator (group rank 0) refuses a taken step and takes the GC lease;
2. every rank hashes and dedups its state; the ranks exchange the ids of the
   chunks the store lacks, and each new chunk is written once, by the lowest
   rank holding it (replicated weights are not written N times), each rank
   under a lease of its own too (the coordinator may die while others write);
3. every rank's state goes to the coordinator, which names the version on its
   lease, writes the manifest object and publishes the version in ONE catalog
   transaction, and tells every rank the outcome.

Every step is a collective: an error on any rank makes every rank raise
:class:`~casckpt.errors.GroupCommitError` (naming the ranks and their
errors) and nothing is published. A rank that dies makes the others' next
collective fail (the backend's error propagates). Leftover packs are
reclaimed by GC.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch.distributed as dist

from casckpt.engine.context import EngineContext
from casckpt.engine.versions.extents import pack_limit, plan_extents
from casckpt.engine.write import commit as commit_engine
from casckpt.engine.write.commit import CommitRequest
from casckpt.engine.write.commitchunks import ChunkWrite, hash_and_dedup, write_chunks
from casckpt.engine.write.distributed import (
    begin_save,
    compose,
    end_save,
    publish_composed,
    rank_lease,
    rank_lease_id,
)
from casckpt.engine.write.encodepolicy import EncodePlan
from casckpt.errors import GroupCommitError
from casckpt.format.manifest import ExtentEntry, TensorEntry, World, renumber_tensors
from casckpt.format.state import Node, encode_state
from casckpt.types import ProgressCallback, Version

T = TypeVar("T")


def _together(group: Any, step: str, work: Callable[[], T]) -> T:
    """Run ``work`` on every rank and return this rank's result -- or, if it failed on any
    rank, raise on every rank."""
    try:
        result: T | None = work()
        failure: BaseException | None = None
    except Exception as exc:  # every rank must reach the collective below, whatever failed
        result, failure = None, exc
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    errors = [(rank, m) for rank, m in enumerate(_everyone(group, message, step)) if m is not None]
    if errors:
        detail = "; ".join(f"rank {rank}: {m}" for rank, m in errors)
        raise GroupCommitError(f"group commit failed while {step} ({detail}); no version was "
                               "published, and the next commit can proceed") from failure
    return result  # type: ignore[return-value]  # None only where work failed, and then we raised


def _everyone(group: Any, value: object, step: str) -> list[Any]:
    """``value`` of every rank, in rank order.

    Raises:
        GroupCommitError: a rank is gone (see :func:`_gone`)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, value, group=group)
    except RuntimeError as exc:
        raise _gone(step, exc) from exc
    return gathered


def _gone(step: str, exc: RuntimeError) -> GroupCommitError:
    """The error of a collective that failed: a rank of the group crashed or was killed
    (gloo: "Connection closed by peer"; NCCL: ``DistBackendError``) or timed out. Before the
    publishing step nothing was published; at it, the coordinator may have published."""
    published = ("the version may have been published before the rank was lost: `casckpt log RUN` "
                 "tells" if step == "publishing" else "no version was published")
    return GroupCommitError(f"group commit failed while {step}: a rank of the group stopped answering "
                            f"({exc}); {published}. Restart the job on every rank and resume")


Part = tuple[Node, list[TensorEntry], list[ExtentEntry], ChunkWrite]


def group_commit(ctx: EngineContext, state: object, request: Callable[[], CommitRequest], group: Any,
                 progress: ProgressCallback | None = None) -> Version:
    """Commit every rank's ``state`` as one version (collective: every rank of ``group`` calls it).

    ``request`` checks the commit and returns its request, on every rank inside the first
    collective step: a rank it fails on (bad arguments, a store read-only on that host) makes
    every rank raise, instead of leaving the others waiting in the next collective.

    Raises:
        GroupCommitError: some rank failed (its error named); nothing was published.
    """
    rank = dist.get_rank(group)
    started = time.monotonic()
    leases: list[str] = []  # the coordinator's: the save's, ended with its ranks' whatever happens

    requests: list[CommitRequest] = []

    def prepare() -> tuple[str | None, float, str] | None:
        requests.append(request())
        if rank != 0:
            return None
        start = begin_save(ctx, requests[0])
        leases.append(start.lease)
        return start.parent, start.created, start.lease

    try:
        parent, created, save = _everyone(group, _together(group, "preparing", prepare), "preparing")[0]
        req = requests[0]
        root, entries, extents, chunks, new_ids = _together(
            group, "hashing", lambda: _snapshot(ctx, state, progress))
        mine = _mine(group, rank, new_ids)
        deltas: list[EncodePlan] = []

        def write() -> Part:
            ranked = [replace(e, rank=rank) for e in entries]  # as the parent names this rank's tensors
            delta = commit_engine.plan_delta(ctx, req.run, parent, ranked, extents, mine)
            deltas.append(delta)
            # the coordinator's save lease covers its own writes; a rank writing nothing needs none
            with rank_lease(ctx, rank_lease_id(save, rank) if rank and mine else None):
                written = write_chunks(ctx, chunks, mine, ctx.packs.placement.redundancy_for(req.run),
                                       progress, delta)
            return root, entries, extents, written

        parts = _at_coordinator(group, _together(group, "writing chunks", write))
        version = _together(group, "publishing", lambda: _publish(
            ctx, req, parts, parent, created, started, save) if rank == 0 else None)
        published: Version = _published(group, rank, version)
        for delta in deltas:  # this rank's new chunks are the bases of its next commit
            delta.published(chunks)
        return published
    finally:
        for lease in leases:
            end_save(ctx, lease)


def _snapshot(ctx: EngineContext, state: object, progress: ProgressCallback | None
              ) -> tuple[Node, list[TensorEntry], list[ExtentEntry], Any, list[bytes]]:
    """This rank's state encoded, planned, hashed and deduped (its new chunks' ids last)."""
    root, leaves = encode_state(state)
    entries, sources = plan_extents(leaves, pack=pack_limit(ctx.config.chunk_size), ids=ctx.crypto.chunk_id)
    # chunks other ranks or hosts rely on are confirmed in the catalog, never taken from this
    # host's cache: the coordinator could not write them again
    extents, chunks, new_ids = hash_and_dedup(ctx, sources, progress, confirm=True)
    return root, entries, extents, chunks, new_ids


def _mine(group: Any, rank: int, new_ids: list[bytes]) -> list[bytes]:
    """The new chunks this rank writes: each by the lowest rank holding it."""
    writer: dict[bytes, int] = {}
    for holder, ids in enumerate(_everyone(group, new_ids, "hashing")):
        for cid in ids:
            writer.setdefault(cid, holder)
    return [cid for cid in new_ids if writer[cid] == rank]


def _published(group: Any, rank: int, version: Version | None) -> Version:
    """The version the coordinator published, on every rank. The coordinator returns it even
    where a rank is lost now: it is visible (the lost rank's process restarts from it)."""
    try:
        published: Version = _everyone(group, version, "publishing")[0]
    except GroupCommitError:
        if rank == 0 and version is not None:
            return version
        raise
    return published


def _at_coordinator(group: Any, value: object) -> list[Any]:
    """``value`` of every rank, in rank order, on group rank 0 (an empty list elsewhere)."""
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    try:
        dist.gather_object(value, gathered, dst=dist.get_global_rank(group, 0), group=group)
    except RuntimeError as exc:
        raise _gone("writing chunks", exc) from exc
    return gathered or []


def _publish(ctx: EngineContext, req: CommitRequest, parts: list[Part], parent: str | None,
             created: float, started: float, lease: str) -> Version:
    trees: list[Node] = []
    entries: list[TensorEntry] = []
    extents: list[ExtentEntry] = []
    for rank, (root, rank_entries, rank_extents, _) in enumerate(parts):
        base = len(entries)  # this rank's tensors follow earlier ranks'
        trees.append(renumber_tensors(root, base.__add__))
        entries.extend(replace(e, extent=e.extent + len(extents), rank=rank) for e in rank_entries)
        extents.extend(rank_extents)
    snap = compose(ctx, req, parent, created, World(len(parts), "group"), {"t": "ranks", "v": trees},
                   entries, extents, sum(p[3].raw_bytes for p in parts),
                   sum(p[3].stored_bytes for p in parts), [s for p in parts for s in p[3].degraded])
    return publish_composed(ctx, req, snap, started, lease)
