"""The ``peers`` benchmark end to end at a tiny scale (``benchmarks/peers.py``, issue 32).

Its figures are only worth what the run checks: every tool saves every checkpoint in every
regime, every restore is the saved state bit for bit (the run raises otherwise), prune frees
what a tool can free, and a tool that is not installed is reported absent with the targets
that need it waived, never silently dropped. No timing is asserted.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the workload lives with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.peers import REGIMES, PeersResult, RegimeRound, ToolRound, rotated, run_peers  # noqa: E402
from benchmarks.peers_report import TARGETS, markdown_table  # noqa: E402
from benchmarks.peers_tools import ABSENT, NO_INSTALL_ENV  # noqa: E402
from benchmarks.report import evaluate, print_report, write_json  # noqa: E402

SCALE = 0.002  # d_model 64, vocab 1472: a ~6 MiB state


def _quiet(_: str) -> None:
    pass


@pytest.mark.slow  # ~30-50 s on 2 cores; CI's benchmark smoke run covers the workload too
def test_every_regime_runs_every_restore_is_checked_and_absent_tools_are_waived(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no borg, no restic, no apt-get: nothing installed
    monkeypatch.setenv(NO_INSTALL_ENV, "1")
    tools = ("torch", "dcp", "dcp-async", "casckpt", "casckpt-bg", "casckpt-hint", "borg-zstd", "restic")
    r = run_peers(SCALE, tmp_path / "work", _quiet, rounds=1, checkpoints=4, tools=tools, restore_reps=1)
    assert r.versions == {"borg": None, "restic": None} and r.installed is None
    assert r.tools["borg-zstd"] == r.tools["restic"] == ABSENT
    assert r.tools["borg-none"] == r.tools["dcp-async-cached"] == "not run"
    assert [run.regime for run in r.runs] == list(REGIMES)
    measured = ["torch", "dcp", "dcp-async", "casckpt", "casckpt-bg", "casckpt-hint"]
    for run in r.runs:
        assert list(run.tools) == measured
        for key, t in run.tools.items():
            assert len(t.saves_s) == len(t.stalls_s) == 4 and len(t.restores_s) == 1
            assert all(stall <= total for stall, total in zip(t.stalls_s, t.saves_s, strict=True))
            if key == "dcp-async":  # keeps only its newest checkpoint: no bytes, no prune
                assert t.disk is None and t.prune_s is None
            else:
                assert t.disk and t.prune_s is not None and t.reclaimed is not None
        torch_files = run.tools["torch"]
        assert torch_files.reclaimed == pytest.approx(torch_files.disk / 4, rel=0.05)  # 1 of 4 files
        for key in ("casckpt", "casckpt-bg", "casckpt-hint"):
            assert run.tools[key].aside  # the index cache, counted apart
            assert run.tools[key].stored_sum
        if run.regime == "lora":  # the frozen base is stored once, not 4 times
            assert run.tools["casckpt"].disk < 0.5 * torch_files.disk
    scores = evaluate(r)
    assert scores["frozen_bytes_vs_borg"]["waived"] == f"borg zstd,1 {ABSENT}"
    assert scores["frozen_bytes_vs_borg"]["met"] is None
    for key, limit in TARGETS.items():
        if key != "frozen_bytes_vs_borg":
            assert scores[key]["target"] == limit and scores[key]["value"] is not None, key
    table = markdown_table(r)
    assert f"| restic | {ABSENT} |" in table and "| borg zstd,1 |" in table
    assert "borg none" not in table
    assert table.count("**") >= 2 * len(REGIMES)
    assert not any((tmp_path / "work").glob("*-0"))  # every regime's folders removed
    out = io.StringIO()  # the suite's report and JSON take the result like any workload's
    print_report(Console(file=out, width=200), {"peers": r}, SCALE)
    assert "peers: casckpt vs torch.save, DCP, borg, restic" in out.getvalue()
    assert "waived" in out.getvalue()  # frozen bytes vs borg, borg absent
    write_json(tmp_path / "r.json", {"peers": r}, {"scale": SCALE})
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"]["peers"]["metrics"]["lora_bytes"]["target"] == 0.12
    assert saved["results"]["peers"]["raw"]["tools"]["restic"] == ABSENT
    assert "peers" in saved["notes"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("borg") is None or shutil.which("restic") is None,
                    reason="borg or restic not installed: run benchmarks/peers_setup.sh")
def test_borg_and_restic_save_restore_and_prune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_INSTALL_ENV, "1")
    r = run_peers(SCALE, tmp_path, _quiet, rounds=1, checkpoints=4, regimes=("lora",),
                  tools=("torch", "casckpt", "borg-zstd", "borg-none", "restic"), restore_reps=1)
    assert r.versions["borg"] and r.versions["restic"]
    (run,) = r.runs
    torch_bytes = run.tools["torch"].disk
    assert torch_bytes
    for key in ("borg-zstd", "borg-none", "restic"):
        t = run.tools[key]
        assert len(t.saves_s) == 4 and len(t.restores_s) == 1  # restored through the tool, checked
        assert t.disk and t.aside is not None and t.reclaimed is not None
    assert run.tools["borg-zstd"].disk < run.tools["borg-none"].disk  # compression is on
    scores = evaluate(r)
    assert scores["lora_bytes_vs_borg"]["value"] is not None and "waived" not in scores["lora_bytes_vs_borg"]


def _round(regime: str, saves: dict[str, float], disk: dict[str, int | None]) -> RegimeRound:
    tools = {key: ToolRound([s, s], [s, s], [s], disk[key], 0, None, None if disk[key] is None else 0.1, None)
             for key, s in saves.items()}
    return RegimeRound(regime, 0, 10, 1, 100, list(tools), tools)


def test_markdown_table_bolds_the_best_of_each_column_per_regime() -> None:
    runs = [_round("full", {"torch": 1.0, "dcp": 0.8, "dcp-async": 0.9, "casckpt": 1.2},
                   {"torch": 100, "dcp": 110, "dcp-async": None, "casckpt": 80}),
            _round("lora", {"torch": 1.0, "dcp": 0.8, "dcp-async": 0.9, "casckpt": 0.3},
                   {"torch": 100, "dcp": 110, "dcp-async": None, "casckpt": 10})]
    status = {"torch": "measured", "dcp": "measured", "dcp-async": "measured", "casckpt": "measured",
              "restic": ABSENT}
    r = PeersResult("peers", 1.0, 1, 2, ["full", "lora"], status, {"restic": None}, None, runs)
    lines = markdown_table(r).splitlines()
    assert lines[0] == "| regime | tool | save | bytes | restore | stall | prune s / reclaimed |"
    full = {line.split(" | ")[1]: line for line in lines[2:7]}
    assert "| **0.80** | 1.10 |" in full["DCP"]  # fastest save; bytes of DCP not the best
    assert "| 1.20 | **0.80** |" in full["casckpt"]
    assert full["restic"].endswith(f"| {ABSENT} | | | | |")
    lora = {line.split(" | ")[1]: line for line in lines[7:]}
    assert "| **0.30** | **0.10** |" in lora["casckpt"]
    assert lines[2].startswith("| full fine-tune (50 B file) | torch.save |")
    assert "| **0.80** | 1.10 | **0.80** |" in full["DCP"]  # the fastest restore too
    assert all(full[t].endswith("| **0.10 s** |") for t in ("torch.save", "DCP", "casckpt"))  # a tie
    assert full["DCP async"].endswith("| 1.00 |  |")  # the stall baseline; no history kept: no prune


def test_values_that_read_the_same_are_all_bold() -> None:
    runs = [_round("lora", {"torch": 1.0, "casckpt": 0.301, "casckpt-bg": 0.3},
                   {"torch": 1000, "casckpt": 140, "casckpt-bg": 139})]
    status = dict.fromkeys(("torch", "casckpt", "casckpt-bg"), "measured")
    table = markdown_table(PeersResult("peers", 1.0, 1, 2, ["lora"], status, {}, None, runs))
    assert table.count("| **0.30** | **0.14** |") == 2


def test_a_result_read_back_from_json_gives_the_same_table() -> None:
    runs = [_round("frozen", {"torch": 1.0, "dcp-async": 0.9, "casckpt": 0.5},
                   {"torch": 100, "dcp-async": None, "casckpt": 40})]
    status = {"torch": "measured", "dcp-async": "measured", "casckpt": "measured", "borg-zstd": ABSENT}
    versions = {"borg": None, "restic": "restic 0.14.0"}
    r = PeersResult("peers", 0.1, 1, 2, ["frozen"], status, versions, None, runs)
    back = PeersResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and markdown_table(back) == markdown_table(r)


def test_rotation_changes_who_goes_first() -> None:
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []
