"""Resuming from a checkpoint reproduces an uninterrupted run bit for bit.

Also: ``restore(into=module)`` copies into the module's own tensors (no
reallocation), restoring into a fresh optimizer works, and ``restore(into=None)``
returns a tree equal to the committed one, container and value types included.

This file doubles as the script the fresh-process test runs:
``python tests/e2e/test_resume.py STORE REF OUT_DIR``, forked warm (the ``forked_python``
fixture): a separate process that shares no state with the test's.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

import casckpt

if TYPE_CHECKING:  # the script this file doubles as has no tests/ on its path
    from doubles import ForkedPython

STEPS, COMMIT_AT = 20, 10
# How the fresh process restores: "tree": restore(ref) then load_state_dict; "object":
# restore(ref, into=trainer); "parts": restore(ref, into={"model": module, "optimizer": opt, ...}).
MODES = ("tree", "object", "parts")
REPO_ROOT = Path(__file__).resolve().parents[2]


# --- a small, fully deterministic training loop ---------------------------------------------


class Trainer:
    """Model, AdamW, LR scheduler, torch RNG (dropout) and the data position."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 3)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=5, gamma=0.5)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "data": {"step": self.step},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = state["data"]["step"]

    def train_to(self, stop: int, on_step: Any = None) -> None:
        while self.step < stop:
            g = torch.Generator().manual_seed(1000 + self.step)  # batch addressed by position
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1
            if on_step is not None:
                on_step(self, loss.item())


def _resume_in_this_process(store_path: str, ref: str, out_dir: str) -> None:
    """Body of the fresh process: for each way of restoring, resume from ``ref``, train to
    STEPS, commit the result as run ``resumed-<mode>`` and torch.save it for the test."""
    with casckpt.open(store_path, create=False) as store:
        for mode in MODES:
            trainer = Trainer()
            if mode == "object":
                assert store.restore(ref, into=trainer) is trainer
            elif mode == "parts":
                parts = {
                    "model": trainer.model,
                    "optimizer": trainer.opt,
                    "scheduler": trainer.sched,
                    "rng": {"torch": torch.get_rng_state()},
                    "data": {"step": 0},
                }
                assert store.restore(ref, into=parts) is parts
                torch.set_rng_state(parts["rng"]["torch"])
                trainer.step = parts["data"]["step"]
            else:
                trainer.load_state_dict(store.restore(ref))
            assert trainer.step == COMMIT_AT
            trainer.train_to(STEPS)
            final = trainer.state_dict()
            store.commit(final, run=f"resumed-{mode}", step=STEPS)
            torch.save(final, Path(out_dir) / f"resumed-{mode}.pt")


def _child_env() -> dict[str, str]:
    path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


# --- comparison helpers -----------------------------------------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_tree(actual: Any, expected: Any, path: str = "<root>") -> None:
    """Same container types, key order, value types and values; tensors bit for bit."""
    if isinstance(expected, dict):  # an OrderedDict comes back as a dict, in the same order
        assert isinstance(actual, dict), f"{path}: {type(actual)} is not a dict"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}.{key}")
        return
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{path}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert _same_bits(actual, expected), f"{path}: tensors differ"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: arrays differ"
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    elif isinstance(expected, float):
        assert math.copysign(1.0, actual) == math.copysign(1.0, expected), path
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_optimizer_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, slots in expected["state"].items():
        for slot, tensor in slots.items():
            assert torch.equal(actual["state"][index][slot], tensor), f"state.{index}.{slot}"
    assert_same_tree(actual, expected)  # also param_groups: lr, betas, ...


def assert_training_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, param in expected["model"].items():
        assert torch.equal(actual["model"][name], param), f"model.{name} differs"
    assert_optimizer_state_equal(actual["optimizer"], expected["optimizer"])
    assert_same_tree(actual, expected)  # also scheduler, RNG, data position


# --- tests ------------------------------------------------------------------------------------


