"""Benchmark workloads, generated in-process (nothing is downloaded).

Every workload's state is ``{"model": model.state_dict(), "optim": ...}``,
as a training loop would checkpoint it. The decoder workloads share one
GPT-style model; ``embed`` is a recommendation model.

* ``dense``: every parameter trains (real AdamW steps), so every weight and
  moment changes per interval.
* ``dense-bf16``: the same decoder with bf16 weights and fp32 AdamW moments;
  per interval every element is nudged by a relative update of random sign and
  magnitude log-uniform in [1e-4, 1e-3]. The bf16 weights are the rounding of a
  hidden fp32 master copy that receives the update (as in mixed-precision
  training), so only the bf16 elements whose rounding flips change value.
* ``frozen``: only the last blocks and the head train (~15% of parameters).
* ``lora``: the decoder frozen, rank-8 adapters on every attention projection
  (qkv and out); AdamW on the adapters only (real steps).
* ``embed``: an embedding table (~512 MiB fp32 at scale 1, 64 wide) + a small
  MLP. Each interval is one step on a batch of ~1% of the rows looked up,
  drawn from a Zipf law (s = 1.1, ~0.3% of the rows unique) over frequency-
  ordered ids (row 0 the most popular); sparse SGD on the table (no state),
  AdamW on the MLP.
* ``unchanged``: the ``dense`` state, re-committed without any step in between.
* ``branch``: the ``frozen`` model as a hyper-parameter sweep: one base
  version, then ``BRANCHES`` fine-tunes from it, each with its own learning
  rate and data seed (:meth:`Workload.branch` resets the live state to the base).

Sizes scale with ``scale``: at 1.0 the dense state is ~1 GiB of fp32 tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("dense", "dense-bf16", "frozen", "lora", "embed", "unchanged", "branch")

_BASE_D_MODEL = 768
_BASE_VOCAB = 8192
_N_LAYERS = 11
_HEAD_DIM = 64
_SEQ_LEN = 256
_BATCH_TOKENS = 64
_FROZEN_TRAINABLE_TARGET = 0.15
_L2 = 1e-4  # a dense term in the loss, so rows no token touches still get a gradient

LORA_RANK = 8
LORA_ALPHA = 16

NUDGE_DECADES = (-4.0, -3.0)  # dense-bf16: |relative update| is 10**U(-4, -3)
NUDGE_POOL = 4 << 20  # precomputed factors (16 MiB)
_LN10 = math.log(10.0)

EMBED_ROWS_AT_SCALE_1 = 2 * 1024 * 1024  # x 64 fp32 = 512 MiB
EMBED_DIM = 64
EMBED_LOOKUP_FRACTION = 0.01  # rows looked up per interval, with repeats
EMBED_ZIPF_S = 1.1  # gives ~0.3% of the rows unique at scale 1
_EMBED_BASE_HIDDEN = 512

BRANCHES = 4
BRANCH_LRS = (3e-4, 1e-3, 3e-3, 1e-2)


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


@dataclass(frozen=True)
class EmbedConfig:
    """Shape of the recommendation model: the table grows with scale, the MLP with sqrt(scale)."""

    rows: int
    dim: int
    hidden: int
    lookups: int
    zipf_s: float

    @classmethod
    def for_scale(cls, scale: float) -> EmbedConfig:
        """The config whose table is about ``scale`` x 512 MiB of fp32."""
        rows = max(4096, round(EMBED_ROWS_AT_SCALE_1 * scale))
        hidden = max(64, round(_EMBED_BASE_HIDDEN * math.sqrt(scale) / 64) * 64)
        lookups = max(1, round(rows * EMBED_LOOKUP_FRACTION))
        return cls(rows, EMBED_DIM, hidden, lookups, EMBED_ZIPF_S)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv: nn.Module = nn.Linear(d_model, 3 * d_model)
        self.proj: nn.Module = nn.Linear(d_model, d_model)
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


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK, alpha: float = LORA_ALPHA) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scaling = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scaling
        return out


class EmbedModel(nn.Module):
    """An embedding table (sparse gradients) feeding a 3-layer MLP that scores each lookup."""

    def __init__(self, cfg: EmbedConfig) -> None:
        super().__init__()
        self.table = nn.Embedding(cfg.rows, cfg.dim, sparse=True)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, 1),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.table(ids)).squeeze(-1)
        return out


@dataclass
class Workload:
    """A model's state and how it changes between two commits.

    ``state()`` returns the tree to checkpoint (sharing storage with the live
    model); ``advance()`` moves it on by one checkpoint interval.
    ``rows_changed()`` (sparse workloads only) gives, per tensor path, the rows
    the last ``advance`` touched and the bytes of one row. ``branch(i)``
    (``branch`` only) resets the live state to the base and picks branch ``i``'s
    hyper-parameters.
    """

    name: str
    cfg: Any  # a dataclass: ModelConfig or EmbedConfig
    state: Callable[[], dict[str, Any]]
    advance: Callable[[], None]
    trainable_fraction: float
    rows_changed: Callable[[], dict[str, tuple[int, int]]] | None = None
    branch: Callable[[int], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ModelConfig) -> None:
    """One real optimizer step on next-token loss plus a small L2 term (dense gradients)."""
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


def _add_lora(model: Decoder) -> list[nn.Parameter]:
    """Freeze the decoder; wrap every block's qkv and proj in a :class:`LoRALinear`."""
    model.requires_grad_(False)
    for block in model.blocks:
        assert isinstance(block, Block)
        assert isinstance(block.qkv, nn.Linear) and isinstance(block.proj, nn.Linear)
        block.qkv = LoRALinear(block.qkv)
        block.proj = LoRALinear(block.proj)
    return [p for p in model.parameters() if p.requires_grad]


