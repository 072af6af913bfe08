"""The ``lightning`` workload: Lightning checkpoints through casckpt against Lightning's own files.

A ``LightningModule`` wrapping the GPT-style decoder of :mod:`benchmarks.workloads` (width
and vocabulary grow with ``sqrt(scale)``; AdamW; next-token loss on random tokens) is
trained by a real ``lightning.pytorch.Trainer`` on CPU with
``ModelCheckpoint(every_n_train_steps=EVERY, save_top_k=-1)``: ``CHECKPOINTS`` checkpoints.
Two variants:

* ``full``: every parameter trains (every checkpoint changes every tensor);
* ``frozen``: only the head, final norm and the last blocks train (~15% of parameters, the
  ``frozen`` workload's choice); the frozen weights are saved unchanged every time.

Each variant is trained three times from the same seed, in the same directory, in this
order: with Lightning's default ``TorchCheckpointIO`` (``.ckpt`` files, each fsync'd after
Lightning wrote it, as the other baselines are), with ``CasckptCheckpointIO`` and with
``CasckptCheckpointIO(block=False)`` (a store of its own); the three must end equal.
Measured per variant:

* bytes: the ``.ckpt`` files on disk against what the store holds on disk after the same
  checkpoints (packs, manifests, catalog; the rebuildable index cache left out) and the
  versions' ``stored_bytes``;
* time per save: the ``CheckpointIO.save_checkpoint`` call (the dict Lightning builds is
  the same either way and not timed), mean over the checkpoints; torch.save's fsync
  included and also reported apart; with ``block=False`` the call returns after the
  snapshot (and after waiting for the previous checkpoint's commit, if still running);
* resume: ``load_checkpoint("casckpt://run@latest")`` (open store, every byte verified)
  against ``torch.load(weights_only=True)`` of the last ``.ckpt``, median of ``ROUNDS``
  alternating rounds in this process.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.workloads import Decoder, ModelConfig, _freeze_all_but_tail

Log = Callable[[str], None]
Kind = Literal["ratio", "fraction", "seconds", "mb_per_s"]

NAME = "lightning"
VARIANTS = ("full", "frozen")
CHECKPOINTS = 10
EVERY = 2  # optimizer steps between checkpoints
ROUNDS = 3
BATCH, SEQ = 2, 64
SEED = 0


@dataclass(frozen=True)
class VariantResult:
    """One variant: the default CheckpointIO's files and casckpt's store after the same checkpoints."""

    trainable_fraction: float
    checkpoints: int
    logical_bytes: int  # tensor bytes of one checkpoint dict
    ckpt_bytes: int  # the .ckpt files
    store_bytes: int  # the store directory without its index cache
    stored_bytes: int  # sum of the versions' stored_bytes
    default_save_s: list[float]  # TorchCheckpointIO.save_checkpoint, then fsync, per checkpoint
    fsync_s: list[float]  # the fsync part of the above
    casckpt_save_s: list[float]  # CasckptCheckpointIO.save_checkpoint per checkpoint
    background_save_s: list[float]  # the same with block=False: what training waits for
    torch_load_s: list[float]
    casckpt_load_s: list[float]
    verified: bool  # the last checkpoint loads back equal both ways


@dataclass(frozen=True)
class LightningResult:
    """Every raw number of the ``lightning`` workload."""

    name: str
    model: dict[str, int]
    every: int
    variants: dict[str, VariantResult]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def run_lightning(scale: float, workdir: Path, log: Log) -> LightningResult:
    """Train each variant with both CheckpointIOs under ``workdir``; see the module text."""
    import lightning.pytorch as L  # noqa: N812 - Lightning's own spelling

    L.seed_everything(SEED, verbose=False)
    cfg = ModelConfig.for_scale(scale)
    variants = {v: _variant(v, cfg, workdir / v, log) for v in VARIANTS}
    return LightningResult(NAME, dataclasses.asdict(cfg), EVERY, variants)


def _variant(variant: str, cfg: ModelConfig, workdir: Path, log: Log) -> VariantResult:
    from casckpt.integrations.lightning import CasckptCheckpointIO

    workdir.mkdir(parents=True)
    ckpts, store_dir = workdir / "ckpts", workdir / "store"
    default_s: list[float] = []
    fsync_s: list[float] = []
    first = _fit(variant, cfg, _timed_torch_io(default_s, fsync_s), ckpts, workdir)
    log(f"lightning {variant}: default CheckpointIO wrote {len(default_s)} .ckpt files")
    casckpt_s: list[float] = []
    with casckpt.open(store_dir) as store:
        second = _fit(variant, cfg, _timed_casckpt_io(store, variant, casckpt_s), workdir / "unused", workdir)
        log(f"lightning {variant}: casckpt committed {len(casckpt_s)} versions")
        versions = store.log(variant)
        (last_file,) = ckpts.glob(f"*-step={CHECKPOINTS * EVERY}.ckpt")
        torch_load_s: list[float] = []
        casckpt_load_s: list[float] = []
        loaded: dict[str, Any] = {}
        for _ in range(ROUNDS):
            measure.release_memory()
            loaded["file"], seconds = measure.timed(lambda: measure.torch_load(last_file))
            torch_load_s.append(seconds)
            measure.release_memory()
            reader = CasckptCheckpointIO(store, variant)
            loaded["store"], seconds = measure.timed(
                lambda: reader.load_checkpoint(f"casckpt://{variant}@latest"))  # noqa: B023
            casckpt_load_s.append(seconds)
    background_s: list[float] = []
    with casckpt.open(workdir / "store-background") as store:
        third = _fit(variant, cfg, _timed_casckpt_io(store, variant, background_s, block=False),
                     workdir / "unused", workdir)
        log(f"lightning {variant}: casckpt (block=False) committed {len(store.log(variant))} versions")
    if not measure.trees_equal(first, second) or not measure.trees_equal(first, third):
        raise RuntimeError(f"lightning {variant}: the two trainings diverged; the comparison is void")
    return VariantResult(
        trainable_fraction=second["trainable"], checkpoints=len(versions),
        logical_bytes=measure.logical_bytes(loaded["store"]),
        ckpt_bytes=sum(p.stat().st_size for p in ckpts.glob("*.ckpt")),
        store_bytes=measure.path_bytes(store_dir) - measure.path_bytes(store_dir / "cache"),
        stored_bytes=sum(v.stored_bytes for v in versions), default_save_s=default_s, fsync_s=fsync_s,
        casckpt_save_s=casckpt_s, background_save_s=background_s, torch_load_s=torch_load_s,
        casckpt_load_s=casckpt_load_s,
        verified=all(measure.trees_equal(loaded["file"][k], loaded["store"][k])
                     for k in ("state_dict", "optimizer_states")))


def _timed_torch_io(seconds: list[float], fsync_seconds: list[float]) -> Any:
    """Lightning's default CheckpointIO, each file fsync'd; appends each save's wall time."""
    from lightning.fabric.plugins import TorchCheckpointIO

    class TimedTorchIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            start = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            synced = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            seconds.append(time.perf_counter() - start)
            fsync_seconds.append(time.perf_counter() - synced)

    return TimedTorchIO()


