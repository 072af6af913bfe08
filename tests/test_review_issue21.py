"""Hostile review of issue 21 (drills, the interval advisor, the HTML report): each test a finding."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.catalog.drills import Commit
from casckpt.engine.advise import advise
from casckpt.errors import InvalidArgumentError

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


_EVIL = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&'


def test_the_report_escapes_what_users_typed(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        for step in (1, 2):
            store.commit({"w": torch.full((64,), float(step))}, run="r", step=step,
                         metrics={_EVIL: 1.0 / step}, message=_EVIL, metadata={_EVIL: _EVIL})
        store.ops.drill(count=2)
        out = store.ops.report(tmp_path / "r.html")
    page = out.read_text(encoding="utf-8")
    assert "<script" not in page and "<img" not in page


def test_the_report_refuses_to_replace_what_is_not_a_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(8)}, run="r", step=1)
        for target in (fifo, folder):
            with pytest.raises((InvalidArgumentError, OSError)):
                store.ops.report(target)
    assert fifo.exists() and not fifo.is_file() and folder.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pipe", "store"]  # no temporary left


def test_metrics_matplotlib_cannot_plot_still_get_a_report_with_their_table(tmp_path: Path) -> None:
    # finite, so commit accepts them; matplotlib's tick locator raised ValueError and no report was written
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(4)}, run="x", step=0, metrics={"loss": 1e308, "acc": -1e308})
        store.commit({"w": torch.zeros(4)}, run="x", step=1, metrics={"loss": 5e-324, "acc": 1e308})
        page = store.ops.report(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "The plot could not be drawn" in page and "<td>1e+308</td>" in page
    assert page.count("<svg") >= 3  # the other sections still have their plots


def test_drilling_a_named_run_with_nothing_to_restore_is_not_ok(tmp_path: Path) -> None:
    # `casckpt drill --run a` exited 0 ("the store has no versions to drill") when every version
    # of run a was deleted: a cron drill said all is well for a run no restart can bring back
    from typer.testing import CliRunner

    from casckpt.cli.main import app
    from casckpt.cli.shared import EXIT_NOT_FOUND

    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit({"w": torch.zeros(4)}, run="a", step=0)
        store.commit({"w": torch.zeros(4)}, run="b", step=0)
        store.delete("a@0")
        with pytest.raises(casckpt.errors.RefNotFoundError, match="no version to drill"):
            store.ops.drill(runs=["a", "b"])
        assert store.ops.drill_history() == []  # nothing recorded
        assert store.ops.drill().ok  # every run: b is drilled, a (empty) is not named
    result = CliRunner().invoke(app, ["--store", str(root), "drill", "--run", "a"])
    assert result.exit_code == EXIT_NOT_FOUND and "no version to drill" in result.output


def test_the_report_never_writes_through_a_link_at_a_temporary_name(tmp_path: Path) -> None:
    # the temporary was always ".NAME.tmp": a symlink planted there was followed, writing the report
    # over whatever it pointed at (and two reports to one path wrote into one temporary)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".r.html.tmp").symlink_to(victim)
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(8)}, run="r", step=1)
        out = store.ops.report(tmp_path / "r.html")
    assert victim.read_text() == "precious" and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.html.tmp", "r.html", "store", "victim"]
