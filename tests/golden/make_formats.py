"""Build the golden store of manifest formats 1 and 2 under tests/golden/ (run once, at
commit de427d5, the last to write format 1; never to "fix" a failing golden test: later
releases must read what these wrote).

    python tests/golden/make_formats.py tests/golden/store-formats

It holds, each written by casckpt's own writers of the time:

- ``one@0``: a one-process commit in format 1 (a ``tensors`` row per tensor);
- ``dcp@1``: a DCP save by 2 gloo ranks in format 2 (pieces of tensors sharded on dim 0 with
  uneven rows and on dim 1, replicated tensors, plain values);
- ``grp@2``: a ``Store.commit(group=)`` by 2 gloo ranks in format 2 (one tree per rank, a
  replicated model written once).

Its states come from :func:`one_state`, :func:`dcp_state` and :func:`rank_state`
(deterministic), which ``test_golden_formats.py`` recomputes to compare.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

CHUNK = 1024
PACK = 1 << 14


def one_state() -> dict[str, Any]:
    """What ``one@0`` holds."""
    g = torch.Generator().manual_seed(31)
    w = torch.randn(16, 16, generator=g)
    return {"model": {"w": w, "w_t": w.t(), "b": torch.arange(8, dtype=torch.int64)},
            "small": {f"s{i}": torch.full((3,), float(i)) for i in range(6)},
            "meta": {"lr": 0.25, "name": "format-1", "betas": (0.9, 0.99)}}


def dcp_state() -> dict[str, Any]:
    """The whole state ``dcp@1`` holds (saved in pieces by 2 ranks)."""
    g = torch.Generator().manual_seed(32)
    return {
        "model.emb": torch.randn(301, 8, generator=g),  # sharded on dim 0, uneven rows
        "model.w2": torch.randn(6, 50, generator=g).to(torch.bfloat16),  # sharded on dim 1
        "model.bias": torch.randn(40, generator=g),  # replicated
        "optim.count": torch.arange(30, dtype=torch.int64),  # replicated
        "step": 7,
        "meta": {"lr": 3e-4, "name": "format-2"},
    }


SHARDED = {"model.emb": 0, "model.w2": 1}


def rank_state(rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state in ``grp@2``: a replicated model, and parts of its own."""
    shared = torch.Generator().manual_seed(33)
    own = torch.Generator().manual_seed(3300 + rank)
    return {"model": {"w": torch.randn(40, 20, generator=shared), "b": torch.randn(20, generator=shared)},
            "rng": torch.randint(0, 255, (700,), dtype=torch.uint8, generator=own),
            "loader": {"position": 100 * rank + 5, "epoch": 2}}


def _rank(rank: int, root: str, init: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import casckpt

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    state = {k: distribute_tensor(v, mesh, [Shard(SHARDED[k])]) if k in SHARDED else v
             for k, v in dcp_state().items()}
    with casckpt.open(root, chunk_size=CHUNK, pack_size=PACK) as store:
        dcp.save(state, storage_writer=store.dcp_writer(run="dcp", step=1, metrics={"loss": 0.5}))
        store.commit(rank_state(rank), run="grp", step=2, group=dist.group.WORLD)
    dist.destroy_process_group()


def main(target: str) -> int:
    import torch.multiprocessing as mp

    import casckpt
    from casckpt.engine.write import commit as commit_engine

    root = Path(target)
    if root.exists():
        shutil.rmtree(root)
    if not hasattr(commit_engine, "TREE_MANIFESTS"):  # its golden output is checked in
        print("this casckpt writes no format 1: run this script at commit de427d5", file=sys.stderr)
        return 2
    setattr(commit_engine, "TREE_MANIFESTS", False)  # noqa: B010 (format 1: gone from later releases)
    with casckpt.open(root, chunk_size=CHUNK, pack_size=PACK) as store:
        store.commit(one_state(), run="one", step=0, metrics={"loss": 1.0}, message="format 1")
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    mp.start_processes(_rank, args=(str(root), init), nprocs=2, start_method="spawn")
    with casckpt.open(root, create=False) as store:
        for v in store.log():
            print(f"{v.run}@{v.step}", v.id)
    shutil.rmtree(root / "cache")  # this host's index cache: not part of the store
    for name in os.listdir(root):
        if name.startswith("catalog.db-"):  # a WAL the last close checkpointed
            (root / name).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