def _timed_casckpt_io(store: Any, run: str, seconds: list[float], *, block: bool = True) -> Any:
    """CasckptCheckpointIO on ``store``; appends each save's wall time."""
    from casckpt.integrations.lightning import CasckptCheckpointIO

    class TimedCasckptIO(CasckptCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            start = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            seconds.append(time.perf_counter() - start)

    return TimedCasckptIO(store, run, block=block)


def _fit(variant: str, cfg: ModelConfig, io: Any, dirpath: Path, root: Path) -> dict[str, Any]:
    """Train ``CHECKPOINTS x EVERY`` steps with ``io``; the final weights and trainable share."""
    import lightning.pytorch as L  # noqa: N812
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(SEED, verbose=False)
    module = _module(variant, cfg)
    every = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=EVERY)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=CHECKPOINTS * EVERY, plugins=[io],
                        callbacks=[every], default_root_dir=root)
    tokens = torch.randint(cfg.vocab, (BATCH * CHECKPOINTS * EVERY, SEQ + 1),
                           generator=torch.Generator().manual_seed(SEED))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "few workers" and "small batch" hints
        trainer.fit(module, data)
    return {**{k: v.detach().clone() for k, v in module.state_dict().items()},
            "trainable": module.trainable_fraction}


def _module(variant: str, cfg: ModelConfig) -> Any:
    import lightning.pytorch as L  # noqa: N812

    class DecoderModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Decoder(cfg)
            params = _freeze_all_but_tail(self.model) if variant == "frozen" else list(self.parameters())
            self.params = params
            self.trainable_fraction = sum(p.numel() for p in params) / sum(
                p.numel() for p in self.parameters())

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.params, lr=1e-3)

    return DecoderModule()


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Kind
    compute: Callable[[LightningResult], float | None]


