"""The ``hf`` workload: a Hugging Face ``Trainer`` fine-tune saving 10 checkpoints, with and
without :class:`casckpt.integrations.transformers.CasckptCallback` (issue 18).

A GPT-2-style model built from a config (random init, nothing downloaded; untied head;
``n_embd`` sized so that a full fine-tune's ``checkpoint-N`` directory, weights + AdamW
moments, is about ``scale`` GiB) trains on CPU on random tokens, saving every ``EVERY`` steps,
10 saves, in three variants:

* **full**: every parameter trains (each checkpoint: model.safetensors + optimizer.pt + ...);
* **frozen**: the backbone is frozen, only the LM head trains (the model file still holds every
  weight; the unchanged ones dedup);
* **lora**: a peft LoRA adapter (r=8 on ``c_attn``) trains; checkpoints hold the adapter only.

Each variant trains twice in the same process from the same seeds: once plain (the Trainer's
own saves, every directory kept) and once with the callback (``block=False, keep_local=1``)
on a fresh SQLite store. Measured:

* bytes of the 10 ``checkpoint-N`` directories (plain run) vs bytes the store holds after
  the callback's 10 commits (``StoreStats.pack_bytes``: packs in full; catalog not counted);
* time per save: from the step's ``on_step_end`` to the end of ``on_save`` (the Trainer's
  writes, plus the callback's: handing the directory to its commit thread, and pruning, which
  waits for the previous directory's commit with ``keep_local=1``), median of the 10
  saves, with vs without the callback; plus the wait at ``on_train_end`` for pending commits;
* ``checkout_for_resume`` of the last version vs ``shutil.copytree`` of the plain run's last
  checkpoint directory (medians of ``REPEATS``, each into a fresh directory); the checkout is
  compared byte for byte with the callback run's last directory (kept by ``keep_local=1``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from rich.table import Table

import casckpt
from benchmarks import measure

Log = Callable[[str], None]

NAME = "hf"
VARIANTS = ("full", "frozen", "lora")
SAVES = 10
EVERY = 2
REPEATS = 3
N_LAYER, N_HEAD, VOCAB, SEQ, BATCH = 4, 4, 4096, 32, 2


@dataclass(frozen=True)
class HfVariant:
    """Raw numbers of one variant (seconds, bytes)."""

    variant: str
    params: int
    trainable: int
    dir_bytes: int  # the 10 checkpoint-N directories of the plain run
    stored_bytes: int  # StoreStats.pack_bytes after the callback's 10 commits
    save_s: list[float]  # each save, plain
    save_callback_s: list[float]  # each save, with the callback
    end_wait_s: float  # on_train_end: pending commits waited for, directories pruned
    checkout_s: float
    copytree_s: float
    checkout_matches: bool


@dataclass(frozen=True)
class HfResult:
    """Every raw number of the ``hf`` workload."""

    name: str
    n_embd: int
    variants: list[HfVariant]

    def to_dict(self) -> dict[str, Any]:
        """Every raw number, for the JSON results file."""
        return dataclasses.asdict(self)

    def variant(self, name: str) -> HfVariant | None:
        """The named variant's numbers, if it ran."""
        return next((v for v in self.variants if v.variant == name), None)


def n_embd_for(scale: float) -> int:
    """The width whose full fine-tune checkpoint (fp32 weights + 2 AdamW moments) is ~scale GiB."""
    target_params = scale * (1 << 30) / (3 * 4)
    per_width = 2 * VOCAB + SEQ  # embeddings + untied head, linear in the width
    # 12 * n_layer * e^2 + per_width * e = target_params
    a, b = 12 * N_LAYER, per_width
    width = (-b + (b * b + 4 * a * target_params) ** 0.5) / (2 * a)
    return max(N_HEAD * 8, int(width) // (N_HEAD * 8) * (N_HEAD * 8))


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(variant: str, n_embd: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=N_LAYER, n_head=N_HEAD, n_embd=n_embd, vocab_size=VOCAB,
                                       n_positions=SEQ, tie_word_embeddings=False, bos_token_id=0,
                                       eos_token_id=0))
    if variant == "frozen":
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("lm_head."))
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                task_type="CAUSAL_LM"))
    return model


def _save_timer() -> Any:
    """A callback timing each save: from on_step_end of a saving step to its (last) on_save."""
    from transformers import TrainerCallback

    class SaveTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.started = 0.0
            self.saves: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.saves.append(time.perf_counter() - self.started)

    return SaveTimer()


