"""Benchmark workloads, generated in-process from a small GPT-style decoder.

Every workload holds a model and an AdamW optimizer; its state tree is
``{"model": model.state_dict(), "optim": optimizer.state_dict()}``.

* ``dense``: every parameter trains, so every weight and moment changes per step.
* ``frozen``: only the last blocks and the head train (~15% of parameters).
* ``unchanged``: the ``dense`` state, re-committed without any step in between.

Sizes scale with ``scale``: at 1.0 the dense state is ~1 GiB of fp32 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("dense", "frozen", "unchanged")

_BASE_D_MODEL = 768
_BASE_VOCAB = 8192
_N_LAYERS = 11
_HEAD_DIM = 64
_SEQ_LEN = 256
_BATCH_TOKENS = 64
_FROZEN_TRAINABLE_TARGET = 0.15
_L2 = 1e-4  # a dense term in the loss, so rows no token touches still get a gradient


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder; width and vocabulary scale with sqrt(scale)."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int

    @classmethod
    def for_scale(cls, scale: float) -> ModelConfig:
        """The config whose state is about ``scale`` GiB of fp32 weights + AdamW moments."""
        width = math.sqrt(scale)
        d_model = max(_HEAD_DIM, round(_BASE_D_MODEL * width / _HEAD_DIM) * _HEAD_DIM)
        vocab = max(256, round(_BASE_VOCAB * width / 256) * 256)
        return cls(vocab, d_model, _N_LAYERS, d_model // _HEAD_DIM, _SEQ_LEN)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class Decoder(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, final norm, untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


@dataclass
class Workload:
    """A model, its optimizer, and how the state changes between two commits."""

    name: str
    cfg: ModelConfig
    model: Decoder
    optimizer: torch.optim.AdamW
    trainable_fraction: float
    advance: Callable[[], None]

    def state(self) -> dict[str, Any]:
        """The state tree to checkpoint (shares storage with the live model)."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def _train_step(model: Decoder, optimizer: torch.optim.AdamW, cfg: ModelConfig) -> None:
    """One real AdamW step on next-token loss plus a small L2 term (dense gradients)."""
    tokens = torch.randint(cfg.vocab, (1, _BATCH_TOKENS + 1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss = loss + _L2 * torch.stack([p.pow(2).sum() for p in params]).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _freeze_all_but_tail(model: Decoder) -> list[nn.Parameter]:
    """Keep head, final norm and the last k blocks trainable, k giving ~15% of params."""
    total = sum(p.numel() for p in model.parameters())
    tail = sum(p.numel() for p in [*model.head.parameters(), *model.ln_f.parameters()])
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    n_layers = len(model.blocks)
    k = min(
        range(1, n_layers + 1),
        key=lambda n: abs((tail + n * per_block) / total - _FROZEN_TRAINABLE_TARGET),
    )
    model.requires_grad_(False)
    trainable = [model.head, model.ln_f, *model.blocks[n_layers - k :]]
    for module in trainable:
        module.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def build(name: str, scale: float, seed: int = 0) -> Workload:
    """Build workload ``name`` at ``scale``, with one optimizer step already taken."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    torch.manual_seed(seed)
    cfg = ModelConfig.for_scale(scale)
    model = Decoder(cfg)
    params = _freeze_all_but_tail(model) if name == "frozen" else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _train_step(model, optimizer, cfg)  # so the first commit already holds optimizer moments
    trainable = sum(p.numel() for p in params) / sum(p.numel() for p in model.parameters())

    def advance() -> None:
        if name != "unchanged":
            _train_step(model, optimizer, cfg)

    return Workload(name, cfg, model, optimizer, trainable, advance)
