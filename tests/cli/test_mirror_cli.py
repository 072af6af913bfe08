"""``casckpt mirror``: add, run (table, ``--json``, ``--dry-run``, exit codes), status and remove."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app


def cli(store: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--store", str(store), "mirror", *args])


def _fill(path: Path) -> None:
    with casckpt.open(path) as s:
        for step in (1, 2, 3):
            s.commit({"w": torch.full((4096,), float(step))}, run="r", step=step,
                     tags=["best"] if step == 2 else ())


def test_add_run_status_and_remove(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _fill(src)
    added = cli(src, "add", "hot", "--to", str(dst), "--run", "r", "--tag", "best", "--keep-last", "1")
    assert added.exit_code == 0, added.output
    assert "--run r --tag best --keep-last 1" in added.stdout

    dry = cli(src, "run", "hot", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.count("would send") == 3 and not dst.exists()  # two versions, and the summary

    sent = cli(src, "run", "hot", "--json")
    assert sent.exit_code == 0, sent.output
    doc = json.loads(sent.stdout)
    assert [(v["step"], v["status"]) for v in doc["versions"]] == [(2, "sent"), (3, "sent")]
    assert doc["tags"] == ["best"] and doc["failed"] == 0 and not doc["nothing_sent"]

    again = cli(src, "run")
    assert again.exit_code == 0 and "nothing to send" in again.stdout

    table = cli(src, "status")
    assert table.exit_code == 0, table.output
    assert "hot" in table.stdout and str(dst) in table.stdout and "--keep-last 1" in table.stdout
    [status] = json.loads(cli(src, "status", "--json").stdout)
    assert (status["name"], status["versions_sent"], status["failed"], status["last_error"]) == (
        "hot", 2, [], None)
    assert status["bytes_sent"] == doc["bytes"] > 0

    removed = cli(src, "remove", "hot")
    assert removed.exit_code == 0 and "removed" in removed.stdout
    assert "no mirror" in cli(src, "status").output
    assert json.loads(cli(src, "status", "--json").stdout) == []


def test_exit_codes_of_a_failed_version_and_of_an_unreachable_destination(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _fill(src)
    with casckpt.open(dst) as d:  # the runs diverged there at r@3
        d.commit({"w": torch.zeros(4)}, run="r", step=3)
    assert cli(src, "add", "m", "--to", str(dst), "--run", "r", "--keep-every", "1").exit_code == 0
    failed = cli(src, "run", "m")
    assert failed.exit_code == 1, failed.output
    assert "failed" in failed.stdout and "diverged" in failed.stdout
    status = cli(src, "status", "m")
    assert "r@3" in status.stdout and "diverged" in status.stdout

    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "s")
    assert cli(src, "add", "bad", "--to", bad, "--run", "r", "--keep-last", "1").exit_code == 0
    unreachable = cli(src, "run", "bad")
    assert unreachable.exit_code == 5 and "could not be opened" in unreachable.output
    assert "the last run failed" in cli(src, "status").stdout
    assert cli(src, "add", "none", "--to", str(dst), "--run", "r").exit_code == 2  # nothing selected
    assert cli(src, "remove", "nope").exit_code == 3


def test_running_every_mirror_prints_each_report_when_a_destination_fails(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _fill(src)
    (tmp_path / "file").write_text("x")
    assert cli(src, "add", "a-bad", "--to", str(tmp_path / "file" / "s"), "--run", "r",
               "--keep-last", "1").exit_code == 0
    assert cli(src, "add", "b-good", "--to", str(tmp_path / "dst"), "--run", "r",
               "--keep-last", "1").exit_code == 0
    shown = cli(src, "run")
    assert shown.exit_code == 5 and "b-good -> " in shown.stdout and "sent 1 version" in shown.stdout
    assert "a-bad -> " in shown.stdout and "could not be opened" in shown.stdout
    as_json = cli(src, "run", "--json")
    assert as_json.exit_code == 5
    docs = json.loads(as_json.stdout)
    assert [d["mirror"] for d in docs] == ["a-bad", "b-good"] and "could not be opened" in docs[0]["error"]
    assert docs[1]["nothing_sent"]
