"""Versions saved rank by rank (``commit(group=)``): which rank's tree a restore reads.

Such a version holds one state per rank (:func:`casckpt.format.manifest.rank_view`);
``Store.restore`` restores the calling rank's (``group=``) or a named one (``rank=``), and
``Store.load_tensor`` reads ``rankN/path`` from rank N's tree.
"""

from __future__ import annotations

import re
from typing import Any

from casckpt.errors import InvalidArgumentError, RestoreTargetError, TensorNotFoundError
from casckpt.format.manifest import Manifest, rank_count, rank_view

_RANK_PATH = re.compile(r"rank(\d+)/(.+)", re.DOTALL)


def rank_manifest(manifest: Manifest, group: Any, rank: int | None) -> Manifest:
    """The manifest to restore on this rank: one rank's tree of a version saved rank by rank
    (``manifest`` itself for any other version).

    Raises:
        RestoreTargetError: a version saved rank by rank without ``group``/``rank``, or with
            a group of another size.
        InvalidArgumentError: ``rank`` is not one of its ranks.
    """
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


def tensor_manifest(manifest: Manifest, path: str) -> tuple[Manifest, str]:
    """For a version saved rank by rank, ``rankN/path`` names a tensor of rank N's state.

    Raises:
        TensorNotFoundError: a version saved rank by rank, and ``path`` names no rank (the
            message shows the ``rank0/path`` form).
        InvalidArgumentError: ``rankN`` is not one of its ranks.
    """
    found = _RANK_PATH.fullmatch(path)
    count = rank_count(manifest)
    if count is None:
        return manifest, path
    if found is None:
        raise TensorNotFoundError(
            f"{manifest.run}@{manifest.step} was saved rank by rank by {count} ranks: name the "
            f"tensor with its rank, e.g. {f'rank0/{path}'!r} (ranks 0..{count - 1})")
    return rank_manifest(manifest, None, int(found.group(1))), found.group(2)
