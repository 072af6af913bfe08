"""The run handle (``Store.run``): a training loop names its run once; each method is the
Store call it replaces, writing the same catalog rows."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import WriteHookStore

import casckpt
from casckpt.errors import InvalidArgumentError, InvalidNameError, RefNotFoundError


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.full((3,), float(step))},
            "step": step}


def test_a_run_handle_end_to_end(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        run = store.run("train", save_every=3, retention={"keep_last": 2}, redundancy="none",
                        delta_chain=0)
        assert (run.name, run.latest_step(), run.steps()) == ("train", None, [])
        assert run.retention == casckpt.RetentionPolicy(keep_last=2)
        assert (run.redundancy, run.delta_chain) == ("none", 0)
        saved = [step for step in range(10) if run.should_save(step) and run.save(_state(step), step)]
        assert saved == [0, 3, 6, 9] and run.steps() == saved and run.latest_step() == 9
        assert run.should_save(10, final=True) and not run.should_save(10)

        back = run.restore()
        assert torch.equal(back["model"]["w"], _state(9)["model"]["w"]) and back["step"] == 9
        into = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": 0}
        run.restore(3, into=into)
        assert torch.equal(into["model"]["b"], torch.full((3,), 3.0))
        assert torch.equal(run.load_tensor("model.w", 6), _state(6)["model"]["w"])
        assert [v.step for v in run.log(order="asc")] == saved
        assert sorted(h.version.step for h in run.history("model.b")) == saved

        handle = run.save(_state(12), 12, metrics={"loss": 0.5}, tags=["candidate"], block=False)
        handle.wait()
        assert run.best("loss").step == 12 and store.resolve("tag:candidate").step == 12

        fork = run.fork("sweep", at=6, save_every=1)
        assert fork.steps() == [] and fork.should_save(7)
        fork.save(_state(7), 7)
        assert store.resolve("sweep@7").parent == store.resolve("train@6").id

        run.delete(3)
        assert run.steps() == [0, 6, 9, 12]
        with pytest.raises(RefNotFoundError):
            run.restore(3)
        run.retention = casckpt.RetentionPolicy(keep_last=5, keep_best=("loss", 1, "min"))
        run.delta_chain = 2
        assert run.retention == casckpt.RetentionPolicy(keep_last=5, keep_best=("loss", 1, "min"))
        assert run.delta_chain == 2


class HeldBlobs(WriteHookStore):
    """A local blob store whose writes wait while ``gate`` is clear (``held``: one is waiting)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()

    def before_write(self, key: str) -> None:
        if not self.gate.is_set():
            self.held.set()
        assert self.gate.wait(60), f"the test never let {key} be written"


def test_steps_leaves_a_background_save_out_until_it_finishes_unless_asked(tmp_path: Path) -> None:
    blobs = HeldBlobs(tmp_path / "blobs")
    with casckpt.open(tmp_path / "s", blobs=blobs) as store:
        run, other = store.run("r"), store.run("r")
        run.save(_state(0), 0)
        blobs.gate.clear()
        try:
            handle = run.save(_state(1), 1, block=False)
            assert blobs.held.wait(60) and not handle.done()
            assert run.steps() == [0]  # not visible yet: documented
            assert run.steps(pending=True) == [0, 1]
            assert other.steps(pending=True) == [0]  # another handle's save is not its own
        finally:
            blobs.gate.set()
        handle.wait()
        assert run.steps() == run.steps(pending=True) == other.steps() == [0, 1]
        run.delete(1)
        assert run.steps(pending=True) == [0]  # a finished save is not pending any more


def _rows(root: Path) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        versions = db.execute(
            "SELECT r.name, v.step, p.step, v.state, v.logical_bytes, v.meta, v.metrics, v.message, "
            "v.tree_root, (SELECT group_concat(name) FROM tags WHERE version_id = v.id) "
            "FROM versions v JOIN runs r ON r.id = v.run_id LEFT JOIN versions p ON p.id = v.parent_id "
            "ORDER BY r.name, v.step").fetchall()
        runs = db.execute("SELECT name, retention, redundancy, delta_chain, "
                          "(SELECT step FROM versions WHERE id = parent_version) FROM runs "
                          "ORDER BY name").fetchall()
    return versions + runs


