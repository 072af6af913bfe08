"""Hostile review of issue 18's framework integrations: ways to lose, miswrite or misresume.

Real transformers Trainer (2-layer GPT-2 from a config) and real Lightning, tiny and on CPU.
"""

from __future__ import annotations

import io
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_transformers import Tokens, checkpoints, gpt2, tree
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import casckpt
from casckpt.errors import CasckptError, CheckpointPathNotFoundError, VersionExistsError
from casckpt.integrations.transformers import CasckptCallback

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging  # noqa: E402
from test_lightning import model as lightning_model  # noqa: E402
from test_lightning import trainer as lightning_trainer  # noqa: E402

from casckpt.integrations.lightning import CasckptCheckpointIO  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_trainer(out: Path, callbacks: list[Any], **kwargs: Any) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, save_strategy="steps", save_steps=3, seed=1, data_seed=2,
        report_to=[], disable_tqdm=True, logging_steps=1, per_device_train_batch_size=4,
        learning_rate=1e-2, **kwargs)
    return Trainer(model=gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                   callbacks=callbacks)


class FirstIsBest(TrainerCallback):  # type: ignore[misc]
    """Adds metric ``eval_first`` = -step: the first evaluated checkpoint stays the best."""

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float],
                    **kwargs: Any) -> None:
        metrics["eval_first"] = -float(state.global_step)


class Rotated(TrainerCallback):  # type: ignore[misc]
    """Placed before CasckptCallback: its on_save runs after the Trainer's save_total_limit rotation."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 9:
            self.event.set()


def test_hf_save_total_limit_and_a_kept_best_never_rotate_away_an_uncommitted_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer keeps ``best_model_checkpoint`` besides the newest; with save_total_limit=2
    its rotation at the step-9 save deletes checkpoint-6, whose background commit (the newest
    at the step-6 save, so not waited for) may not have read it yet. Was: checkpoint-6 ended in
    neither place. The commit of step 6 is held until the rotation (or 3 s) to make it certain."""
    out, rotated = tmp_path / "out", Rotated()
    with casckpt.open(tmp_path / "store") as store:
        real = store.add_dir

        def add_dir(path: Any, **kwargs: Any) -> Any:
            if kwargs["step"] == 6:
                rotated.event.wait(3.0)
            return real(path, **kwargs)

        monkeypatch.setattr(store, "add_dir", add_dir)
        t = hf_trainer(out, [FirstIsBest(), rotated, CasckptCallback(store, run="ft", keep_local=1)],
                       max_steps=9, eval_strategy="steps", eval_steps=3, save_total_limit=2,
                       metric_for_best_model="first", greater_is_better=True)
        error = None
        try:
            t.train()
        except CasckptError as exc:
            error = exc
        assert t.state.best_model_checkpoint == str(out / "checkpoint-3")
        committed = {v.step for v in store.log("ft")}
        on_disk = {int(name.split("-")[1]) for name in checkpoints(out)}
        assert committed | on_disk == {3, 6, 9}, (committed, on_disk, error)
        assert error is None
        assert "checkpoint-3" in checkpoints(out)  # the best is never deleted


class Killed(BaseException):
    """The process dying (kill -9) at this point."""


class CrashWhilePruning(TrainerCallback):  # type: ignore[misc]
    """Before CasckptCallback: at the step-9 save the process "dies" once rmtree unlinked a file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != 9:
            return
        real = os.unlink

        def unlink(*a: Any, **k: Any) -> None:
            real(*a, **k)
            raise Killed("killed while deleting")

        self.monkeypatch.setattr(os, "unlink", unlink)


def test_hf_a_crash_while_pruning_leaves_no_half_deleted_checkpoint_to_resume_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_local=0, block=True deletes checkpoint-9 right after its commit; a kill part-way
    through rmtree left a ``checkpoint-9`` missing files, which ``resume_from_checkpoint=True``
    (``get_last_checkpoint``) then picks: a resume with, say, no optimizer state."""
    out = tmp_path / "out"
    with casckpt.open(tmp_path / "store") as store:
        t = hf_trainer(out, [CrashWhilePruning(monkeypatch),
                             CasckptCallback(store, run="ft", keep_local=0, block=True)], max_steps=9)
        with pytest.raises(Killed):
            t.train()
        monkeypatch.undo()
        assert {v.step for v in store.log("ft")} == {3, 6, 9}
        last = get_last_checkpoint(str(out))
        if last is not None:  # whatever the Trainer would resume from must be whole
            step = int(Path(last).name.split("-")[1])
            store.checkout(f"ft@{step}", tmp_path / "want")
            assert tree(Path(last)) == tree(tmp_path / "want")
        leftovers = list(out.glob(".checkpoint-*.casckpt-deleting"))
        assert leftovers  # the crash left the renamed directory half deleted
        t = hf_trainer(out, [CasckptCallback(store, run="ft2", keep_local=0, block=True)], max_steps=1)
        t.callback_handler.on_train_begin(t.args, t.state, t.control)  # the next training cleans up
        assert not any(p.exists() for p in leftovers)