def test_resume_in_fresh_process_matches_uninterrupted_run(
        tmp_path: Path, forked_python: ForkedPython) -> None:
    store_path = tmp_path / "store"

    def commit(trainer: Trainer, loss: float) -> None:
        if trainer.step in (COMMIT_AT, STEPS):
            store.commit(
                trainer.state_dict(), run="train", step=trainer.step, metrics={"loss": loss}
            )

    # bit-identical training needs the same arithmetic here and in the forked process: one
    # thread in both, whatever thread count earlier tests left this worker with or the load
    # does to how a product is split between threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = Trainer()
        with casckpt.open(store_path) as store:
            reference.train_to(STEPS, on_step=commit)  # committing must not perturb training
    finally:
        torch.set_num_threads(threads)
    expected = reference.state_dict()

    proc = forked_python.run(
        [__file__, str(store_path), f"train@{COMMIT_AT}", str(tmp_path)],
        timeout=60,
        cwd=REPO_ROOT,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in MODES:
        resumed = torch.load(tmp_path / f"resumed-{mode}.pt", weights_only=True)
        assert_training_state_equal(resumed, expected)

    with casckpt.open(store_path, create=False) as store:
        for mode in MODES:
            # A bit-identical state holds no chunk the store did not already have.
            assert store.resolve(f"resumed-{mode}@{STEPS}").new_bytes == 0
            assert_same_tree(
                store.restore(f"resumed-{mode}@{STEPS}"), store.restore(f"train@{STEPS}")
            )
        assert store.ops.check().ok


def test_restore_into_module_copies_in_place(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train_to(3)
    model = trainer.model
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    with casckpt.open(tmp_path / "store") as store:
        store.commit(model.state_dict(), run="model", step=3)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.add_(1)
        params = {name: p.data_ptr() for name, p in model.named_parameters()}
        buffers = {name: b.data_ptr() for name, b in model.named_buffers()}

        assert store.restore("model@3", into=model) is model

        assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
        assert {name: b.data_ptr() for name, b in model.named_buffers()} == buffers
        assert_same_tree(model.state_dict(), committed)
        assert store.ops.check().ok


def test_restore_into_optimizer(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train_to(3)
    committed = trainer.opt.state_dict()
    expected = copy.deepcopy(committed)
    with casckpt.open(tmp_path / "store") as store:
        store.commit(committed, run="opt", step=3)
        trainer.train_to(5)  # move the live optimizer state away from the committed one

        assert store.restore("opt@3", into=trainer.opt) is trainer.opt
        assert_optimizer_state_equal(trainer.opt.state_dict(), expected)

        fresh = Trainer()  # a new optimizer with empty state, as after a restart
        assert store.restore("opt@3", into=fresh.opt) is fresh.opt
        assert_optimizer_state_equal(fresh.opt.state_dict(), expected)
        assert store.ops.check().ok


def test_restore_without_target_returns_equal_tree(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train_to(2)
    state = {
        "training": trainer.state_dict(),
        "mixed": {
            0: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            1: torch.ones(4, 4).t(),  # non-contiguous
            "halves": torch.full((3,), -0.0, dtype=torch.float16),
            "flags": torch.tensor([True, False]),
            "ints": np.arange(5, dtype=np.int64),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(7, dtype=torch.int32),
        },
        "plain": [None, True, 3, -0.0, float("nan"), float("inf"), "text", b"\x00\xff", (1, (2,))],
    }
    expected = copy.deepcopy(state)  # also catches a commit that mutates its input
    with casckpt.open(tmp_path / "store") as store:
        store.commit(state, run="tree", step=2)
        restored = store.restore("tree@2")
        assert_same_tree(restored, expected)
        assert isinstance(restored["mixed"]["ints"], np.ndarray)
        live = {t.data_ptr() for t in trainer.model.state_dict().values()}
        new = {t.data_ptr() for t in restored["training"]["model"].values()}
        assert not live & new, "restore(into=None) must return new tensors, not the live ones"
        assert store.ops.check().ok


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the test's own run (see there)
    _resume_in_this_process(*sys.argv[1:4])
