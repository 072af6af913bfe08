"""Invariant 9: bytes returned are bound to the ref that asked for them.

Issue 13, case 2: swapping ``versions.step`` in the catalog made
``restore("r@1")`` return step 2's state. The manifest a ref leads to is
verified against its id and its run, step, parent and time compared with the
catalog row; any disagreement is VersionMismatchError naming both.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import VersionMismatchError

CHUNK = 4096


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((5000,), float(step)), "step": step}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK) as store:
        for step in (1, 2):
            store.commit(_state(step), run="r", step=step, tags=[f"t{step}"])
        store.fork("r@1", "ft")
    return root


def _sql(root: Path, *statements: str) -> None:
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        for statement in statements:
            db.execute(statement)


def _swap_steps(root: Path) -> None:  # the reproduction
    _sql(root, "UPDATE versions SET step = step + 10", "UPDATE versions SET step = 13 - step")


def test_swapped_steps_never_return_the_other_versions_data(root: Path) -> None:
    _swap_steps(root)
    with casckpt.open(root) as store:
        for ref in ("r@1", "r@2", "r@latest", "r@~1", "tag:t1"):
            with pytest.raises(VersionMismatchError, match="the catalog is damaged") as info:
                store.restore(ref)
            assert "r@1" in str(info.value) and "r@2" in str(info.value)
        with pytest.raises(VersionMismatchError):
            store.load_tensor("r@1", "w")
        with pytest.raises(VersionMismatchError):
            store.show("r@1")
        with pytest.raises(VersionMismatchError):
            store.diff("r@1", "r@2")
        with pytest.raises(VersionMismatchError):
            store.dcp_reader("r@1")
        with pytest.raises(VersionMismatchError):
            store.restore("r@1", into=_state(0))
        assert not store.ops.check().ok  # check names it too
    result = CliRunner().invoke(app, ["--store", str(root), "show", "r@1"])
    assert result.exit_code == 4 and "damaged" in result.stderr


@pytest.mark.parametrize("column,value", [
    ("run_id", "(SELECT id FROM runs WHERE name = 'ft')"),
    ("parent_id", "'" + "ab" * 32 + "'"),
])
def test_any_disagreement_between_row_and_manifest_is_refused(root: Path, column: str, value: str) -> None:
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        (version_id,) = db.execute(
            "SELECT versions.id FROM versions JOIN runs ON runs.id = run_id WHERE step = 2").fetchone()
    _sql(root, f"UPDATE versions SET {column} = {value} WHERE id = '{version_id}'")
    with casckpt.open(root) as store:
        ref = "ft@2" if column == "run_id" else "r@2"
        with pytest.raises(VersionMismatchError):
            store.restore(ref)
        assert torch.equal(store.restore("r@1")["w"], _state(1)["w"])  # the others are fine


def test_a_manifest_of_another_version_under_this_id_is_refused(root: Path) -> None:
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        rows = db.execute("SELECT id, manifest FROM versions ORDER BY step").fetchall()
        db.execute("UPDATE versions SET manifest = ? WHERE id = ?", (rows[1][1], rows[0][0]))
    with casckpt.open(root) as store:
        with pytest.raises(casckpt.errors.CorruptManifestError):
            store.restore("r@1")