def _of(variant: str, fn: Callable[[VariantResult], float]) -> Callable[[LightningResult], float | None]:
    return lambda r: fn(r.variants[variant]) if variant in r.variants else None


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


MEASURES: tuple[Measure, ...] = tuple(m for v in VARIANTS for m in (
    Measure(f"{v}_store_of_ckpt", f"{v}: store on disk / the .ckpt files", "fraction",
            _of(v, lambda r: r.store_bytes / r.ckpt_bytes)),
    Measure(f"{v}_stored_of_ckpt", f"{v}: versions' stored bytes / the .ckpt files", "fraction",
            _of(v, lambda r: r.stored_bytes / r.ckpt_bytes)),
    Measure(f"{v}_save_vs_default", f"{v}: save with casckpt / default CheckpointIO (+fsync)", "ratio",
            _of(v, lambda r: _mean(r.casckpt_save_s) / _mean(r.default_save_s))),
    Measure(f"{v}_save_vs_default_nofsync", f"{v}: save with casckpt / default CheckpointIO, no fsync",
            "ratio", _of(v, lambda r: _mean(r.casckpt_save_s)
                         / (_mean(r.default_save_s) - _mean(r.fsync_s)))),
    Measure(f"{v}_background_save_vs_default", f"{v}: save with casckpt, block=False / default (+fsync)",
            "ratio", _of(v, lambda r: _mean(r.background_save_s) / _mean(r.default_save_s))),
    Measure(f"{v}_resume_vs_torch_load", f"{v}: load casckpt://run@latest / torch.load of the .ckpt",
            "ratio", _of(v, lambda r: statistics.median(r.casckpt_load_s)
                         / statistics.median(r.torch_load_s))),
))

TARGETS: dict[str, float] = {}  # BENCHMARKS.md sets none yet for framework checkpoints; reported only

NOTES = {
    "workload": f"GPT-style decoder in a LightningModule, AdamW, {CHECKPOINTS} checkpoints every "
    f"{EVERY} steps by ModelCheckpoint(save_top_k=-1), variants full and frozen (~15% trainable)",
    "bytes": "store on disk: packs, manifests and catalog (index cache left out); .ckpt: Lightning's "
    "TorchCheckpointIO files",
    "save": "the CheckpointIO.save_checkpoint call only (Lightning builds the same dict either way); "
    "the default's file is fsync'd after it is written (also reported without); block=False: the "
    "call returns once the state is snapshotted, after the previous commit finished",
    "resume": f"median of {ROUNDS}: load_checkpoint('casckpt://run@latest') vs torch.load(weights_only=True)",
}


def table(outcomes: dict[str, LightningResult]) -> Table:
    """The raw figures of each variant."""
    out = Table(title=f"lightning raw measurements ({CHECKPOINTS} checkpoints every {EVERY} steps)")
    for column in ("variant", "trainable", "logical", ".ckpt files", "store", "stored", "save default",
                   "of it fsync", "save casckpt", "block=False", "torch.load", "casckpt load", "verified"):
        out.add_column(column, justify="left" if column == "variant" else "right")
    for r in outcomes.values():
        for name, v in r.variants.items():
            out.add_row(name, f"{v.trainable_fraction:.0%}", measure.fmt_bytes(v.logical_bytes),
                        measure.fmt_bytes(v.ckpt_bytes), measure.fmt_bytes(v.store_bytes),
                        measure.fmt_bytes(v.stored_bytes), f"{_mean(v.default_save_s) * 1e3:.1f} ms",
                        f"{_mean(v.fsync_s) * 1e3:.1f} ms", f"{_mean(v.casckpt_save_s) * 1e3:.1f} ms",
                        f"{_mean(v.background_save_s) * 1e3:.1f} ms",
                        f"{statistics.median(v.torch_load_s) * 1e3:.1f} ms",
                        f"{statistics.median(v.casckpt_load_s) * 1e3:.1f} ms", str(v.verified))
    return out
