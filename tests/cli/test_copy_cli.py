"""``casckpt copy``: the table, ``--json``, ``--dry-run`` and the exit codes of its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def _fill(path: Path) -> list[casckpt.Version]:
    with casckpt.open(path) as s:
        return [s.commit({"w": torch.full((4096,), float(step)), "step": step}, run="r", step=step,
                         tags=["best"] if step == 2 else ()) for step in (1, 2, 3)]


def test_copy_prints_what_it_sent_then_that_nothing_is_left_to_send(tmp_path: Path) -> None:
    made = _fill(tmp_path / "src")
    dst = str(tmp_path / "dst")
    dry = cli("--store", str(tmp_path / "src"), "copy", "tag:best", "--to", dst, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would copy (ancestor)" in dry.stdout and "Dry run: would send" in dry.stdout
    assert not (tmp_path / "dst").exists()  # a dry run writes nothing, not even a new store
    sent = cli("--store", str(tmp_path / "src"), "copy", "tag:best", "--to", dst, "--json")
    assert sent.exit_code == 0, sent.output
    doc = json.loads(sent.stdout)
    assert [(v["step"], v["sent"], v["id"]) for v in doc["versions"]] == [(1, True, made[0].id),
                                                                        (2, True, made[1].id)]
    assert doc["tags"] == ["best"] and doc["chunks"] > 0 and not doc["nothing_sent"]
    again = cli("--store", str(tmp_path / "src"), "copy", "r@1", "r@2", "--to", dst)
    assert again.exit_code == 0, again.output
    assert f"Nothing to send: {dst} holds every version asked for." in again.stdout
    assert again.stdout.count("present") == 2
    with casckpt.open(dst, create=False) as copied:
        assert torch.equal(copied.restore("r@2")["w"], torch.full((4096,), 2.0))


def test_copy_refusals_exit_with_their_codes(tmp_path: Path) -> None:
    _fill(tmp_path / "src")
    itself = cli("--store", str(tmp_path / "src"), "copy", "r@1", "--to", str(tmp_path / "src"))
    assert itself.exit_code == 2 and "copied into itself" in itself.output
    missing = cli("--store", str(tmp_path / "src"), "copy", "r@9", "--to", str(tmp_path / "dst"))
    assert missing.exit_code == 3, missing.output
    assert not (tmp_path / "dst").exists()  # a bad ref creates no destination
    with casckpt.open(tmp_path / "dst") as other:
        other.commit({"w": torch.zeros(3)}, run="r", step=1)
    diverged = cli("--store", str(tmp_path / "src"), "copy", "r@2", "--to", str(tmp_path / "dst"))
    assert diverged.exit_code == 5 and "diverged" in diverged.output  # as VersionExistsError


def test_copy_into_an_encrypted_store_maps_the_ids(tmp_path: Path) -> None:
    made = _fill(tmp_path / "src")
    key = tmp_path / "k"
    casckpt.generate_key_file(key)
    dst = str(tmp_path / "enc")
    result = cli("--store", str(tmp_path / "src"), "copy", "r@3", "--to", dst, "--to-key-file", str(key),
                 "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [v["source_id"] for v in doc["versions"]] == [v.id for v in made]
    assert all(v["id"] != v["source_id"] for v in doc["versions"])
    keyless = cli("--store", str(tmp_path / "src"), "copy", "r@3", "--to", dst)
    assert keyless.exit_code != 0 and "key" in keyless.output
    with casckpt.open(dst, key_file=key, create=False) as enc:
        assert enc.resolve("r@3").id == doc["versions"][-1]["id"]


def test_the_sources_key_in_the_environment_is_not_the_destinations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CASCKPT_KEY_FILE is the source's key: it made a new destination encrypted (every byte
    re-read, ids changed) and refused a plain one. Only --to-key-file keys the destination."""
    key = tmp_path / "src.key"
    casckpt.generate_key_file(key)
    with casckpt.open(tmp_path / "src", key_file=key) as s:
        made = s.commit({"w": torch.arange(4096.0)}, run="r", step=1)
    monkeypatch.setenv("CASCKPT_KEY_FILE", str(key))
    dst = str(tmp_path / "dst")
    sent = cli("--store", str(tmp_path / "src"), "copy", "r@1", "--to", dst, "--json")
    assert sent.exit_code == 0, sent.output
    monkeypatch.delenv("CASCKPT_KEY_FILE")
    with casckpt.open(dst, create=False) as plain:  # plain: opens without any key
        assert torch.equal(plain.restore("r@1")["w"], torch.arange(4096.0))
        assert plain.resolve("r@1").id != made.id  # re-keyed into the plain store: another id


def test_copy_shows_packs_it_stored_below_their_redundancy(tmp_path: Path) -> None:
    _fill(tmp_path / "src")
    dst = tmp_path / "dst"
    casckpt.open(dst, blobs=[str(tmp_path / f"disk{i}") for i in range(6)], redundancy="ec:4+2").close()
    shutil.rmtree(tmp_path / "disk2")
    table = cli("--store", str(tmp_path / "src"), "copy", "r@1", "--to", str(dst))
    assert table.exit_code == 0, table.output
    assert "DEGRADED" in table.stdout and "casckpt repair" in table.stdout
    doc = json.loads(cli("--store", str(tmp_path / "src"), "copy", "r@2", "--to", str(dst), "--json").stdout)
    assert doc["degraded_packs"] > 0 and [v["sent"] for v in doc["versions"]] == [True]
