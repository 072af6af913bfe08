"""The many-ranks side of a store: DCP writers and readers, versions saved rank by rank.

:class:`StoreDistributed` is the part of :class:`casckpt.store.Store` that ``commit``,
``restore``, ``load_tensor``, ``dcp_writer`` and ``dcp_reader`` use for many ranks; it works
on the :class:`~casckpt.store_core.StoreCore` it is given. ``torch.distributed.checkpoint``
is imported only when a DCP writer or reader is asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from casckpt.errors import InvalidArgumentError, RestoreTargetError
from casckpt.format.manifest import Manifest, rank_count, rank_view
from casckpt.store_core import StoreCore

if TYPE_CHECKING:
    from casckpt.dcp import StoreReader, StoreWriter
    from casckpt.engine import commit as commit_engine
    from casckpt.types import Version

_RANK_PATH = re.compile(r"rank(\d+)/(.+)", re.DOTALL)


class StoreDistributed:
    """Saving and loading across the ranks of a ``torch.distributed`` job.

    The public methods are the ``Store`` methods of the same name (documented there).
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def dcp_writer(self, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
                   metrics: Mapping[str, float] | None = None, message: str | None = None,
                   tags: Iterable[str] = ()) -> StoreWriter:
        """A ``torch.distributed.checkpoint`` StorageWriter that saves version ``run@step``."""
        from casckpt.dcp import StoreWriter
        from casckpt.engine import commit as commit_engine

        request = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        writer = StoreWriter(self._core.ctx, request)
        self._core.dcp_writers.add(writer)
        return writer

    def dcp_reader(self, ref: Any) -> StoreReader:
        """A ``torch.distributed.checkpoint`` StorageReader for the version ``ref`` names."""
        from casckpt.dcp import StoreReader

        row = self._core.readable_row(ref)
        return StoreReader(self._core.ctx, row.id, self._core.manifest(row.id))

    def rank_manifest(self, manifest: Manifest, group: Any, rank: int | None) -> Manifest:
        """The manifest to restore on this rank: one rank's tree of a version saved rank by rank."""
        count = rank_count(manifest)
        if count is None:
            return manifest  # one tree for all: every rank restores all of it
        name = f"{manifest.run}@{manifest.step}"
        if group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(group)
            if world != count:
                raise RestoreTargetError(
                    f"{name} was saved rank by rank by {count} ranks; this group has {world}. "
                    "Pass rank= to pick one rank's state, or save sharded state with dcp.save "
                    "(store.dcp_writer), which reshards on load"
                )
            rank = dist.get_rank(group) if rank is None else rank
        if rank is None:
            raise RestoreTargetError(
                f"{name} was saved rank by rank by {count} ranks: pass group= (each rank gets "
                "its own state) or rank= (that rank's state)"
            )
        if not 0 <= rank < count:
            raise InvalidArgumentError(f"{name} holds ranks 0..{count - 1}; there is no rank {rank}")
        return rank_view(manifest, rank)

    def tensor_manifest(self, manifest: Manifest, path: str) -> tuple[Manifest, str]:
        """For a version saved rank by rank, ``rankN/path`` names a tensor of rank N's state."""
        found = _RANK_PATH.fullmatch(path)
        count = rank_count(manifest)
        if count is None or found is None:
            return self.rank_manifest(manifest, None, None), path
        return self.rank_manifest(manifest, None, int(found.group(1))), found.group(2)

    def group_commit(self, state: object, request: commit_engine.CommitRequest, group: Any,
                      progress: Any, preflight: Callable[[], object]) -> Version:
        from casckpt.engine.group import group_commit

        return group_commit(self._core.ctx, state, request, group, progress, preflight)
