"""The checkpoint-interval advisor (``store.ops.advise``, ``casckpt advise``) on synthetic histories.

Versions are committed for real, then their ``created_at`` and ``stall_s`` (and drill
results) are set in the catalog to documented values, so the advice can be checked against
Young's and Daly's formulas worked out by hand (docs/guides/drills-and-intervals.md).
"""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.catalog.drills import Commit
from casckpt.cli.main import app
from casckpt.cli.shared import EXIT_NOT_FOUND, EXIT_USAGE
from casckpt.engine.maintenance.advise import advise, daly, young
from casckpt.errors import InvalidArgumentError, RunNotFoundError

T0 = 1_800_000_000.0
STALLS = (30.0, 10.0, 50.0, 30.0, 20.0, 40.0)  # median 30
INTERVAL, STEPS = 600.0, 100  # every 10 minutes, every 100 steps
DRILLS = (2.0, 4.0, 3.0)  # median 3


def _commit(root: Path, run: str, steps: range) -> None:
    with casckpt.open(root) as store:
        for step in steps:
            store.commit({"w": torch.full((64,), float(step))}, run=run, step=step)


def _rewrite(root: Path, run: str, stalls: tuple[float | None, ...], drills: tuple[float, ...] = ()) -> None:
    """Test-only catalog update: the run's versions (by step) get ``created_at`` T0 + i *
    INTERVAL and the given stalls; ``drills`` adds successful drill results of its first version
    (and one failed drill, which the advisor must ignore)."""
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        ids = [r[0] for r in db.execute(
            "SELECT v.id FROM versions v JOIN runs r ON r.id = v.run_id WHERE r.name = ? ORDER BY v.step",
            (run,))]
        for i, (vid, stall) in enumerate(zip(ids, stalls, strict=True)):
            db.execute("UPDATE versions SET created_at = ?, stall_s = ? WHERE id = ?",
                       (T0 + i * INTERVAL, stall, vid))
        for i, seconds in enumerate((*drills, 999.0) if drills else ()):
            db.execute("INSERT INTO drills (drill_id, at, version_id, run, step, bytes, seconds, ok, error) "
                       "VALUES (?, ?, ?, ?, 0, 256, ?, ?, ?)",
                       (f"d{i}", T0 + i, ids[0], run, seconds, seconds != 999.0,
                        None if seconds != 999.0 else "corrupt"))


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    _commit(root, "r", range(0, len(STALLS) * STEPS, STEPS))
    _rewrite(root, "r", STALLS, DRILLS)
    return root


def test_the_advice_is_daly_and_young_on_a_documented_history(synthetic: Path) -> None:
    with casckpt.open(synthetic, create=False) as store:
        advice = store.ops.advise("r", mtbf="8h", restart="5m")
    c, m, r = 30.0, 8 * 3600.0, 3.0 + 300.0
    assert (advice.checkpoint_cost_s, advice.mtbf_s, advice.restore_s, advice.restart_s) == (c, m, 3.0, 300.0)
    assert advice.restore_source == "drills" and advice.commits == len(STALLS)
    # worked by hand: sqrt(2 * 30 * 28800) and Daly's series (docs/guides/drills-and-intervals.md)
    assert advice.young_interval_s == pytest.approx(1314.5341380, abs=1e-6)
    assert advice.young_interval_s == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)
    x = c / (2 * m)
    series = 1 + math.sqrt(x) / 3 + x / 9
    assert advice.advised_interval_s == pytest.approx(math.sqrt(2 * c * m) * series - c)
    assert advice.advised_interval_s == pytest.approx(1294.6102106, abs=1e-6)
    assert (advice.current_interval_s, advice.current_interval_steps) == (INTERVAL, STEPS)
    assert advice.step_rate == pytest.approx(STEPS / INTERVAL)
    assert advice.advised_interval_steps == 216  # round(1294.61 / 6)
    tau = advice.advised_interval_s
    assert advice.expected_overhead == pytest.approx(
        {"current": c / INTERVAL + (INTERVAL / 2 + r) / m, "advised": c / tau + (tau / 2 + r) / m})
    assert advice.expected_overhead["advised"] < advice.expected_overhead["current"]
    assert advice.expected_lost_work_s == pytest.approx({"current": 603.0, "advised": tau / 2 + r})


def test_a_checkpoint_costlier_than_twice_the_mtbf_is_advised_every_mtbf() -> None:
    assert daly(30.0, 10.0) == 10.0 and daly(20.0, 10.0) == 10.0
    assert young(30.0, 10.0) == pytest.approx(math.sqrt(600.0))
    assert daly(19.0, 10.0) < 10.0 + 19.0  # the series below the bound


