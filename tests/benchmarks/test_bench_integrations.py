"""The ``deepspeed`` and ``megatron`` benchmarks end to end at a tiny scale (issue 33).

Their figures are only worth what the runs check: every resume and load compared bit for
bit with the saved state (the workloads raise on a mismatch), casckpt's store after 10
frozen-backbone saves smaller than DeepSpeed's 10 folders, an unchanged Megatron save that
writes nothing, and every target reported. Marked slow: real DeepSpeed engines and
Megatron-Core on 2 spawned gloo ranks take 1-2 minutes on 2 cores, mostly imports.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the workloads live with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

from rich.console import Console  # noqa: E402

from benchmarks.report import evaluate, print_report, write_json  # noqa: E402


@pytest.mark.slow
def test_deepspeed_workload_resumes_bit_exact_and_the_frozen_store_is_smaller(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from benchmarks.ds_zero import SAVES, TARGETS, run_deepspeed

    r = run_deepspeed(0.01, tmp_path, lambda _: None)
    for name, regime in r.regimes.items():
        assert regime.verified, name
        assert len(regime.folder_bytes) == len(regime.versions) == SAVES
        assert [v["step"] for v in regime.versions] == list(range(1, SAVES + 1))
        assert min(regime.torch_save_s + regime.casckpt_save_s) > 0
    frozen, full = r.regimes["frozen"], r.regimes["full"]
    assert frozen.trainable < frozen.params == full.trainable
    assert frozen.store_bytes + frozen.marker_bytes < sum(frozen.folder_bytes)
    # after the first save, only what trains is new: the frozen weights are stored once
    assert max(v["new_bytes"] for v in frozen.versions[1:]) < frozen.versions[0]["new_bytes"] / 2
    scores = evaluate(r)
    for key, limit in TARGETS.items():
        assert scores[key]["target"] == limit and scores[key]["value"] is not None
    assert 0 < scores["frozen_bytes_vs_folders"]["value"] < 1
    _reports(r, tmp_path)


@pytest.mark.slow
def test_megatron_workload_loads_bit_exact_and_an_unchanged_save_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from benchmarks.mcore import OPERATIONS, TARGETS, run_megatron

    r = run_megatron(0.01, tmp_path, lambda _: None)
    assert r.verified
    assert set(r.seconds) == set(OPERATIONS) and all(min(t.values()) > 0 for t in r.seconds.values())
    assert r.versions["first"]["new_bytes"] > 0 and r.versions["dense"]["new_bytes"] > 0
    assert r.versions["unchanged"]["new_bytes"] == 0
    assert r.versions["first"]["logical_bytes"] == r.logical_bytes  # every piece saved once
    assert r.folder_bytes["first"] > 0
    scores = evaluate(r)
    for key, limit in TARGETS.items():
        assert scores[key]["target"] == limit and scores[key]["value"] is not None
    assert scores["new_unchanged_of_logical"]["met"]
    _reports(r, tmp_path)


def _reports(result: object, tmp_path: Path) -> None:
    """The result prints in run.py's tables and writes JSON with its notes and metrics."""
    name = result.name  # type: ignore[attr-defined]
    out = io.StringIO()
    print_report(Console(file=out, width=200), {name: result}, 0.01)  # type: ignore[dict-item]
    assert "casckpt vs same-run baselines" in out.getvalue() and name in out.getvalue()
    path = tmp_path / "r.json"
    write_json(path, {name: result}, {"scale": 0.01})  # type: ignore[dict-item]
    document = json.loads(path.read_text())
    assert name in document["notes"] and "metrics" in document["results"][name]