@pytest.mark.parametrize("block", [False, True], ids=["background", "blocking"])
def test_hf_a_second_training_into_a_used_run_is_told_how_to_resume(tmp_path: Path, block: bool) -> None:
    """Was: the store's 'commit with another step, or fork a new run' (and, in the background,
    'fix the store and commit it with store.add_dir(...)', which fails the same way) one save
    late; nothing tells the user to resume or to pick a new run name."""
    with casckpt.open(tmp_path / "store") as store:
        hf_trainer(tmp_path / "first", [CasckptCallback(store, run="ft")], max_steps=3).train()
        again = tmp_path / "again"
        t = hf_trainer(again, [CasckptCallback(store, run="ft", block=block)], max_steps=6)
        with pytest.raises(VersionExistsError, match=r"checkout_for_resume.*run=<a new name>"):
            t.train()
        assert t.state.global_step == 3  # refused at the first save
        assert checkpoints(again) == ["checkpoint-3"]  # kept
        assert [v.step for v in store.log("ft")] == [3]


def test_hf_a_checkpoint_whose_commit_died_is_stored_when_training_resumes_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies while checkpoint-6 is being committed; the restarted job resumes from
    it (resume_from_checkpoint=True). Was: nothing ever committed checkpoint-6, and the
    Trainer's save_total_limit rotation deleted it at the step-12 save: in neither place."""
    out = tmp_path / "out"
    with casckpt.open(tmp_path / "store") as store:
        real = store.add_dir

        def dies_at_6(path: Any, **kwargs: Any) -> Any:
            if kwargs["step"] == 6:
                raise Killed("killed while committing checkpoint-6")
            return real(path, **kwargs)

        monkeypatch.setattr(store, "add_dir", dies_at_6)
        with pytest.raises(Killed):
            hf_trainer(out, [CasckptCallback(store, run="ft", keep_local=1)], max_steps=6).train()
        monkeypatch.undo()
        assert checkpoints(out) == ["checkpoint-6"] and [v.step for v in store.log("ft")] == [3]
        copy = tree(out / "checkpoint-6")

        t = hf_trainer(out, [CasckptCallback(store, run="ft", keep_local=1)], max_steps=12,
                       save_total_limit=2)
        t.train(resume_from_checkpoint=True)
        committed = {v.step for v in store.log("ft")}
        on_disk = {int(name.split("-")[1]) for name in checkpoints(out)}
        assert committed | on_disk == {3, 6, 9, 12}, (committed, on_disk)
        store.checkout("ft@6", tmp_path / "six")
        assert tree(tmp_path / "six") == copy


def torch_round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), where


def test_lightning_odd_checkpoint_dicts_round_trip_as_torch_save_gives_them(tmp_path: Path) -> None:
    """Shared storage, views, bf16, int keys, tuples, None, NaN, -0.0 held; a user dict whose one
    key is ``casckpt.pairs`` (the plugin's own escape key) came back as a different dict."""
    base = torch.arange(12, dtype=torch.float32)
    checkpoint = {
        "global_step": 1, "base": base, "view": base[2:6], "t": base.view(3, 4).t(),
        "bf16": torch.tensor([1.5, float("nan"), -0.0], dtype=torch.bfloat16),
        "ints": {1: "one", 2: None}, "tup": (1, 2.5, None, (float("nan"),)), "neg0": -0.0,
        "user": {"casckpt.pairs": [("k", 1)]}, "user2": {"casckpt.pairs": [["a/b", torch.ones(1)]]},
    }
    want = torch_round_trip(checkpoint)
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "r")
        plugin.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
        got = CasckptCheckpointIO(store, "r").load_checkpoint(tmp_path / "x.ckpt")
    same(want["user"], got["user"], "user")
    same(want["user2"], got["user2"], "user2")
    for key in want:
        if key not in ("t", "view"):  # torch.save keeps views' strides; the store packs them
            same(want[key], got[key], key)
        else:
            assert torch.equal(want[key], got[key]) and want[key].dtype == got[key].dtype


def test_lightning_a_same_step_save_with_other_weights_is_not_silently_the_old_ones(
        tmp_path: Path) -> None:
    """Was: a later save at a step the plugin already committed only tagged that version;
    StochasticWeightAveraging swaps the averaged weights in at train end without a step, so
    ``trainer.save_checkpoint('swa.ckpt')`` silently loaded the pre-SWA weights. Now refused
    (the path names nothing); unchanged same-step saves (last.ckpt) still just name it."""
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "swa")
        m = lightning_model()
        t = lightning_trainer(plugin, tmp_path, ModelCheckpoint(dirpath=tmp_path / "ckpts"),
                              StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), max_epochs=3)
        t.fit(m)
        averaged = m.state_dict()["lin.weight"].clone()
        assert not torch.equal(m.saved[t.global_step]["lin.weight"], averaged)  # SWA moved them
        with pytest.raises(VersionExistsError, match=r"other weights.*StochasticWeightAveraging"):
            t.save_checkpoint(tmp_path / "swa.ckpt")  # Lightning's way to keep the SWA weights
        with pytest.raises(CheckpointPathNotFoundError):
            plugin.load_checkpoint(tmp_path / "swa.ckpt")
        assert [v.step for v in store.log("swa")] == [t.global_step]
        # a fresh plugin (a resumed process) re-saving the unchanged state at that step: fine
        again = CasckptCheckpointIO(store, "swa")
        loaded = again.load_checkpoint(f"casckpt://swa@{t.global_step}")
        again.save_checkpoint(loaded, tmp_path / "last.ckpt")
        assert len(store.resolve(f"swa@{t.global_step}").tags) == 2
