"""The ``import`` workload: a folder of existing ``.pt`` checkpoints imported one by one.

A stack of ``LAYERS`` square linear layers is fine-tuned with AdamW (small updates each step,
the first ``FROZEN`` layers frozen: no gradients, no optimizer state), saving ``CHECKPOINTS``
``torch.save`` files of ``{"model", "optimizer", "step"}`` as a training script does. Then, in
the same run: ``torch.load(weights_only=True)`` of every file (the baseline: what reading the
folder costs anyway), and ``Store.import_checkpoint`` of every file into a fresh store, in step
order. Reported: bytes of the files, logical bytes of the versions, bytes the store holds
(encoded chunks, and its packs), and import time over load time. ``--scale`` 1.0 is about
128 MiB of weights per checkpoint (the layers' width scales with its square root).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from rich.table import Table

import casckpt
from benchmarks import measure

Log = Callable[[str], None]

NAME = "import"
CHECKPOINTS = 10
LAYERS = 8
FROZEN = 6
WEIGHTS_AT_SCALE_1 = 32 * 1024 * 1024  # fp32 elements, 128 MiB


@dataclass(frozen=True)
class ImportResult:
    """Every raw number of the ``import`` workload."""

    name: str
    checkpoints: int
    width: int
    file_bytes: int
    logical_bytes: int
    stored_bytes: int
    pack_bytes: int
    load_s: float
    import_s: float
    restores_match: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _save_checkpoints(folder: Path, width: int) -> list[Path]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    for layer in list(model)[:FROZEN]:
        layer.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    files = []
    for step in range(1, CHECKPOINTS + 1):
        model(torch.randn(4, width)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        files.append(folder / f"step-{step:03d}.pt")
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, files[-1])
    return files


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_import(scale: float, workdir: Path, log: Log) -> ImportResult:
    """Save the checkpoints, then time loading and importing them (see the module doc)."""
    width = max(32, int(math.sqrt(WEIGHTS_AT_SCALE_1 * scale / LAYERS)))
    folder = workdir / "checkpoints"
    folder.mkdir()
    files = _save_checkpoints(folder, width)
    load_s = sum(_timed(lambda f=f: torch.load(f, map_location="cpu", weights_only=True)) for f in files)
    logical = 0
    with casckpt.open(workdir / "store") as store:
        start = time.perf_counter()
        for step, file in enumerate(files, start=1):
            logical += store.import_checkpoint(file, run="imported", step=step).logical_bytes
        import_s = time.perf_counter() - start
        stats = store.ops.stats()
        last = store.restore(f"imported@{CHECKPOINTS}")
    original = torch.load(files[-1], weights_only=True)
    match = all(torch.equal(last["model"][k], v) for k, v in original["model"].items())
    file_bytes = sum(f.stat().st_size for f in files)
    log(f"{NAME}: {CHECKPOINTS} files, {measure.fmt_bytes(file_bytes)}; import {import_s:.2f} s "
        f"(torch.load {load_s:.2f} s); stored {measure.fmt_bytes(stats.stored_bytes)}")
    return ImportResult(NAME, CHECKPOINTS, width, file_bytes, logical, stats.stored_bytes,
                        stats.pack_bytes, load_s, import_s, match)


Measure = tuple[str, str, Literal["ratio", "fraction"], Callable[[ImportResult], float | None]]
MEASURES: tuple[Measure, ...] = (
    ("import_vs_load", "import of every file / torch.load of every file", "ratio",
     lambda r: r.import_s / r.load_s),
    ("stored_of_logical", "stored bytes / logical bytes of the imported versions", "fraction",
     lambda r: r.stored_bytes / r.logical_bytes),
    ("stored_of_files", "stored bytes / bytes of the .pt files", "fraction",
     lambda r: r.stored_bytes / r.file_bytes),
)
NOTES = (f"see benchmarks/importing.py; {CHECKPOINTS} checkpoints of {LAYERS} linear layers, the first "
         f"{FROZEN} frozen, AdamW fine-tuning; times are single runs of the whole folder")


def raw_table(outcomes: Mapping[str, ImportResult]) -> Table:
    """The import workload's raw numbers."""
    table = Table(title="import: a folder of .pt checkpoints, imported one by one")
    for column in ("files", "file bytes", "logical", "stored", "packs", "torch.load", "import", "ok"):
        table.add_column(column, justify="right")
    for r in outcomes.values():
        table.add_row(str(r.checkpoints), measure.fmt_bytes(r.file_bytes), measure.fmt_bytes(r.logical_bytes),
                      measure.fmt_bytes(r.stored_bytes), measure.fmt_bytes(r.pack_bytes),
                      f"{r.load_s:.3f} s", f"{r.import_s:.3f} s", "yes" if r.restores_match else "[red]NO[/]")
    return table
