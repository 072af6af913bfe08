"""History and lineage: filtered log, diff, tensor history, fork, tree, best; API and CLI.

Chunk size is 4096 bytes throughout, so changed bytes can be computed exactly:
a float32 tensor of 4096 elements is 4 chunks of 1024 elements.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app
from casckpt.errors import (
    InvalidArgumentError,
    InvalidNameError,
    MetricNotFoundError,
    RefNotFoundError,
    RunExistsError,
    TensorNotFoundError,
)

sys.path.insert(0, str(Path(__file__).parents[2] / "golden"))
from make_legacy import legacy  # noqa: E402
from make_legacy import tied as _tied  # noqa: E402

CHUNK = 4096
RUN = "base"


def _weights(*bumps: int) -> torch.Tensor:
    """4096 float32 zeros (4 chunks) with element ``i`` set to 1 for each bump."""
    w = torch.zeros(4096)
    for i in bumps:
        w[i] = 1.0
    return w


def _state(step: int) -> dict[str, Any]:
    """``model.w`` changes at 200 (chunk 0) and 400 (chunks 1 and 3); ``model.extra``
    exists at 100-200 and again from 400; ``lr`` changes every version."""
    bumps = {0: (), 100: (), 200: (5,), 300: (5,), 400: (5, 1500, 3500)}[step]
    state: dict[str, Any] = {"model": {"w": _weights(*bumps), "b": torch.ones(3)},
                             "lr": 0.1 * (step + 1), "name": "warmup"}
    if step in (100, 200, 400):
        state["model"]["extra"] = torch.full((10,), float(step))
    return state


META = {0: {"opt": "sgd", "n": 0, "nested": {"lr": 0.5}, "flag": False, "code": "5"},
        100: {"opt": "adam", "n": 1, "nested": {"lr": 0.25}, "flag": False, "code": 5},
        200: {"opt": "sgd", "n": 2, "nested": {"lr": 0.125}, "flag": True},
        300: {"opt": "adam", "n": 3, "flag": True},
        400: {"opt": "adamw", "n": 4, "flag": True}}
METRICS = {0: {"loss": 5.0, "acc": 0.1}, 100: {"loss": 4.0, "acc": 0.3}, 200: {"loss": 3.0},
           300: {"loss": 3.0, "acc": 0.3}, 400: {"loss": 3.5, "acc": 0.2}}


def _fill(store: casckpt.Store) -> dict[int, casckpt.Version]:
    out = {}
    for step in (0, 100, 200, 300, 400):
        out[step] = store.commit(_state(step), run=RUN, step=step, metadata=META[step],
                                 metrics=METRICS[step], tags=("mid",) if step == 200 else ())
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as s:
        _fill(s)
        yield s
        assert s.ops.check().ok


def _steps(versions: list[casckpt.Version]) -> list[int]:
    return [v.step for v in versions]


# -- on every backend: the SQL that differs between SQLite and PostgreSQL -------------------


def test_history_queries_on_every_backend(store_config: Any) -> None:
    with store_config.open(chunk_size=CHUNK) as s:
        versions = _fill(s)
        assert _steps(s.log(RUN)) == [400, 300, 200, 100, 0]
        assert _steps(s.log(RUN, where="loss<=3")) == [300, 200]
        assert _steps(s.log(RUN, where=["metadata.opt==adam"], order="asc")) == [100, 300]
        assert _steps(s.log(RUN, where="meta.nested.lr<0.3")) == [200, 100]
        assert _steps(s.log(RUN, where="metadata.flag==true")) == [400, 300, 200]
        assert _steps(s.log(RUN, where="metadata.code==5")) == [100]
        assert _steps(s.log(RUN, where="metadata.code=='5'")) == [0]
        assert _steps(s.log(RUN, where="metadata.opt>adam")) == [400, 200, 0]
        assert _steps(s.log(RUN, where="acc!=0.3")) == [400, 0]
        assert _steps(s.log(RUN, tag="mid")) == [200]
        assert _steps(s.log(RUN, min_step=100, max_step=300, limit=2)) == [300, 200]
        assert _steps(s.log(RUN, since=versions[300].created_at)) == [400, 300]

        d = s.diff(f"{RUN}@300", f"{RUN}@400")
        assert [c.path for c in d.changed] == ["model.w"] and d.changed[0].changed_bytes == 2 * CHUNK
        assert d.changed_bytes == 2 * CHUNK + 40

        history = s.history(RUN, "model.extra")
        assert [(e.version.step, e.change) for e in history] == [
            (100, "added"), (200, "changed"), (300, "removed"), (400, "added")]

        forked = s.fork(f"{RUN}@200", "ft")
        assert (forked.name, forked.versions) == ("ft", 0)
        with pytest.raises(RunExistsError):
            s.fork(f"{RUN}@300", "ft")
        first = s.commit({"model": {"w": _weights(5, 10)}}, run="ft", step=0, metrics={"loss": 1.0})
        assert first.parent == versions[200].id
        assert [(n.name, n.parent_run, n.fork_step, n.versions) for n in s.lineage()] == [
            (RUN, None, None, 5), ("ft", RUN, 200, 1)]
        assert [(e.version.run, e.version.step, e.changed_bytes)
                for e in s.history("ft", "model.w")] == [
            (RUN, 0, 4 * CHUNK), (RUN, 200, CHUNK), ("ft", 0, CHUNK)]  # not base@400: after the fork
        assert s.best(RUN, "acc", "max").step == 300
        assert s.ops.check().ok


# -- log ------------------------------------------------------------------------------------


def test_log_keeps_its_defaults(store: casckpt.Store) -> None:
    assert _steps(store.log(RUN)) == [400, 300, 200, 100, 0]
    assert _steps(store.log(RUN, limit=2)) == [400, 300]
    assert _steps(store.log(RUN, order="asc", limit=2)) == [0, 100]
    store.commit({"x": torch.ones(1)}, run="other", step=7)
    assert [(v.run, v.step) for v in store.log(limit=2)] == [("other", 7), (RUN, 400)]
    assert store.log(RUN, tag="mid")[0].tags == ("mid",)


def test_log_time_bounds_are_inclusive(store: casckpt.Store) -> None:
    v = {x.step: x for x in store.log(RUN)}
    assert _steps(store.log(RUN, since=v[100].created_at, until=v[300].created_at)) == [300, 200, 100]
    epoch = v[200].created_at.timestamp()
    assert _steps(store.log(RUN, until=epoch - 1e-3)) == [100, 0]
    naive_local = v[400].created_at.astimezone().replace(tzinfo=None)
    assert _steps(store.log(RUN, since=naive_local)) == [400]
    assert store.log(RUN, since=datetime.now(timezone.utc) + timedelta(days=1)) == []


def test_log_where_combines_and_skips_versions_without_the_key(store: casckpt.Store) -> None:
    assert _steps(store.log(RUN, where=["loss<4.5", "acc>=0.2"])) == [400, 300, 100]
    assert _steps(store.log(RUN, where=["loss<4.5", "acc>=0.2"], min_step=200)) == [400, 300]
    assert _steps(store.log(RUN, where="acc>0")) == [400, 300, 100, 0]  # 200 has no acc
    assert _steps(store.log(RUN, where="metadata.nested.lr>0")) == [200, 100, 0]
    assert _steps(store.log(RUN, where="metadata.missing!=x")) == []
    assert _steps(store.log(RUN, where="metadata.opt>=5")) == []  # text never compares as a number
    assert _steps(store.log(RUN, where="metadata.n>=3.0")) == [400, 300]
    assert _steps(store.log(RUN, where="metadata.flag!=true")) == [100, 0]
    assert _steps(store.log(RUN, where=" loss == 3 ")) == [300, 200]


@pytest.mark.parametrize("predicate", [
    "loss", "loss<", "<3", "loss~3", "loss<<3", "loss<abc", "metadata.<3", "metadata.a..b==1",
    'metadata.a"b==1', "metadata.flag<true", "lo ss<3", 5,
])
def test_bad_predicates_explain_the_grammar(store: casckpt.Store, predicate: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="OP"):
        store.log(RUN, where=predicate)


def test_log_refuses_bad_arguments(store: casckpt.Store) -> None:
    with pytest.raises(InvalidArgumentError, match="order"):
        store.log(RUN, order="up")
    with pytest.raises(InvalidArgumentError, match="since"):
        store.log(RUN, since="yesterday")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="min_step"):
        store.log(RUN, min_step=1.5)  # type: ignore[arg-type]
    with pytest.raises(RefNotFoundError, match="bsae|base"):
        store.log("bsae")
    with pytest.raises(RefNotFoundError, match="tag:mid"):
        store.log(RUN, tag="mdi")


# -- diff -----------------------------------------------------------------------------------


def test_diff_counts_changed_chunks_exactly(tmp_path: Path) -> None:
    odd = torch.zeros(5000)  # 20000 bytes: 4 chunks of 4096 and one of 3616
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK) as s:
        s.commit({"w": _weights(), "odd": odd, "gone": torch.ones(7), "same": torch.ones(2),
                  "cast": torch.zeros(8), "reshaped": torch.zeros(4, 4),
                  "v": {"lr": 0.1, "nan": math.nan, "old": "x"}}, run="r", step=1)
        odd2 = odd.clone()
        odd2[4999] = 1.0
        s.commit({"w": _weights(1, 2048), "odd": odd2, "new": torch.ones(3, dtype=torch.int16),
                  "same": torch.ones(2), "cast": torch.zeros(8, dtype=torch.float64),
                  "reshaped": torch.zeros(2, 8), "v": {"lr": 0.2, "nan": math.nan, "fresh": None}},
                 run="r", step=2)
        d = s.diff("r@1", "r@2")
        changed = {c.path: c for c in d.changed}
        assert changed["w"].changed_bytes == 2 * CHUNK
        assert changed["odd"].changed_bytes == 20000 - 4 * CHUNK
        assert changed["cast"].changed_bytes == 64 and changed["cast"].dtype_before == "float32"
        assert changed["reshaped"].changed_bytes == 64
        assert changed["reshaped"].shape_after == (2, 8)
        assert [(c.path, c.changed_bytes) for c in d.added] == [("new", 6)]
        assert [(c.path, c.changed_bytes, c.nbytes_after) for c in d.removed] == [("gone", 28, 0)]
        assert d.unchanged == 1
        assert d.changed_bytes == 2 * CHUNK + 3616 + 64 + 64 + 6 + 28
        assert [(v.path, v.change, v.before, v.after) for v in d.values] == [
            ("v.fresh", "added", None, None), ("v.lr", "changed", 0.1, 0.2),
            ("v.old", "removed", "x", None)]
        same = s.diff("r@2", "r@2")
        assert (same.changed_bytes, same.values, same.unchanged) == (0, (), 6)
        assert s.ops.check().ok


# -- history --------------------------------------------------------------------------------


def test_history_lists_only_versions_where_the_tensor_changed(store: casckpt.Store) -> None:
    entries = store.history(RUN, "model.w")
    assert [(e.version.step, e.change, e.changed_bytes) for e in entries] == [
        (0, "added", 4 * CHUNK), (200, "changed", CHUNK), (400, "changed", 2 * CHUNK)]
    assert entries[1].version == store.resolve(f"{RUN}@200")
    assert (entries[0].dtype, entries[0].shape, entries[0].nbytes) == ("float32", (4096,), 4 * CHUNK)
    assert entries[1].version.tags == ("mid",)
    assert [e.version.step for e in store.history(RUN, "model.b")] == [0]


def test_history_reports_removal_and_return(store: casckpt.Store) -> None:
    entries = store.history(RUN, "model.extra")
    assert [(e.version.step, e.change, e.changed_bytes, e.nbytes) for e in entries] == [
        (100, "added", 40, 40), (200, "changed", 40, 40), (300, "removed", 40, 0),
        (400, "added", 40, 40)]
    assert entries[2].dtype is None and entries[2].digest is None


def test_history_of_unknown_path_or_run(store: casckpt.Store) -> None:
    with pytest.raises(TensorNotFoundError, match="model.w"):
        store.history(RUN, "model.ww")
    with pytest.raises(RefNotFoundError, match="base"):
        store.history("bas", "model.w")
    with pytest.raises(InvalidNameError):
        store.history("../x", "model.w")


# -- lineage --------------------------------------------------------------------------------


def test_fork_gives_the_first_commit_its_parent(store: casckpt.Store) -> None:
    point = store.resolve(f"{RUN}@200")
    run = store.fork(f"{RUN}@200", "ft")
    assert ("ft", 0, None) == (run.name, run.versions, run.latest_step)
    assert "ft" in [r.name for r in store.runs()]
    first = store.commit(_state(400), run="ft", step=0)
    second = store.commit(_state(400), run="ft", step=10)
    assert (first.parent, second.parent) == (point.id, first.id)
    assert store.resolve("ft@0").parent == point.id
    assert store.log("ft", order="asc")[0].parent == point.id
    untouched = store.commit(_state(0), run="fresh", step=0)
    assert untouched.parent is None


def test_fork_refuses_bad_names_refs_and_existing_runs(store: casckpt.Store) -> None:
    with pytest.raises(RunExistsError, match="already exists"):
        store.fork(f"{RUN}@0", RUN)
    with pytest.raises(InvalidNameError):
        store.fork(f"{RUN}@0", "a/b")
    with pytest.raises(RefNotFoundError):
        store.fork(f"{RUN}@7", "ft")
    assert [r.name for r in store.runs()] == [RUN]


def test_tree_nests_forks_depth_first(store: casckpt.Store) -> None:
    store.fork(f"{RUN}@100", "ft-b")
    store.fork(f"{RUN}@300", "ft-a")
    store.commit(_state(0), run="ft-a", step=1)
    store.fork("ft-a@1", "sweep-1")
    store.commit(_state(0), run="another", step=1)
    nodes = store.lineage()
    assert [n.name for n in nodes] == ["another", RUN, "ft-a", "sweep-1", "ft-b"]
    by = {n.name: n for n in nodes}
    assert by[RUN].children == ("ft-a", "ft-b")
    assert (by["sweep-1"].parent_run, by["sweep-1"].fork_step) == ("ft-a", 1)
    assert by["ft-b"].fork_version == store.resolve(f"{RUN}@100").id
    assert (by["ft-b"].versions, by["ft-a"].versions, by[RUN].versions) == (0, 1, 5)
    assert by["another"].parent_run is None and by["another"].fork_version is None


def test_best_by_metric(store: casckpt.Store) -> None:
    assert store.best(RUN, "loss").step == 300  # 200 and 300 tie at 3.0: the latest wins
    assert store.best(RUN, "loss", "max").step == 0
    assert store.best(RUN, "acc", mode="max").step == 300
    with pytest.raises(MetricNotFoundError, match="loss"):
        store.best(RUN, "los")
    with pytest.raises(InvalidArgumentError, match="mode"):
        store.best(RUN, "loss", "lowest")
    with pytest.raises(RefNotFoundError):
        store.best("nope", "loss")


# -- CLI ------------------------------------------------------------------------------------


@pytest.fixture
def store_path(tmp_path: Path) -> Iterator[Path]:
    """A filled store, closed, so each command opens it as a separate process would."""
    path = tmp_path / "store"
    with casckpt.open(path, chunk_size=CHUNK) as s:
        _fill(s)
    yield path
    with casckpt.open(path, create=False) as s:
        assert s.ops.check().ok


def cli(path: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--store", str(path), *args])


def test_cli_log_filters(store_path: Path) -> None:
    result = cli(store_path, "log", RUN, "--where", "loss<4", "-w", "metadata.flag==true",
                 "--min-step", "250", "--asc", "--json")
    assert result.exit_code == 0, result.output
    assert [v["step"] for v in json.loads(result.stdout)] == [300, 400]
    since = cli(store_path, "log", RUN, "--since", "1h", "--until", "2999-01-01", "--tag", "mid",
                "--json")
    assert since.exit_code == 0, since.output
    assert [v["step"] for v in json.loads(since.stdout)] == [200]
    table = cli(store_path, "log", RUN, "--where", "metadata.opt==adamw")
    assert table.exit_code == 0 and "adamw" not in table.stdout
    assert len([line for line in table.stdout.splitlines() if f" {RUN} " in line]) == 1
    assert cli(store_path, "log", RUN, "--where", "loss~1").exit_code == 2
    assert cli(store_path, "log", RUN, "--since", "someday").exit_code == 2
    assert cli(store_path, "log", "nope").exit_code == 3
    empty = cli(store_path, "log", RUN, "--max-step", "50", "--min-step", "60")
    assert empty.exit_code == 0 and empty.stdout == ""


def test_cli_diff_and_history(store_path: Path) -> None:
    text = cli(store_path, "diff", f"{RUN}@100", f"{RUN}@400")
    assert text.exit_code == 0, text.output
    assert "model.w" in text.stdout and "12.0 KiB" in text.stdout and "lr" in text.stdout
    data = json.loads(cli(store_path, "diff", f"{RUN}@100", f"{RUN}@400", "--json").stdout)
    assert data["changed_bytes"] == 3 * CHUNK + 40 and data["b"]["step"] == 400
    hist = cli(store_path, "history", RUN, "model.w", "--json")
    assert [(e["version"]["step"], e["changed_bytes"]) for e in json.loads(hist.stdout)] == [
        (0, 4 * CHUNK), (200, CHUNK), (400, 2 * CHUNK)]
    table = cli(store_path, "history", RUN, "model.extra")
    assert table.exit_code == 0 and "removed" in table.stdout
    assert cli(store_path, "history", RUN, "model.nope").exit_code == 3
    assert cli(store_path, "diff", f"{RUN}@100", f"{RUN}@999").exit_code == 3


def test_cli_fork_tree_best(store_path: Path) -> None:
    forked = cli(store_path, "fork", f"{RUN}@200", "ft", "--json")
    assert forked.exit_code == 0, forked.output
    data = json.loads(forked.stdout)
    assert data["name"] == "ft" and data["forked_from"]["step"] == 200
    assert cli(store_path, "fork", f"{RUN}@200", "ft").exit_code == 2
    tree = cli(store_path, "lineage")
    assert tree.exit_code == 0, tree.output
    assert "ft" in tree.stdout and f"forked from {RUN}@200" in tree.stdout
    assert tree.stdout.index(RUN) < tree.stdout.index("ft")
    nodes = json.loads(cli(store_path, "lineage", "--json").stdout)
    assert [(n["name"], n["children"]) for n in nodes] == [(RUN, ["ft"]), ("ft", [])]
    best = cli(store_path, "best", RUN, "--metric", "acc", "--max", "--json")
    assert best.exit_code == 0 and json.loads(best.stdout)["step"] == 300
    text = cli(store_path, "best", RUN, "-m", "loss")
    assert text.exit_code == 0 and "base@300" in text.stdout
    assert cli(store_path, "best", RUN, "-m", "nope").exit_code == 3


def test_tags_lists_each_tag_with_its_version_by_name(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        a = store.commit(_state(0), run="a", step=1)
        b = store.commit(_state(100), run="b", step=2)
        assert store.tags() == []
        store.tag("a@1", "zeta")
        store.tag("b@2", "alpha")
        store.tag("b@2", "mid")
        every = store.tags()
        assert [(t.name, t.version.id) for t in every] == [("alpha", b.id), ("mid", b.id), ("zeta", a.id)]
        assert every[0].version.tags == ("alpha", "mid")
        assert every[0].created_at.tzinfo is not None and every[0].created_at <= datetime.now(timezone.utc)
        assert [t.name for t in store.tags("a")] == ["zeta"]
        store.delete("a@1")
        assert [t.name for t in store.tags()] == ["alpha", "mid"]  # a deleted version's tags are hidden
        store.undelete(a.id)
        assert [t.name for t in store.tags("a")] == ["zeta"]
        with pytest.raises(RefNotFoundError):
            store.tags("c")
        assert store.ops.check().ok


def _changed(diff: casckpt.VersionDiff) -> tuple[list[str], int]:
    return sorted(c.path for c in diff.changed), diff.unchanged


def test_diff_sees_a_change_of_tensors_sharing_a_storage(tmp_path: Path) -> None:
    """Tensors sharing one storage (tied weights) are tree entries ``{"s": i}`` naming the
    document's shared extent i: equal JSON in two versions whatever the extent holds, so the
    tree walk of diff skipped them (versions whose only change is a tied pair even have one
    tree root) and reported them unchanged. Format-1 versions, right before, got the same
    wrong answer once migrated (the golden ``tied``: the same two states in format 1)."""
    with casckpt.open(tmp_path / "t") as store:
        store.commit(_tied(0), run="r", step=0)
        store.commit(_tied(2), run="r", step=2)
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
    with casckpt.open(legacy("tied", tmp_path / "old")) as store:
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
        assert store.ops.migrate_trees().versions_migrated == 2
        assert _changed(store.diff("r@0", "r@2")) == (["w", "wt"], 1)
