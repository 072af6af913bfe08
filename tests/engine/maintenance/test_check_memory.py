"""check --read-data streams packs: its memory does not grow with the pack (issue 13, case 6).

A store with one 48 MiB pack (pack_size raised, incompressible data, no
redundancy and ec:2+1) is checked in a fresh process; its peak RSS may grow by
at most a small, fixed amount over an open store's -- nowhere near the pack.
Before, ``check --read-data`` read every pack (every shard) whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import casckpt

CHILD = Path(__file__).parents[2] / "helpers" / "hostile_child.py"
PACK = 48 << 20
GROWTH_LIMIT_KIB = 24 << 10  # one 8 MiB window, entries, hashers, the catalog: half the pack


@pytest.mark.parametrize("redundancy", ["none", pytest.param("ec:2+1", marks=pytest.mark.slow)])
def test_check_read_data_memory_does_not_grow_with_the_pack(tmp_path: Path, redundancy: str) -> None:
    root = tmp_path / "store"
    blobs = [str(tmp_path / f"d{i}") for i in range(3)] if redundancy != "none" else None
    state = {"w": torch.randint(-2**31, 2**31 - 1, (PACK // 4,), dtype=torch.int32,
                                generator=torch.Generator().manual_seed(1))}
    with casckpt.open(root, blobs=blobs, redundancy=redundancy, pack_size=PACK * 2,
                      chunk_size=4 << 20) as store:
        store.commit(state, run="r", step=1)
        assert store.ops.stats().packs == 1
    del state
    run = subprocess.run([sys.executable, str(CHILD), str(root), "check-read-data"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] is None and out["problems"] == [], out
    growth = out["rss_peak_kib"] - out["rss_before_kib"]
    print(f"check --read-data grew by {growth >> 10} MiB for a {PACK >> 20} MiB pack")
    assert growth < GROWTH_LIMIT_KIB, f"check grew by {growth >> 10} MiB for a {PACK >> 20} MiB pack"
