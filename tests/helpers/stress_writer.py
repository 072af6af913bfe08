"""One writer of the multi-process stress test (run as a subprocess).

    python stress_writer.py STORE_ROOT CACHE_DIR WRITER COMMITS START_FILE

Every writer opens the same store (from its casckpt.toml) with its own index
cache, as a process on another host would, waits until START_FILE exists so
all writers begin together, then commits COMMITS versions whose content
overlaps with the other writers' (see ``state_for``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import casckpt

SHARED_RUN = "shared"


def state_for(writer: int, i: int) -> dict[str, torch.Tensor]:
    """Content shared by all writers, by writer pairs, and unique to one commit."""
    def noise(*seed: int, n: int = 3000) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(hash(seed) % (1 << 62)))

    return {
        "base": noise(0),                     # identical in every commit of every writer
        "step_shared": noise(1, i),           # the same new chunk from all writers at step i
        "pair": noise(2, writer // 2, i),     # shared by writers 0+1 and by 2+3
        "own": noise(3, writer, i, n=500),    # unique
    }


def run_and_step(writer: int, i: int) -> tuple[str, int]:
    """Writers 0 and 1 interleave steps in one run; writers 2 and 3 have their own runs."""
    if writer < 2:
        return SHARED_RUN, 2 * i + writer
    return f"solo-{writer}", i


def main() -> None:
    root, cache, writer, commits, start = sys.argv[1:6]
    while not Path(start).exists():
        time.sleep(0.01)
    with casckpt.open(root, cache=cache, chunk_size=4096, create=False) as store:
        for i in range(int(commits)):
            run, step = run_and_step(int(writer), i)
            store.commit(state_for(int(writer), i), run=run, step=step)


if __name__ == "__main__":
    main()
