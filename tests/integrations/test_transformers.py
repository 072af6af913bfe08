"""The Hugging Face Trainer integration, on a real ``transformers.Trainer`` (and real peft).

A 2-layer GPT-2 built from a config (random init, nothing downloaded) trains on a tiny
synthetic dataset on CPU, on one thread; every run takes about a second.

- Resume through the callback: a run interrupted after its step-6 save, its whole output
  directory deleted, checked out from the store and resumed, ends bit for bit where an
  uninterrupted run ends: weights, optimizer state, the CPU RNG states (torch, numpy, Python)
  and the bytes of the final checkpoint's model, optimizer, scheduler and RNG files. On CPU
  the Trainer is deterministic here, so the comparison is bitwise (``torch.equal``).
- ``keep_local`` is honoured (checkpoint directories counted on disk after each save and at
  the end) and every committed version checks out byte-identical to a copy of what the
  Trainer wrote, taken at save time; a ``save_total_limit`` that could race a background
  commit is refused before training.
- peft/LoRA: adapter-only checkpoints commit and resume, bitwise again.
- The default run name comes from ``run_name`` / ``output_dir`` made a valid run name; metrics
  are the finite numbers logged up to the save's step, the latest of each.
- A background commit that fails surfaces from ``trainer.train()`` as CheckpointCommitError
  and the checkpoint directory it was storing stays on disk, byte-identical.
- The README's resume line on the same host: a training SIGKILLed between two saves (after
  the second one's commit) leaves ``checkpoint-6`` in ``output_dir``; the same line that
  returned None on the first launch reuses it once every file verifies against the store's
  digests (or, one byte flipped, moves it aside and checks the version out afresh), and the
  resumed training ends bit for bit where an uninterrupted one does.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from doubles import ForkedPython, WriteHookStore
from peft import LoraConfig, get_peft_model
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

import casckpt
from casckpt.errors import (
    CasckptError,
    CheckoutTargetError,
    CheckpointCommitError,
    InvalidArgumentError,
    NotADirectorySnapshotError,
    RefNotFoundError,
    StorageError,
    VersionExistsError,
)
from casckpt.integrations.transformers import CasckptCallback, checkout_for_resume, metrics_at, run_name_for

STEPS, EVERY = 9, 3


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 random sequences of 16 tokens, the same every time."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(lora: bool = False) -> torch.nn.Module:
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
    if lora:
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                task_type="CAUSAL_LM"))
    return model


def trainer(out: Path, callbacks: list[Any], *, lora: bool = False, steps: int = STEPS,
            every: int = EVERY, **kwargs: Any) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, save_strategy="steps", save_steps=every, max_steps=steps,
        seed=1, data_seed=2, report_to=[], disable_tqdm=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-2, **kwargs,
    )
    return Trainer(model=gpt2(lora), args=args, train_dataset=Tokens(), callbacks=callbacks)


class StopAt(TrainerCallback):  # type: ignore[misc]
    """Interrupt training after ``step`` (its save still happens): the run a crash cuts short."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class Witness(TrainerCallback):  # type: ignore[misc]
    """Copies each checkpoint directory at save time (placed before CasckptCallback) or counts
    the checkpoint directories left on disk after each save (placed after it)."""

    def __init__(self, copies: Path | None = None) -> None:
        self.copies = copies
        self.counts: list[int] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.copies is not None:
            name = f"checkpoint-{state.global_step}"
            shutil.copytree(Path(args.output_dir) / name, self.copies / name)
        else:
            self.counts.append(len(checkpoints(Path(args.output_dir))))


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*")) if out.exists() else []


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: relative path -> (bytes, permission bits)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


