"""The ``copy`` benchmark (``benchmarks/copy_bench.py``, issue 34).

Its figures are only worth what the run checks: every copy restored from its destination and
compared with what the source committed (the workload raises otherwise), the bytes counted at
the destination's locations, and the S3 copies' bytes crossing the throttling proxy. The end to
end run is marked slow: a model, 10 commits, moto in a child process and a dozen throttled
transfers take 30-60 s on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the workload lives with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

import casckpt  # noqa: E402
from benchmarks.copy_bench import (  # noqa: E402
    FLOORS,
    RUN,
    TARGETS,
    VERSIONS,
    CopyFailedError,
    _Expected,
    new_object_bytes,
    objects,
    run_copy,
)
from benchmarks.report import evaluate  # noqa: E402


def _state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=gen), "step": seed}


def test_verify_refuses_a_destination_whose_version_differs(tmp_path: Path) -> None:
    expected = _Expected()
    expected.record(1, _state(1))
    with casckpt.open(tmp_path / "ok") as store:
        store.commit(_state(1), run=RUN, step=1)
        expected.verify(store, "same")
    with casckpt.open(tmp_path / "other") as store:
        store.commit(_state(2), run=RUN, step=1)
        with pytest.raises(CopyFailedError, match=f"{RUN}@1 restored from the destination differs"):
            expected.verify(store, "other")
    plain = {"w": _state(1)["w"], "step": 7}  # same tensor, another plain value
    with casckpt.open(tmp_path / "plain") as store:
        store.commit(plain, run=RUN, step=1)
        with pytest.raises(CopyFailedError):
            expected.verify(store, "plain")


def test_bytes_sent_are_the_objects_a_copy_adds_at_the_destination(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src") as source, casckpt.open(tmp_path / "dst") as dest:
        source.commit(_state(1), run=RUN, step=1)
        source.commit({**_state(1), "x": torch.randn(4096, generator=torch.Generator().manual_seed(9))},
                      run=RUN, step=2)
        source.copy(f"{RUN}@1", to=dest)
        before = objects(dest)
        report = source.copy(f"{RUN}@2", to=dest)
        added = new_object_bytes(before, objects(dest))
        assert report.bytes >= 4096 * 4
        assert 4096 * 4 <= added < 4096 * 4 + 64 * 1024  # the new tensor's pack, a manifest, records
        assert new_object_bytes(objects(dest), objects(dest)) == 0


@pytest.mark.slow
def test_copy_workload_runs_verified_and_reports_every_target(tmp_path: Path) -> None:
    r = run_copy(0.02, tmp_path, lambda _: None, repeats=1)
    assert r.verified and len(r.versions) == VERSIONS
    assert r.incremental["first"]["report"]["versions"][-1]["step"] == VERSIONS - 1
    assert [v["step"] for v in r.incremental["report"]["versions"]] == [VERSIONS]
    assert r.incremental["again_nothing_sent"] and r.full["again_nothing_sent"]
    assert r.incremental["dry_run_bytes"] == r.incremental["report"]["bytes"]
    assert 0 < r.incremental["dest_new_bytes"] < r.full["dest_new_bytes"]
    (rnd,) = r.rounds
    assert rnd.traffic["copy_up"][0] >= rnd.copy_up_bytes >= r.run_stored_bytes
    assert rnd.traffic["copy_down"][1] >= r.run_stored_bytes
    assert rnd.traffic["raw_upload"][0] >= r.raw_bytes and rnd.traffic["raw_download"][1] >= r.raw_bytes
    scores = evaluate(r)
    for key, limit in {**TARGETS, **FLOORS}.items():
        assert scores[key]["target"] == limit and scores[key]["value"] is not None
    assert scores["up_vs_raw_upload"]["bound"] == ">="
    assert scores["incremental_sent_vs_new"]["value"] < 1.5