def _fraction(params: list[nn.Parameter], model: nn.Module) -> float:
    return sum(p.numel() for p in params) / sum(p.numel() for p in model.parameters())


class Nudger:
    """Multiplies tensors element-wise by ``1 + r``, ``|r|`` log-uniform in 1e-4..1e-3, random sign.

    The factors come from a pool of ``NUDGE_POOL`` precomputed ones, read from a
    random offset (wrapping around) for each tensor: one multiply per element
    instead of drawing and transforming fresh random numbers (10x faster). The
    pool is larger than a chunk, so no chunk sees a repeated pattern.
    """

    def __init__(self, gen: torch.Generator, pool: int = NUDGE_POOL) -> None:
        lo, hi = NUDGE_DECADES
        v = torch.empty(pool, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
        factors = v.abs().mul_(hi - lo).add_(lo).mul_(_LN10).exp_().copysign_(v).add_(1.0)
        self._pool = torch.cat([factors, factors])  # any window of <= pool elements is one slice
        self._size = pool
        self._gen = gen

    def __call__(self, t: torch.Tensor) -> None:
        flat = t.view(-1)
        for start in range(0, flat.numel(), self._size):
            part = flat[start : start + self._size]
            offset = int(torch.randint(self._size, (1,), generator=self._gen))
            part.mul_(self._pool[offset : offset + part.numel()])


def _decoder(name: str, cfg: ModelConfig) -> Workload:
    """``dense``, ``frozen``, ``unchanged``, ``lora``: a decoder trained with real AdamW steps."""
    model = Decoder(cfg)
    if name == "frozen":
        params = _freeze_all_but_tail(model)
    elif name == "lora":
        params = _add_lora(model)
    else:
        params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _train_step(model, optimizer, cfg)  # so the first commit already holds optimizer moments

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def advance() -> None:
        if name != "unchanged":
            _train_step(model, optimizer, cfg)

    info = {"lora_rank": LORA_RANK, "lora_targets": "qkv, proj"} if name == "lora" else {}
    return Workload(name, cfg, state, advance, _fraction(params, model), info=info)


def _dense_bf16(cfg: ModelConfig, seed: int) -> Workload:
    """bf16 weights (rounded from a hidden fp32 master) + fp32 AdamW moments, nudged each interval."""
    master = Decoder(cfg)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    _train_step(master, optimizer, cfg)  # real moments to start from
    model = copy.deepcopy(master).to(torch.bfloat16).requires_grad_(False)
    pairs = list(zip(master.parameters(), model.parameters(), strict=True))
    nudge_ = Nudger(torch.Generator().manual_seed(seed + 1))

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    @torch.no_grad()
    def advance() -> None:
        for fp32, bf16 in pairs:
            nudge_(fp32)
            bf16.copy_(fp32)
            moments = optimizer.state[fp32]
            nudge_(moments["exp_avg"])
            nudge_(moments["exp_avg_sq"])
            moments["step"] += 1

    info = {"weights": "bfloat16", "moments": "float32", "relative_update": "10**U(-4,-3), random sign"}
    return Workload("dense-bf16", cfg, state, advance, 1.0, info=info)


def _zipf_cdf(n: int, s: float) -> torch.Tensor:
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow_(-s)
    cdf = torch.cumsum(weights, 0)
    return cdf / cdf[-1]


def _embed(cfg: EmbedConfig, seed: int) -> Workload:
    """Recommendation model: Zipf lookups of ~1% of the rows per interval, sparse SGD + AdamW."""
    model = EmbedModel(cfg)
    sparse = torch.optim.SGD(model.table.parameters(), lr=0.05)
    dense = torch.optim.AdamW(model.mlp.parameters(), lr=1e-3)
    cdf = _zipf_cdf(cfg.rows, cfg.zipf_s)
    gen = torch.Generator().manual_seed(seed + 2)
    touched = {"rows": 0}

    def step() -> None:
        u = torch.rand(cfg.lookups, generator=gen, dtype=torch.float64)
        ids = torch.searchsorted(cdf, u).clamp_(max=cfg.rows - 1)
        target = torch.rand(cfg.lookups, generator=gen)
        loss = F.mse_loss(model(ids), target)
        loss.backward()  # type: ignore[no-untyped-call]
        sparse.step()
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        touched["rows"] = int(torch.unique(ids).numel())

    step()  # so the first commit already holds the MLP's moments

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(),
                "optim": {"table": sparse.state_dict(), "mlp": dense.state_dict()}}

    def rows_changed() -> dict[str, tuple[int, int]]:
        return {"model.table.weight": (touched["rows"], cfg.dim * 4)}

    info = {"ids": "frequency-ordered (row 0 most popular)", "table_optimizer": "SGD (sparse, no state)",
            "mlp_optimizer": "AdamW"}
    return Workload("embed", cfg, state, step, 1.0,
                    rows_changed=rows_changed, info=info)