def final_state(t: Trainer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in t.model.state_dict().items()},
            "optim": t.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(), "python_rng": random.getstate()}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for pid in sa:
        assert sa[pid].keys() == sb[pid].keys()
        for name, value in sa[pid].items():
            same = torch.equal(value, sb[pid][name]) if torch.is_tensor(value) else value == sb[pid][name]
            assert same, (pid, name)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["python_rng"] == b["python_rng"]
    na, nb = a["numpy_rng"], b["numpy_rng"]
    assert na[0] == nb[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """A 2-layer model trains fastest on one thread (several only contend on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store") as opened:
        yield opened
        opened.ops.check()


STATE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_from_the_store_matches_an_uninterrupted_run(
        store: casckpt.Store, tmp_path: Path, lora: bool) -> None:
    reference = trainer(tmp_path / "reference", [], lora=lora)
    reference.train()
    expected = final_state(reference)

    out = tmp_path / "out"
    cut = trainer(out, [StopAt(6), CasckptCallback(store, run="ft", keep_local=1)], lora=lora)
    cut.train()
    assert [v.step for v in store.log("ft")] == [6, 3]
    shutil.rmtree(out)  # the machine is gone; only the store remains

    path = checkout_for_resume(store, "ft@latest", out)
    assert path == str(out / "checkpoint-6")
    files = set(os.listdir(path))
    if lora:  # peft saves the adapter only
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files
        assert "model.safetensors" not in files
    resumed = trainer(out, [CasckptCallback(store, run="ft", keep_local=1)], lora=lora)
    resumed.train(resume_from_checkpoint=path)

    assert_same_state(final_state(resumed), expected)
    model_file = "adapter_model.safetensors" if lora else "model.safetensors"
    want = tree(tmp_path / "reference" / "checkpoint-9")
    got = tree(out / "checkpoint-9")
    for name in (model_file, *STATE_FILES[1:]):
        assert got[name] == want[name], name
    assert [v.step for v in store.log("ft")] == [9, 6, 3]
    again = tmp_path / "again"
    assert tree(Path(checkout_for_resume(store, "ft@9", again))) == got


@pytest.mark.parametrize(("keep_local", "block"), [(0, False), (1, False), (2, True)])
def test_keep_local_and_every_version_checks_out_as_written(
        store: casckpt.Store, tmp_path: Path, keep_local: int, block: bool) -> None:
    copies, out = tmp_path / "copies", tmp_path / "out"
    counter = Witness()
    t = trainer(out, [Witness(copies), CasckptCallback(store, keep_local=keep_local, block=block),
                      counter])
    t.train()

    # the newest directory's background commit is not waited for at its own save
    bound = keep_local + (0 if block or keep_local else 1)
    for saves, count in enumerate(counter.counts, start=1):  # a background commit may finish early
        assert min(saves, keep_local) <= count <= min(saves, bound)
    assert len(counter.counts) == STEPS // EVERY
    assert len(checkpoints(out)) == keep_local  # on_train_end waited, then pruned
    assert checkpoints(out) == sorted(f"checkpoint-{s}" for s in (3, 6, 9)[3 - keep_local:])

    versions = store.log("out")  # the run is named after output_dir
    assert [v.step for v in versions] == [9, 6, 3]
    for version in versions:
        name = f"checkpoint-{version.step}"
        assert version.metadata["checkpoint"] == name
        assert version.metadata["transformers"] == transformers.__version__
        assert version.metrics["loss"] == metrics_at(t.state.log_history, version.step)["loss"]
        target = tmp_path / "checkout" / name
        assert tree(Path(checkout_for_resume(store, version, target.parent))) == tree(copies / name)
    again = checkout_for_resume(store, versions[0], tmp_path / "checkout")  # verified, reused
    assert again == str(tmp_path / "checkout" / "checkpoint-9")
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "checkpoint-9").write_bytes(b"x")
    with pytest.raises(CheckoutTargetError, match="not a directory"):
        checkout_for_resume(store, versions[0], tmp_path / "file")
    store.commit({"w": torch.zeros(2)}, run="state", step=0)
    with pytest.raises(NotADirectorySnapshotError):
        checkout_for_resume(store, "state@0", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()


def test_a_save_total_limit_that_races_background_commits_is_refused(
        store: casckpt.Store, tmp_path: Path) -> None:
    t = trainer(tmp_path / "out", [CasckptCallback(store, run="ft", keep_local=1)], save_total_limit=1)
    with pytest.raises(InvalidArgumentError, match="save_total_limit"):
        t.train()
    assert not store.log()
    with pytest.raises(InvalidArgumentError, match="keep_local"):
        CasckptCallback(store, keep_local=-1)


def test_run_names_and_metrics_from_the_trainer(tmp_path: Path) -> None:
    def args(**kwargs: Any) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path / "my out"), report_to=[], use_cpu=True, **kwargs)

    assert run_name_for(args()) == "my-out"
    assert run_name_for(args(run_name="sweep/#3 lr=1e-4")) == "sweep-3-lr-1e-4"
    assert run_name_for(args(run_name="..")) == "my-out"
    history = [{"loss": 2.0, "epoch": 0.5, "step": 1}, {"loss": float("nan"), "step": 2},
               {"eval_loss": 1.5, "eval_runtime": 0.1, "step": 2}, {"loss": 1.0, "step": 3},
               {"train_runtime": 3.0, "total_flos": 7, "flag": True, "note": "x", "step": 3}]
    assert metrics_at(history, 2) == {"loss": 2.0, "epoch": 0.5, "eval_loss": 1.5, "eval_runtime": 0.1}
    assert metrics_at(history, 3)["loss"] == 1.0 and "flag" not in metrics_at(history, 3)


class NoSpace(WriteHookStore):
    """A local blob store whose every write fails with ENOSPC."""

    def before_write(self, key: str) -> None:
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise StorageError(f"cannot write {key}: {cause}") from cause


def test_a_failed_background_commit_surfaces_and_keeps_its_directory(tmp_path: Path) -> None:
    copies, out = tmp_path / "copies", tmp_path / "out"
    with casckpt.open(tmp_path / "store", blobs=NoSpace(tmp_path / "blobs")) as broken:
        t = trainer(out, [Witness(copies), CasckptCallback(broken, run="ft", keep_local=0)])
        with pytest.raises(CheckpointCommitError, match="checkpoint-3") as caught:
            t.train()  # raised by the next save, at step 6: training stops there
        assert isinstance(caught.value.__cause__, StorageError)
        assert t.state.global_step == 2 * EVERY
        assert checkpoints(out) == ["checkpoint-3", "checkpoint-6"]
        for name in checkpoints(out):
            assert tree(out / name) == tree(copies / name)
        assert not broken.log()


KILLED_BETWEEN_SAVES = """
import os, signal, sys, time
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # the test module, and tests/ for doubles
import torch
torch.set_num_threads(1)
import casckpt
from casckpt.errors import RefNotFoundError
from casckpt.integrations.transformers import CasckptCallback, checkout_for_resume
from test_transformers import trainer
from transformers import TrainerCallback

store = casckpt.open(sys.argv[2], create=False)
out = sys.argv[3]
path = checkout_for_resume(store, "ft@latest", out)  # the README's line, on the first launch
print("first launch resumes from", path, flush=True)


class KillAfterSecondSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step < 6:
            return
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the background commit of this save is visible
            try:
                store.resolve("ft@6")
                break
            except RefNotFoundError:
                time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


trainer(out, [CasckptCallback(store, run="ft", keep_local=1), KillAfterSecondSave()]).train(
    resume_from_checkpoint=path)
"""


@pytest.mark.parametrize("tamper", [False, True], ids=["reused", "tampered"])
def test_the_resume_line_after_a_kill_between_saves_on_the_same_output_dir(
        store: casckpt.Store, tmp_path: Path, tamper: bool, forked_python: ForkedPython) -> None:
    reference = trainer(tmp_path / "reference", [])
    reference.train()
    expected = final_state(reference)

    out = tmp_path / "out"
    killed = forked_python.run(["-c", KILLED_BETWEEN_SAVES, str(Path(__file__).parent), str(store.path),
                                str(out)], timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "first launch resumes from None" in killed.stdout
    assert [v.step for v in store.log("ft")] == [6, 3]
    assert checkpoints(out) == ["checkpoint-6"]  # keep_local=1 left it: the usual restart
    local = out / "checkpoint-6"
    stored = tree(local)
    inode = (local / "model.safetensors").stat().st_ino
    if tamper:
        with open(local / "model.safetensors", "r+b") as f:  # same size, one byte flipped
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))

    path = checkout_for_resume(store, "ft@latest", out)  # the same line, on the restart

    assert path == str(local)
    assert tree(local) == stored  # the version's bytes, whichever copy holds them
    aside = out / ".checkpoint-6.casckpt-differs"
    if tamper:  # checked out afresh; the differing copy kept aside, not deleted
        assert (local / "model.safetensors").stat().st_ino != inode
        assert tree(aside)["model.safetensors"][0] != stored["model.safetensors"][0]
    else:  # verified and reused, not written again
        assert (local / "model.safetensors").stat().st_ino == inode
        assert not aside.exists()
    resumed = trainer(out, [CasckptCallback(store, run="ft", keep_local=1)])
    resumed.train(resume_from_checkpoint=path)
    assert_same_state(final_state(resumed), expected)
    assert [v.step for v in store.log("ft")] == [9, 6, 3]


def test_the_resume_line_starts_fresh_only_on_a_first_launch(store: casckpt.Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert checkout_for_resume(store, "ft@latest", out) is None  # no such run yet
    assert not out.exists()
    trainer(out, [StopAt(3), CasckptCallback(store, run="ft", keep_local=0)]).train()
    with pytest.raises(RefNotFoundError, match="no version at step 5"):
        checkout_for_resume(store, "ft@5", out)  # a step must be there
    with pytest.raises(RefNotFoundError, match="no tag"):
        checkout_for_resume(store, "tag:nope", out)
    store.fork("ft@3", "child")  # a fork starts from its fork point, never from scratch
    with pytest.raises(RefNotFoundError, match="forked from ft@3"):
        checkout_for_resume(store, "child@latest", out)
    assert checkout_for_resume(store, "ft@latest", out) == str(out / "checkpoint-3")


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