def test_a_run_handle_writes_the_rows_the_store_calls_write(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "a") as store:
        run = store.run("r", retention={"keep_last": 3}, delta_chain=1)
        for step in (1, 2, 3):
            run.save(_state(step), step, metrics={"loss": 1 / step}, metadata={"lr": 0.1},
                     message=f"step {step}", tags=[f"t{step}"])
        run.fork("f", at=2).save(_state(5), 5)
        run.delete(1)
    with casckpt.open(tmp_path / "b") as store:
        store.retention.set("r", keep_last=3)
        store.ops.set_delta_chain(1, run="r")
        for step in (1, 2, 3):
            store.commit(_state(step), run="r", step=step, metrics={"loss": 1 / step},
                         metadata={"lr": 0.1}, message=f"step {step}", tags=[f"t{step}"])
        store.fork("r@2", "f")
        store.commit(_state(5), run="f", step=5)
        store.delete("r@1")
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")


def test_should_save_by_steps_by_time_and_whichever_comes_first(tmp_path: Path) -> None:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with casckpt.open(tmp_path / "s") as store:
        by_time = store.run("time", save_every=timedelta(minutes=10))
        assert by_time.should_save(0, now=t0)  # the first save always
        by_time.save(_state(0), 0)
        saved_at = store.resolve("time@0").created_at
        assert not by_time.should_save(1, now=saved_at + timedelta(minutes=9))
        assert by_time.should_save(1, now=saved_at + timedelta(minutes=10))
        assert by_time.should_save(1, now=(saved_at + timedelta(hours=1)).timestamp())

        both = store.run("both", save_every=(100, timedelta(minutes=10)))
        both.save(_state(0), 0)
        at = store.resolve("both@0").created_at
        assert not both.should_save(50, now=at + timedelta(minutes=1))
        assert both.should_save(100, now=at + timedelta(minutes=1))  # the steps came first
        assert both.should_save(50, now=at + timedelta(minutes=11))  # the time came first

        always = store.run("always")
        assert all(always.should_save(s) for s in range(3))


def test_a_new_handle_on_a_resumed_run_keeps_its_rhythm(tmp_path: Path) -> None:
    """The last save is the run's latest version in the store when this handle saved none."""
    with casckpt.open(tmp_path / "s") as store:
        store.commit(_state(10), run="r", step=10)
    with casckpt.open(tmp_path / "s") as store:
        run = store.run("r", save_every=5)
        assert run.latest_step() == 10
        assert [s for s in range(11, 21) if run.should_save(s)] == [15, 16, 17, 18, 19, 20]
        run.save(_state(15), 15)
        assert [s for s in range(16, 21) if run.should_save(s)] == [20]


@pytest.mark.parametrize("every", [0, -5, True, 1.5, "10", timedelta(0), (5,), (5, 10),
                                   (0, timedelta(minutes=1)), (5, timedelta(seconds=-1))])
def test_a_bad_save_every_is_a_typed_error_naming_it(tmp_path: Path, every: object) -> None:
    with casckpt.open(tmp_path / "s") as store:
        with pytest.raises(InvalidArgumentError, match="save_every"):
            store.run("r", save_every=every)  # type: ignore[arg-type]
        assert store.runs() == []


def test_bad_names_and_policies_are_typed_errors(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        with pytest.raises(InvalidNameError):
            store.run("../escape")
        with pytest.raises(InvalidArgumentError, match="retention"):
            store.run("r", retention=["keep_last", 3])  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="unknown rule"):
            store.run("r", retention={"keep_newest": 3})
        with pytest.raises(InvalidArgumentError):
            store.run("r", retention={"keep_last": 0})
        with pytest.raises(InvalidArgumentError, match="step"):
            store.run("r").restore(1.5)  # type: ignore[arg-type]
