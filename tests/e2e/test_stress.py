"""Many writers on one store: separate processes and caches, overlapping content.

Four processes (as on four hosts: each its own index cache) commit 12 versions
each to PostgreSQL + S3 at the same time, two of them into the same run, all
producing the same new chunks at the same moments. No version may be lost,
no chunk row duplicated, no pack broken; every version restores bit-exact.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt

HELPER = Path(__file__).parents[1] / "helpers" / "stress_writer.py"
sys.path.insert(0, str(HELPER.parent))

from stress_writer import run_and_step, state_for  # noqa: E402

WRITERS, COMMITS = 4, 12


@pytest.mark.slow
def test_four_writers_on_postgres_and_s3(tmp_path: Path, pg_url: str, s3_bucket_url: Any,
                                          moto_endpoint: str) -> None:
    root = tmp_path / "store"
    with casckpt.open(root, blobs=s3_bucket_url(), catalog=pg_url, s3={"endpoint_url": moto_endpoint}):
        pass  # create the store (and its casckpt.toml) once
    start = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, str(HELPER), str(root), str(tmp_path / f"cache{w}"),
                          str(w), str(COMMITS), str(start)])
        for w in range(WRITERS)
    ]
    start.touch()
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * WRITERS
    with casckpt.open(root, create=False) as store:
        expected = {run_and_step(w, i): (w, i) for w in range(WRITERS) for i in range(COMMITS)}
        found = {(v.run, v.step) for v in store.log()}
        assert found == set(expected)
        assert len(store.log("shared")) == 2 * COMMITS
        for (run, step), (w, i) in expected.items():
            restored = store.restore(f"{run}@{step}")
            want = state_for(w, i)
            assert all(torch.equal(restored[k], want[k]) for k in want), (run, step)
        stats = store.ops.stats()
        distinct = {t.numpy().tobytes() for w in range(WRITERS) for i in range(COMMITS)
                    for t in state_for(w, i).values()}
        # every distinct 4 KiB-chunked payload is stored exactly once in the catalog
        assert stats.unique_bytes == sum(len(b) for b in distinct)
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems[:5]