def test_without_drills_the_restore_is_measured_and_not_recorded(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _commit(root, "r", range(0, 400, 100))
    _rewrite(root, "r", (1.0, 2.0, 3.0, 4.0))
    with casckpt.open(root, create=False) as store:
        advice = store.ops.advise("r", mtbf=timedelta(hours=2))
        assert advice.restore_source == "measured" and 0 < advice.restore_s < 60
        assert (advice.checkpoint_cost_s, advice.restart_s, advice.mtbf_s) == (2.5, 0.0, 7200.0)
        assert store.ops.drill_history() == [] and store.ops.audit(action="drill") == []


def test_the_json_report_has_the_keys_the_issue_lists(synthetic: Path) -> None:
    result = CliRunner().invoke(app, ["--store", str(synthetic), "advise", "r", "--mtbf", "8h",
                                      "--restart", "5m", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    for key in ("checkpoint_cost_s", "restore_s", "mtbf_s", "advised_interval_s", "advised_interval_steps",
                "current_interval_s", "young_interval_s"):
        assert isinstance(doc[key], (int, float)), key
    for key in ("expected_overhead", "expected_lost_work_s"):
        assert set(doc[key]) == {"current", "advised"}
    assert doc["advised_interval_steps"] == 216 and doc["restore_source"] == "drills"
    text = CliRunner().invoke(app, ["--store", str(synthetic), "advise", "r", "--mtbf", "8h"])
    assert text.exit_code == 0 and "Checkpoint every 216 steps" in text.stdout


@pytest.mark.parametrize("mtbf", [0, -5, 0.0, "0s", "-1h", "abc", float("nan"), float("inf"),
                                  timedelta(0), True, None])
def test_nonsense_mtbf_is_refused(synthetic: Path, mtbf: object) -> None:
    with casckpt.open(synthetic, create=False) as store, \
            pytest.raises(InvalidArgumentError, match="mtbf"):
        store.ops.advise("r", mtbf=mtbf)  # type: ignore[arg-type]


@pytest.mark.parametrize("restart", [-1, "-5m", "soon", float("nan")])
def test_a_negative_restart_is_refused(synthetic: Path, restart: object) -> None:
    with casckpt.open(synthetic, create=False) as store, \
            pytest.raises(InvalidArgumentError, match="restart"):
        store.ops.advise("r", mtbf="8h", restart=restart)  # type: ignore[arg-type]


def test_runs_without_a_history_to_measure_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _commit(root, "one", range(1))
    _commit(root, "old", range(3))
    _rewrite(root, "old", (None, None, 5.0))  # as versions committed before schema 0011
    with casckpt.open(root, create=False) as store:
        with pytest.raises(RunNotFoundError, match="no run"):
            store.ops.advise("nope", mtbf="8h")
        for run, count in (("one", 1), ("old", 1)):
            with pytest.raises(InvalidArgumentError, match=f"{count} commit.*at least 2.*commit a few more"):
                store.ops.advise(run, mtbf="8h")
    runner = CliRunner()
    zero = runner.invoke(app, ["--store", str(root), "advise", "one", "--mtbf", "0"])
    assert zero.exit_code == EXIT_USAGE and "mtbf 0 s is out of range" in zero.stderr
    unknown = runner.invoke(app, ["--store", str(root), "advise", "nope", "--mtbf", "8h"])
    assert unknown.exit_code == EXIT_NOT_FOUND


@pytest.mark.parametrize(("api", "cli"), [
    (1e308, "1e308"), (0.0, "0"), (float("inf"), "inf"), (float("nan"), "nan"),
    (1e-300, "1e-300"), (10**400, "1" + "0" * 400), (0.5, "0.5s"), (3.2e9, "3.2e9")])
def test_an_extreme_mtbf_is_refused_alike_by_the_api_and_the_cli(
        synthetic: Path, api: object, cli: str) -> None:
    with casckpt.open(synthetic, create=False) as store, \
            pytest.raises(InvalidArgumentError, match="out of range") as refused:
        store.ops.advise("r", mtbf=api)  # type: ignore[arg-type]
    result = CliRunner().invoke(app, ["--store", str(synthetic), "advise", "r", "--mtbf", cli])
    assert result.exit_code == EXIT_USAGE, result.output
    assert str(refused.value) in " ".join(result.output.split())


@pytest.mark.parametrize(("api", "cli"), [(1.0, "1"), (1.0, "1s"), (3.1e9, "3.1e9"), (7200, "2h")])
def test_the_mtbf_range_edges_advise_alike_in_the_api_and_the_cli(
        synthetic: Path, api: float, cli: str) -> None:
    with casckpt.open(synthetic, create=False) as store:
        advice = store.ops.advise("r", mtbf=api)
    result = CliRunner().invoke(app, ["--store", str(synthetic), "advise", "r", "--mtbf", cli, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["advised_interval_s"] == advice.advised_interval_s


COMMITS = [Commit(i * 100, 1_800_000_000.0 + i * 600, 30.0) for i in range(6)]


def test_an_mtbf_that_overflows_the_arithmetic_is_refused_not_infinity() -> None:
    # C / M is inf: --json printed an "Infinity" overhead
    with pytest.raises(InvalidArgumentError, match="mtbf"):
        advise("r", COMMITS, restore_s=3.0, restore_source="drills", restart_s=0.0, mtbf_s=1e-320)


def test_a_restart_that_overflows_the_overhead_is_refused_not_infinity() -> None:
    with pytest.raises(InvalidArgumentError, match="restart"):
        advise("r", COMMITS, restore_s=3.0, restore_source="drills", restart_s=1e308, mtbf_s=0.1)


@pytest.mark.parametrize("mtbf", [1e200, 1e308])
def test_a_huge_finite_mtbf_gets_finite_advice_not_a_traceback(mtbf: float) -> None:
    # 1e308: sqrt(2 C M) overflowed to inf and round(inf * rate) raised OverflowError
    advice = advise("r", COMMITS, restore_s=3.0, restore_source="drills", restart_s=0.0, mtbf_s=mtbf)
    assert math.isfinite(advice.advised_interval_s) and advice.advised_interval_steps > 1
    assert all(math.isfinite(x) for x in advice.expected_overhead.values())