def _branch(cfg: ModelConfig, seed: int) -> Workload:
    """The ``frozen`` fine-tune as a sweep: ``branch(i)`` resets to the base, sets lr and data seed."""
    model = Decoder(cfg)
    params = _freeze_all_but_tail(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _train_step(model, optimizer, cfg)
    base_model = {k: v.clone() for k, v in model.state_dict().items()}
    base_optim = copy.deepcopy(optimizer.state_dict())

    def branch(i: int) -> None:
        model.load_state_dict(base_model)
        optimizer.load_state_dict(copy.deepcopy(base_optim))
        for group in optimizer.param_groups:
            group["lr"] = BRANCH_LRS[i % len(BRANCH_LRS)]
        torch.manual_seed(seed + 1000 + i)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def advance() -> None:
        _train_step(model, optimizer, cfg)

    info = {"branches": BRANCHES, "branch_lrs": list(BRANCH_LRS[:BRANCHES]), "base": "frozen"}
    return Workload("branch", cfg, state, advance, _fraction(params, model), branch=branch, info=info)


def build(name: str, scale: float, seed: int = 0) -> Workload:
    """Build workload ``name`` at ``scale``, with one optimizer step already taken."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    torch.manual_seed(seed)
    if name == "embed":
        return _embed(EmbedConfig.for_scale(scale), seed)
    cfg = ModelConfig.for_scale(scale)
    if name == "dense-bf16":
        return _dense_bf16(cfg, seed)
    if name == "branch":
        return _branch(cfg, seed)
    return _decoder(name, cfg)