def _train(variant: str, n_embd: int, out: Path, callbacks: list[Any]) -> Any:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, save_strategy="steps", save_steps=EVERY,
        max_steps=SAVES * EVERY, seed=1, data_seed=2, report_to=[], disable_tqdm=True,
        logging_steps=EVERY, per_device_train_batch_size=BATCH, learning_rate=1e-3,
    )
    timer = _save_timer()
    trainer = Trainer(model=_model(variant, n_embd), args=args, train_dataset=_Tokens(BATCH * SAVES * EVERY),
                      callbacks=[*callbacks, timer])  # the timer last: its on_save ends the save
    trainer.remove_callback(PrinterCallback)  # no log lines on stdout
    trainer.train()
    return trainer, timer.saves


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _variant(variant: str, n_embd: int, workdir: Path, log: Log) -> HfVariant:
    from casckpt.integrations.transformers import CasckptCallback, checkout_for_resume

    plain_out = workdir / f"{variant}-plain"
    trainer, save_s = _train(variant, n_embd, plain_out, [])
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    dirs = sorted(plain_out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    dir_bytes = sum(_dir_bytes(d) for d in dirs)
    del trainer
    measure.release_memory()

    out = workdir / f"{variant}-casckpt"
    with casckpt.open(workdir / f"{variant}-store") as store:
        callback = CasckptCallback(store, run=variant, keep_local=1, block=False)
        end = _EndClock(callback)
        trainer, save_callback_s = _train(variant, n_embd, out, [end])
        del trainer
        measure.release_memory()
        stored = store.ops.stats().pack_bytes
        last = store.resolve(f"{variant}@latest")
        checkouts, copies = [], []
        for i in range(REPEATS):
            target = workdir / f"{variant}-checkout-{i}"
            path, seconds = measure.timed(lambda t=target: checkout_for_resume(store, last, t))
            checkouts.append(seconds)
            if i == 0:
                matches = _tree(Path(path)) == _tree(out / f"checkpoint-{last.step}")
            shutil.rmtree(target)
            copy = workdir / f"{variant}-copy-{i}"
            _, seconds = measure.timed(lambda c=copy: shutil.copytree(dirs[-1], c / dirs[-1].name))
            copies.append(seconds)
            shutil.rmtree(copy)
    log(f"hf {variant}: {len(dirs)} checkpoint dirs {measure.fmt_bytes(dir_bytes)}, "
        f"stored {measure.fmt_bytes(stored)}")
    return HfVariant(variant, params, trainable, dir_bytes, stored, save_s, save_callback_s,
                     end.seconds, statistics.median(checkouts), statistics.median(copies), matches)


class _EndClock:
    """Wraps the callback: forwards every event, timing ``on_train_end`` (the pending commits'
    wait and the last pruning)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on_train_end(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.on_train_end(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - started


def run_hf(scale: float, workdir: Path, log: Log) -> HfResult:
    """Run the three variants at ``scale`` (1.0: a ~1 GiB full fine-tune checkpoint)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars, one per save
    n_embd = n_embd_for(scale)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    log(f"hf: GPT-2 n_layer={N_LAYER} n_embd={n_embd} vocab={VOCAB}, {SAVES} saves every {EVERY} steps")
    variants = [_variant(v, n_embd, workdir, log) for v in VARIANTS]
    return HfResult(NAME, n_embd, variants)


Kind = Literal["ratio", "fraction", "seconds", "mb_per_s"]


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Kind
    compute: Callable[[HfResult], float | None]


def _of(variant: str, figure: Callable[[HfVariant], float]) -> Callable[[HfResult], float | None]:
    def compute(r: HfResult) -> float | None:
        v = r.variant(variant)
        return None if v is None else figure(v)
    return compute


MEASURES: tuple[Measure, ...] = tuple(m for v in VARIANTS for m in (
    Measure(f"{v}_stored_of_dirs", f"{v}: stored bytes / bytes of the 10 checkpoint dirs", "fraction",
            _of(v, lambda x: x.stored_bytes / x.dir_bytes)),
    Measure(f"{v}_save_callback_vs_plain", f"{v}: time per save, with callback / without", "ratio",
            _of(v, lambda x: statistics.median(x.save_callback_s) / statistics.median(x.save_s))),
    Measure(f"{v}_checkout_vs_copytree", f"{v}: checkout_for_resume / shutil.copytree", "ratio",
            _of(v, lambda x: x.checkout_s / x.copytree_s)),
))

TARGETS: dict[str, float] = {}  # BENCHMARKS.md names the figures, not limits

NOTES = {
    "model": "GPT-2 from a config (random init), n_layer=4, n_head=4, vocab 4096, untied head, "
    "n_embd sized so a full fine-tune checkpoint (weights + AdamW moments) is ~scale GiB; "
    "batch 2 x 32 random tokens, CPU, 10 saves every 2 steps",
    "stored": "StoreStats.pack_bytes (packs in full) after the callback's 10 commits vs the sum of "
    "file sizes of the plain run's 10 checkpoint-N directories",
    "save": "from on_step_end of a saving step to the end of its on_save (Trainer writes + the "
    "callback's hand-off to its commit thread and pruning with keep_local=1, which waits for the "
    "previous save's commit), median of 10 saves; the "
    "callback's wait at on_train_end is reported raw (end_wait_s)",
    "checkout": "checkout_for_resume of the last version vs shutil.copytree of the plain run's "
    "last checkpoint directory, medians of 3, each into a fresh directory",
}


def raw_table(outcomes: Mapping[str, HfResult]) -> Table:
    """The hf workload's raw figures."""
    table = Table(title=f"hf: Trainer fine-tune, {SAVES} saves (medians)")
    for column in ("variant", "params", "trainable", "ckpt dirs", "stored", "save", "save+callback",
                   "end wait", "checkout", "copytree", "ok"):
        table.add_column(column, justify="left" if column == "variant" else "right")

    def ms(s: float) -> str:
        return f"{s * 1000:.1f} ms"

    for r in outcomes.values():
        for v in r.variants:
            table.add_row(v.variant, f"{v.params:,}", f"{v.trainable:,}", measure.fmt_bytes(v.dir_bytes),
                          measure.fmt_bytes(v.stored_bytes), ms(statistics.median(v.save_s)),
                          ms(statistics.median(v.save_callback_s)), ms(v.end_wait_s), ms(v.checkout_s),
                          ms(v.copytree_s), "yes" if v.checkout_matches else "[red]NO[/]")
    return table
