"""Damaged values in the catalog are typed errors that ``check`` finds (found by the 10,000-case
fuzz run): a tensor's shape, a version's metadata or metrics that are not JSON, JSON that
disagrees with the version's manifest, a tensor size that is not a number. Before, ``show``,
``log``, ``history`` and ``check`` raised ``json.JSONDecodeError`` or ``TypeError`` (not a
CasckptError), or ``check`` passed.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import CatalogError, MetricNotFoundError

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))
from make_legacy import legacy  # noqa: E402

DAMAGE = {
    "shape not JSON": "UPDATE tensors SET shape = ''",
    "size not a number": "UPDATE tensors SET nbytes = x'0000000000000000'",
    "metadata not JSON": "UPDATE versions SET meta = '{'",
    "metrics not JSON": "UPDATE versions SET metrics = 'x'",
    "metrics not an object": "UPDATE versions SET metrics = '[1, 2]'",
    "metrics changed": """UPDATE versions SET metrics = '{"loss": 0.25}'""",
    "metadata changed": """UPDATE versions SET meta = '{"lr": 2}'""",
}
READS: dict[str, Callable[[casckpt.Store], Any]] = {
    "log": lambda store: store.log("r"),
    "show": lambda store: store.show("r@1"),
    "history": lambda store: store.history("r", "w"),
    "best": lambda store: store.best("r", "loss"),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # versions as casckpt wrote them before tree manifests, with tensor rows to damage (the
    # golden ``catalog-values``: w changes from r@1 to r@2, so history compares the two rows)
    root = legacy("catalog-values", tmp_path_factory.mktemp("template") / "store")
    with casckpt.open(root) as store:
        assert store.ops.check().ok
    return root


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_json_value_is_a_typed_error_and_check_finds_it(template: Path, tmp_path: Path,
                                                                  damage: str) -> None:
    root = tmp_path / "store"
    shutil.copytree(template, root)
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        db.execute(DAMAGE[damage])
    with casckpt.open(root) as store:
        for name, read in READS.items():
            try:
                read(store)
            except CatalogError as exc:  # typed, and says what to do
                assert "casckpt check" in str(exc) or "catalog query failed" in str(exc), (name, exc)
            except MetricNotFoundError:  # metrics that are not an object record no metric
                assert name == "best" and "metrics" in damage
        report = store.ops.check()
        assert not report.ok and {p.kind for p in report.problems} == {"catalog"}, report.problems
        try:  # the version's row cannot be read whole: a typed error, or the exact data
            restored = store.restore("r@1")
        except CatalogError as exc:
            assert "not" in damage and "shape" not in damage and "size" not in damage, exc
        else:
            assert torch.equal(restored["w"], torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("column", ["stripe", "data_offset"])
def test_an_ec_pack_row_without_its_stripe_is_a_typed_error(tmp_path: Path, column: str) -> None:
    root = tmp_path / "store"
    state = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(3))}
    with casckpt.open(root, blobs=[str(tmp_path / f"d{i}") for i in range(3)],
                      redundancy="ec:2+1") as store:
        store.commit(state, run="r", step=1)
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        assert db.execute(f"UPDATE packs SET {column} = NULL WHERE scheme = 'ec'").rowcount > 0
    with casckpt.open(root) as store:
        with pytest.raises(CatalogError, match="an ec pack has both"):  # was a ZeroDivisionError
            store.restore("r@1")
        with pytest.raises(CatalogError, match="an ec pack has both"):
            store.load_tensor("r@1", "w")
