"""Directory snapshots of real Lightning output: the ``.ckpt`` files Lightning's own
CheckpointIO writes (torch.save zip archives) round-trip byte for byte through
``add_dir`` / ``checkout``, and a later checkpoint of a frozen backbone writes only what
training changed (each zip entry is cut on its own, so the frozen weights dedup).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import casckpt  # noqa: E402

WIDTH = 256  # the frozen backbone: WIDTH x WIDTH fp32 = 256 KiB, far more than what trains


class FrozenBackbone(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(WIDTH, WIDTH)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.head(self.backbone(x)) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                           batch_size=8)


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_lightning_ckpt_files_round_trip_and_a_frozen_backbone_dedups(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    out = tmp_path / "ckpts"
    L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=tmp_path, max_steps=4,
              callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)],
              ).fit(FrozenBackbone())
    saved = sorted(out.glob("*.ckpt"))
    assert len(saved) == 2  # steps 2 and 4, each a torch.save zip written by Lightning
    assert all(p.read_bytes()[:2] == b"PK" for p in saved)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    shutil.copy2(saved[0], one / "model.ckpt")
    shutil.copy2(saved[1], two / "model.ckpt")

    with casckpt.open(tmp_path / "store") as store:
        whole = store.add_dir(out, run="lightning", step=0)
        first = store.add_dir(one, run="lightning", step=2)
        second = store.add_dir(two, run="lightning", step=4)
        store.checkout(whole, tmp_path / "back")
        store.checkout(second, tmp_path / "back-two")

    assert files_of(tmp_path / "back") == files_of(out)
    assert files_of(tmp_path / "back-two") == files_of(two)
    size = saved[1].stat().st_size
    assert size > WIDTH * WIDTH * 4
    assert first.new_bytes == 0 and second.new_bytes == 0  # both files were in `whole` already
    # the step-4 file against the step-2 one alone: in a fresh store, only what trained is new
    with casckpt.open(tmp_path / "store2") as store:
        store.add_dir(one, run="lightning", step=2)
        later = store.add_dir(two, run="lightning", step=4)
    assert later.new_bytes * 4 < size, (later.new_bytes, size)
