"""Directory snapshots of real Hugging Face output: ``save_pretrained`` of a tiny GPT-2 (built
from a config, random init, nothing downloaded) comes back byte-identical, and a re-save
after one weight changed writes little more than that weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import casckpt

transformers = pytest.importorskip("transformers")


def test_save_pretrained_round_trips_and_dedups(tmp_path: Path) -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "ckpt")
    with casckpt.open(tmp_path / "store") as store:
        first = store.add_dir(tmp_path / "ckpt", run="hf", step=1)
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.add_(1.0)  # 64 x 256 fp32: 64 KiB
        model.save_pretrained(tmp_path / "ckpt")
        second = store.add_dir(tmp_path / "ckpt", run="hf", step=2)
        assert second.new_bytes <= (64 << 10) + (256 << 10)  # that weight (and small runs near it)
        assert second.new_bytes * 4 < first.new_bytes
        for step in (1, 2):
            out = store.checkout(f"hf@{step}", tmp_path / f"out{step}")
            names = sorted(p.name for p in out.iterdir())
            assert names == sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        for name in names:
            assert (tmp_path / "out2" / name).read_bytes() == (tmp_path / "ckpt" / name).read_bytes()
        reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out2")
        for (key, a), b in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
            assert torch.equal(a, b), key
        assert store.ops.check(read_data=True).ok
