"""Build the golden store under tests/golden/ (it holds format 1, so this runs only at commit
de427d5, the last to write it; never to "fix" a failing golden test: a release must read the
stores earlier ones wrote).

    python tests/golden/make_store.py tests/golden/store-0.1

It holds versions of both manifest formats a one-process commit has written (format 1,
per-tensor rows; format 3, trees), a fork, a tag, a retention policy, tied tensors,
packed small tensors, bfloat16 / int64 / bool tensors and plain values. Its states come
from :func:`state` (deterministic), which ``test_golden.py`` recomputes to compare.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import casckpt
from casckpt.engine.write import commit as commit_engine


def state(step: int) -> dict[str, Any]:
    """The state committed at ``step`` (each step changes some tensors, keeps the rest)."""
    g = torch.Generator().manual_seed(1000 + step)
    fixed = torch.Generator().manual_seed(7)
    embed = torch.randn(32, 8, generator=fixed) + (step // 2)  # changes every other step
    return {
        "model": {
            "embed.weight": embed,
            "head.weight": embed,  # tied: one storage, stored once
            "layers": [{"w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
                        "b": torch.zeros(8) + i} for i in range(3)],
            "experts": {f"e{i}": torch.full((4,), float(i)) for i in range(40)},  # packed
        },
        "optim": {"step": torch.tensor(step, dtype=torch.int64),
                  "mask": torch.arange(16) % (step + 2) == 0,
                  "param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999)}]},
        "data": {"epoch": step // 3, "position": step * 64, "name": "golden"},
    }


def main(target: str) -> int:
    root = Path(target)
    if root.exists():
        shutil.rmtree(root)
    if not hasattr(commit_engine, "TREE_MANIFESTS"):  # its golden output is checked in
        print("this casckpt writes no format 1: run this script at commit de427d5", file=sys.stderr)
        return 2
    setattr(commit_engine, "TREE_MANIFESTS", False)  # noqa: B010 (format 1: gone from later releases)
    with casckpt.open(root, chunk_size=1024) as store:
        store.commit(state(0), run="main", step=0, metrics={"loss": 2.0}, message="format 1")
        setattr(commit_engine, "TREE_MANIFESTS", True)  # noqa: B010
        store.retention.set("main", keep_last=10)
        for step in (1, 2, 3):
            store.commit(state(step), run="main", step=step, metrics={"loss": 2.0 / (step + 1)},
                         tags=["best"] if step == 3 else ())
        store.fork("main@2", "ft")
        store.commit(state(5), run="ft", step=5, metadata={"note": "fork"})
        for v in store.log():
            print(v.run, v.step, v.id)
    shutil.rmtree(root / "cache")  # this host's index cache: not part of the store
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
