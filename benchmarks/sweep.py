"""Sweep of the store's tuning defaults: chunk size, pack size and compression (issue 6).

For every workload a state is built twice in memory (version 1, and version 2
after one update), then for every configuration a fresh store in a fresh
directory commits version 1 (first commit), version 2 (incremental commit),
version 2 again (unchanged re-commit), restores version 2 in full and loads
its largest tensor alone, each checked against the live state. A same-run
``torch.save`` (fsync'd) / ``torch.load`` of version 2 in the same directory is
the baseline every time is divided by.

Configurations (local disk):

* chunk size 64 KiB, 256 KiB, 1 MiB, 4 MiB (plus 16 KiB for ``embed`` and
  ``dense``, to price small chunks where they pay and where they do not);
* compression off, and on at zstd level 1 (the default policy: 64 KiB probe,
  stored raw unless it saves >= 10%); zstd level 3 at 1 MiB chunks;
* pack size 16, 64, 128 MiB at 1 MiB chunks (``dense`` only: locally a pack
  size only changes how many files are written and fsync'd).

On S3 (an in-process moto server on loopback, fake credentials), the ``dense``
state is committed (first and incremental), restored in full and one tensor
loaded with each pack size (compression on), then with 64 MiB packs and
compression off, and ``dense-bf16`` with 64 MiB packs, compression on and off;
each next to raw boto3 transfers of the same bytes cut into objects of the pack
size (the transfer settings S3BlobStore uses).

An offline chunk-change profile (no store) counts, per tensor and chunk size
from 4 KiB to 4 MiB, how many chunks differ between the two versions, so the
new bytes of any per-tensor chunk-size rule can be priced without a store,
and a codec profile encodes a sample of 1 MiB chunks single-threaded per
tensor role (weights, exp_avg, exp_avg_sq) with the store's policy at zstd 1
and 3 and without the probe, to show what compression saves and costs.

Workloads (``--scale`` 1.0 is the size BENCHMARKS.md names; states are built
directly, with AdamW steps on random gradients instead of forward/backward):

* ``dense``: GPT-style decoder (as benchmarks/workloads.py), fp32 weights +
  AdamW moments; one AdamW step changes every element;
* ``dense-bf16``: the same model, bf16 weights + fp32 AdamW moments; every
  weight nudged by a relative 1e-4..1e-3 (many round back to the same bf16),
  every moment changes;
* ``frozen``: last blocks + head trainable (~15% of parameters), AdamW on them;
* ``lora``: frozen fp32 base + rank-8 adapters on qkv and proj of every block,
  AdamW on the adapters;
* ``embed``: a 128-wide fp32 embedding table of 512 MiB x scale + a small MLP
  (AdamW); 1% of rows looked up per interval from a Zipf(1.2) over a random
  permutation of row ids (~0.3% of rows distinct), those rows get a sparse
  SGD update; the table has no optimizer state.

Usage::

    python benchmarks/sweep.py --scale 0.25 --out sweep.json [--dir DIR]
        [--workloads dense,embed] [--no-s3] [--repeats N]
    python benchmarks/sweep.py --combine run1.json run2.json ...   # markdown, medians over runs
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # measure the casckpt of this checkout
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import casckpt  # noqa: E402
from benchmarks import measure  # noqa: E402
from casckpt.testing.internals import internals  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
MB = 1_000_000

WORKLOADS = ("dense", "dense-bf16", "frozen", "lora", "embed")
CHUNK_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
SMALL_CHUNK = 16 * KiB
SMALL_CHUNK_WORKLOADS = ("dense", "embed")
PACK_SIZES = (16 * MiB, 64 * MiB, 128 * MiB)
DEFAULT_CHUNK = 1 * MiB
DEFAULT_PACK = 64 * MiB
PROFILE_CHUNKS = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
PROFILE_BLOCK = 4 * KiB

# model shape, as benchmarks/workloads.py: width and vocabulary grow with sqrt(scale)
_BASE_D_MODEL = 768
_BASE_VOCAB = 8192
_N_LAYERS = 11
_HEAD_DIM = 64
_SEQ_LEN = 256
_FROZEN_TARGET = 0.15
_LORA_RANK = 8
_EMBED_DIM = 128
_EMBED_BYTES_AT_1 = 512 * MiB
_EMBED_LOOKUPS = 0.01
_ZIPF_A = 1.2

Tree = dict[str, Any]
Log = Callable[[str], None]


# --------------------------------------------------------------------------- states


@dataclass
class StatePair:
    """Two versions of one workload's state and what truly changed between them."""

    name: str
    v1: Tree
    v2: Tree
    info: dict[str, Any]


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone_tree(v) for v in tree)
    return tree


def _decoder(scale: float) -> tuple[nn.ModuleDict, dict[str, int]]:
    width = math.sqrt(scale)
    d = max(_HEAD_DIM, round(_BASE_D_MODEL * width / _HEAD_DIM) * _HEAD_DIM)
    vocab = max(256, round(_BASE_VOCAB * width / 256) * 256)
    blocks = nn.ModuleList(
        nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
            "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d),
        }) for _ in range(_N_LAYERS)
    )
    model = nn.ModuleDict({
        "tok": nn.Embedding(vocab, d), "pos": nn.Embedding(_SEQ_LEN, d), "blocks": blocks,
        "ln_f": nn.LayerNorm(d), "head": nn.Linear(d, vocab, bias=False),
    })
    return model, {"vocab": vocab, "d_model": d, "n_layers": _N_LAYERS}


def _adamw_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], gen: torch.Generator,
                grad_scale: float = 1e-2) -> None:
    """One AdamW step on random gradients: every trained element and moment changes."""
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * grad_scale
    opt.step()
    opt.zero_grad(set_to_none=True)


def _numel(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _decoder_pair(name: str, scale: float, seed: int) -> StatePair:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model, dims = _decoder(scale)
    all_params = list(model.parameters())
    info: dict[str, Any] = {"model": dims}
    if name == "frozen":
        blocks = model["blocks"]
        assert isinstance(blocks, nn.ModuleList)
        tail = _numel([*model["head"].parameters(), *model["ln_f"].parameters()])
        per_block = _numel(list(blocks[0].parameters()))
        k = min(range(1, _N_LAYERS + 1),
                key=lambda n: abs((tail + n * per_block) / _numel(all_params) - _FROZEN_TARGET))
        model.requires_grad_(False)
        for module in (model["head"], model["ln_f"], *blocks[_N_LAYERS - k:]):
            module.requires_grad_(True)
        params = [p for p in all_params if p.requires_grad]
        info["trainable_fraction"] = _numel(params) / _numel(all_params)
    else:
        params = all_params
    lr = 1e-5 if name == "dense-bf16" else 1e-3
    opt = torch.optim.AdamW(params, lr=lr)
    _adamw_step(opt, params, gen)  # so version 1 already holds moments

    def state() -> Tree:
        sd = model.state_dict()
        if name == "dense-bf16":
            sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        return {"model": sd, "optim": opt.state_dict()}

    v1 = _clone_tree(state())
    if name == "dense-bf16":
        # every weight nudged by a relative 1e-4..1e-3 (the bf16 copy rounds many back)
        with torch.no_grad():
            for p in params:
                rel = torch.empty(p.shape).uniform_(1e-4, 1e-3, generator=gen)
                sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
                p.mul_(1 + rel * sign)
        for p in params:  # the moments take a normal step (weights moved above, lr is tiny)
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        _adamw_step(opt, params, gen)
    v2 = _clone_tree(state())
    if name == "dense-bf16":
        pairs = zip(v1["model"].values(), v2["model"].values(), strict=True)
        changed = sum(int((a != b).sum()) for a, b in pairs)
        total = sum(a.numel() for a in v1["model"].values())
        info["bf16_weight_elements_changed"] = changed / total
    return StatePair(name, v1, v2, info)


def _lora_pair(scale: float, seed: int) -> StatePair:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model, dims = _decoder(scale)
    model.requires_grad_(False)
    d = dims["d_model"]
    adapters: dict[str, nn.Parameter] = {}
    for i in range(_N_LAYERS):
        for target, out_dim in (("qkv", 3 * d), ("proj", d)):
            adapters[f"blocks.{i}.{target}.lora_A"] = nn.Parameter(
                torch.randn(_LORA_RANK, d, generator=gen) / math.sqrt(d))
            adapters[f"blocks.{i}.{target}.lora_B"] = nn.Parameter(torch.zeros(out_dim, _LORA_RANK))
    params = list(adapters.values())
    opt = torch.optim.AdamW(params, lr=1e-3)
    _adamw_step(opt, params, gen)

    def state() -> Tree:
        sd = dict(model.state_dict())
        sd.update({k: v.detach() for k, v in adapters.items()})
        return {"model": sd, "optim": opt.state_dict()}

    v1 = _clone_tree(state())
    _adamw_step(opt, params, gen)
    v2 = _clone_tree(state())
    info = {"model": dims, "rank": _LORA_RANK,
            "trainable_fraction": _numel(params) / (_numel(params) + _numel(list(model.parameters())))}
    return StatePair("lora", v1, v2, info)


def _embed_pair(scale: float, seed: int) -> StatePair:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    rows = max(4096, round(_EMBED_BYTES_AT_1 * scale / (_EMBED_DIM * 4)))
    table = torch.randn(rows, _EMBED_DIM, generator=gen) * 0.01
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(_EMBED_DIM, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                        nn.Linear(512, 1))
    params = list(mlp.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    _adamw_step(opt, params, gen)

    def state() -> Tree:
        model = {"embedding.weight": table}
        model.update({f"mlp.{k}": v for k, v in mlp.state_dict().items()})
        return {"model": model, "optim": opt.state_dict()}

    v1 = _clone_tree(state())
    # one interval: 1% of rows looked up, Zipf over a random permutation of ids (hot rows scattered)
    lookups = max(1, round(rows * _EMBED_LOOKUPS))
    draws = rng.zipf(_ZIPF_A, size=lookups * 4)
    draws = draws[draws <= rows][:lookups]
    ids = torch.from_numpy(np.unique(rng.permutation(rows)[draws - 1]))
    with torch.no_grad():
        table[ids] -= 0.01 * torch.randn(len(ids), _EMBED_DIM, generator=gen)
    _adamw_step(opt, params, gen)
    v2 = _clone_tree(state())
    row_bytes = _EMBED_DIM * 4
    mlp_bytes = sum(t.nbytes for p, t in measure.tensor_leaves(v2) if "embedding" not in p)
    info = {"rows": rows, "dim": _EMBED_DIM, "table_bytes": rows * row_bytes, "lookups": lookups,
            "distinct_rows_changed": len(ids), "distinct_row_fraction": len(ids) / rows,
            "rows_changed_bytes": len(ids) * row_bytes,
            "element_changed_bytes": len(ids) * row_bytes + mlp_bytes}
    return StatePair("embed", v1, v2, info)


def build_pair(name: str, scale: float, seed: int = 0) -> StatePair:
    """Versions 1 and 2 of workload ``name`` at ``scale``."""
    if name in ("dense", "dense-bf16", "frozen"):
        pair = _decoder_pair(name, scale, seed)
    elif name == "lora":
        pair = _lora_pair(scale, seed)
    elif name == "embed":
        pair = _embed_pair(scale, seed)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    leaves = list(measure.tensor_leaves(pair.v2))
    pair.info.update({
        "tensors": len(leaves),
        "logical_bytes": measure.logical_bytes(pair.v2),
        "changed_tensor_bytes": measure.changed_bytes(measure.tensor_digests(pair.v1),
                                                      measure.tensor_digests(pair.v2)),
    })
    big_path, big = measure.largest_tensor(pair.v2)
    pair.info["largest_tensor"] = {"path": big_path, "bytes": big.nbytes, "shape": list(big.shape),
                                   "dtype": str(big.dtype)}
    pair.info.setdefault("element_changed_bytes", pair.info["changed_tensor_bytes"])
    return pair


# --------------------------------------------------------------------------- chunk-change profile


def _changed_blocks(a: memoryview, b: memoryview) -> np.ndarray:
    """Per 4 KiB block of a tensor's bytes, whether it differs between the versions."""
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    full = len(x) // PROFILE_BLOCK
    out = np.zeros(full + (1 if len(x) % PROFILE_BLOCK else 0), dtype=bool)
    if full:
        xs = x[: full * PROFILE_BLOCK].view(np.uint64 if PROFILE_BLOCK % 8 == 0 else np.uint8)
        ys = y[: full * PROFILE_BLOCK].view(xs.dtype)
        out[:full] = (xs != ys).reshape(full, -1).any(axis=1)
    if len(x) % PROFILE_BLOCK:
        out[full] = bool((x[full * PROFILE_BLOCK:] != y[full * PROFILE_BLOCK:]).any())
    return out


def chunk_profile(pair: StatePair) -> dict[str, Any]:
    """New bytes and chunk counts per chunk size, in total and per tensor, with no store involved.

    Also prices a per-tensor rule: 16 KiB chunks for 2-D tensors of >= ``threshold``
    bytes, 1 MiB for everything else.
    """
    before = dict(measure.tensor_leaves(pair.v1))
    tensors: list[dict[str, Any]] = []
    for path, t in measure.tensor_leaves(pair.v2):
        nbytes = t.nbytes
        mask = _changed_blocks(measure.raw_bytes(before[path]), measure.raw_bytes(t)) if nbytes \
            else np.zeros(0, dtype=bool)
        per_size: dict[int, tuple[int, int]] = {}
        for size in PROFILE_CHUNKS:
            group = size // PROFILE_BLOCK
            n = math.ceil(nbytes / size) if nbytes else 0
            padded = np.zeros(n * group, dtype=bool)
            padded[: len(mask)] = mask
            changed = np.asarray(padded.reshape(n, group).any(axis=1) if n else padded, dtype=bool)
            new = int(changed[:-1].sum()) * size if n else 0
            if n and bool(changed[-1]):
                new += nbytes - (n - 1) * size
            per_size[size] = (n, new)
        tensors.append({"path": path, "shape": list(t.shape), "bytes": nbytes, "per_size": per_size})
    totals = {str(size): {"chunks": sum(e["per_size"][size][0] for e in tensors),
                          "new_bytes": sum(e["per_size"][size][1] for e in tensors)}
              for size in PROFILE_CHUNKS}
    rules = {}
    for threshold in (16 * MiB, 64 * MiB):
        chunks = new = 0
        for e in tensors:
            size = SMALL_CHUNK if len(e["shape"]) == 2 and e["bytes"] >= threshold else DEFAULT_CHUNK
            n, b = e["per_size"][size]
            chunks, new = chunks + n, new + b
        rules[f"16KiB_for_2d_ge_{threshold // MiB}MiB_else_1MiB"] = {"chunks": chunks, "new_bytes": new}
    return {"by_chunk_size": totals, "rules": rules}


# --------------------------------------------------------------------------- codec profile


def _role(path: str) -> str:
    if path.endswith("exp_avg_sq"):
        return "exp_avg_sq"
    if path.endswith("exp_avg"):
        return "exp_avg"
    if path.startswith("model."):
        return "weights"
    return "other"


def codec_profile(pair: StatePair, chunk_size: int = DEFAULT_CHUNK,
                  budget: int = 48 * MiB) -> dict[str, Any]:
    """What compression buys and costs per tensor role, on a sample of version 2's chunks.

    Every chunk of ``chunk_size`` (at most ``budget`` bytes in all, spread over
    the tensors) is encoded single-threaded with the store's policy (64 KiB probe,
    >= 10% saving) at zstd 1 and 3, and fully compressed with grouping (no probe)
    to price other saving thresholds. Throughputs are MB/s of raw bytes, one core.
    """
    from casckpt.format.codecs import CompressionPolicy, decode_chunk, encode_chunk

    leaves = [(p, t) for p, t in measure.tensor_leaves(pair.v2) if t.nbytes >= 64]
    total = sum(t.nbytes for _, t in leaves)
    stride = max(1, math.ceil(total / budget))  # every stride-th chunk of the state
    roles: dict[str, dict[str, Any]] = {}
    index = 0
    policies = {"zstd1": CompressionPolicy(level=1), "zstd3": CompressionPolicy(level=3),
                "zstd1_noprobe": CompressionPolicy(level=1, min_saving=0.0)}
    for path, t in leaves:
        view = measure.raw_bytes(t)
        itemsize = t.element_size()
        size = chunk_size - chunk_size % itemsize
        for start in range(0, len(view), size):
            index += 1
            if (index - 1) % stride:
                continue
            chunk = view[start: start + size]
            entry = roles.setdefault(_role(path), {
                "dtype": set(), "chunks": 0, "raw_bytes": 0,
                **{f"{k}_{m}": 0 for k in policies for m in ("bytes", "encode_s", "compressed_chunks")},
                "zstd1_decode_s": 0.0, "zstd1_decoded_bytes": 0, "savings": []})
            entry["dtype"].add(str(t.dtype).replace("torch.", ""))
            entry["chunks"] += 1
            entry["raw_bytes"] += len(chunk)
            for key, policy in policies.items():
                begin = time.perf_counter()
                codec, payload = encode_chunk(chunk, itemsize, policy)
                entry[f"{key}_encode_s"] += time.perf_counter() - begin
                entry[f"{key}_bytes"] += len(payload)
                entry[f"{key}_compressed_chunks"] += int(codec != 0)
                if key == "zstd1" and codec != 0:
                    begin = time.perf_counter()
                    decode_chunk(int(codec), payload, len(chunk))
                    entry["zstd1_decode_s"] += time.perf_counter() - begin
                    entry["zstd1_decoded_bytes"] += len(chunk)
                if key == "zstd1_noprobe":
                    entry["savings"].append((len(chunk), 1 - len(payload) / len(chunk)))
    out = {}
    for role, e in roles.items():
        raw = e["raw_bytes"]
        row: dict[str, Any] = {"dtype": sorted(e["dtype"]), "sampled_chunks": e["chunks"],
                               "sampled_bytes": raw}
        for key in policies:
            row[f"{key}_saving"] = 1 - e[f"{key}_bytes"] / raw
            row[f"{key}_compressed_chunk_fraction"] = e[f"{key}_compressed_chunks"] / e["chunks"]
            row[f"{key}_encode_MBps"] = raw / MB / e[f"{key}_encode_s"] if e[f"{key}_encode_s"] else None
        row["zstd1_decode_MBps_of_compressed"] = (e["zstd1_decoded_bytes"] / MB / e["zstd1_decode_s"]
                                                  if e["zstd1_decode_s"] else None)
        for threshold in (0.10, 0.20, 0.30):
            row[f"saving_if_threshold_{int(threshold * 100)}"] = sum(
                n * s for n, s in e["savings"] if s >= threshold) / raw
        out[role] = row
    return {"chunk_size": chunk_size, "sample_stride": stride, "roles": out}


# --------------------------------------------------------------------------- baseline


def _median(values: list[float]) -> float:
    return statistics.median(values)


def baseline(state: Tree, workdir: Path, largest: str, repeats: int = 3) -> dict[str, Any]:
    """torch.save (fsync'd) / torch.load / torch.load(mmap) + one tensor, median of ``repeats``."""
    path = workdir / "baseline.pt"
    saves, loads, ones = [], [], []
    for _ in range(repeats):
        saves.append(measure.timed(lambda: measure.torch_save_fsync(state, path))[1])
        loaded, seconds = measure.timed(lambda: measure.torch_load(path))
        loads.append(seconds)
        del loaded

        def one() -> torch.Tensor:
            tree = torch.load(path, weights_only=True, mmap=True)
            return dict(measure.tensor_leaves(tree))[largest].clone()

        ones.append(measure.timed(one)[1])
    file_bytes = path.stat().st_size
    path.unlink()
    return {"save_s": _median(saves), "load_s": _median(loads), "one_tensor_mmap_s": _median(ones),
            "save_samples": saves, "load_samples": loads, "file_bytes": file_bytes}


# --------------------------------------------------------------------------- local configs


@dataclass(frozen=True)
class Config:
    """One store configuration."""

    chunk_size: int
    pack_size: int
    compress: bool
    zstd_level: int = 1

    @property
    def label(self) -> str:
        comp = f"zstd{self.zstd_level}" if self.compress else "raw"
        return f"chunk={_size(self.chunk_size)} pack={_size(self.pack_size)} {comp}"


def _size(n: float) -> str:
    for unit, value in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= value:
            v = n / value
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n:.0f}B"


def configs_for(name: str, quick: bool = False) -> list[Config]:
    """The local configurations swept for workload ``name``."""
    chunks = list(CHUNK_SIZES)
    if name in SMALL_CHUNK_WORKLOADS:
        chunks.insert(0, SMALL_CHUNK)
    if quick:
        chunks = [64 * KiB, DEFAULT_CHUNK]
    out = [Config(c, DEFAULT_PACK, comp) for c in chunks for comp in (False, True)]
    out.append(Config(DEFAULT_CHUNK, DEFAULT_PACK, True, 3))
    if name == "dense" and not quick:
        out += [Config(DEFAULT_CHUNK, p, True) for p in PACK_SIZES if p != DEFAULT_PACK]
    return out


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compression_env(config: Config) -> dict[str, str]:
    return {"CASCKPT_COMPRESSION": "1" if config.compress else "0",
            "CASCKPT_ZSTD_LEVEL": str(config.zstd_level)}


def _dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def _catalog_view(store: Any, version_id: str) -> dict[str, int]:
    manifest = internals(store).manifest(version_id)
    return {"manifest_bytes": len(internals(store).catalog.manifest(version_id)),
            "chunk_refs": sum(len(b.chunks) for b in manifest.extents)}


def _version(v: Any) -> dict[str, Any]:
    return {"new_bytes": v.new_bytes, "stored_bytes": v.stored_bytes, "duration_s": v.duration_s}


def run_store(pair: StatePair, store: Any, largest: str) -> dict[str, Any]:
    """Commit v1, v2, v2 again; restore v2; load the largest tensor. Times and sizes."""
    v1, first_s = measure.timed(lambda: store.commit(pair.v1, run="sweep", step=1))
    v2, next_s = measure.timed(lambda: store.commit(pair.v2, run="sweep", step=2))
    v3, same_s = measure.timed(lambda: store.commit(pair.v2, run="sweep", step=3))
    restored, restore_s = measure.timed(lambda: store.restore(v2.id))
    restore_ok = measure.trees_equal(pair.v2, restored)
    del restored
    tensor, one_s = measure.timed(lambda: store.load_tensor(v2.id, largest))
    expected = dict(measure.tensor_leaves(pair.v2))[largest]
    one_ok = measure.leaf_equal(expected, tensor)
    del tensor
    return {
        "first_s": first_s, "next_s": next_s, "unchanged_s": same_s, "restore_s": restore_s,
        "one_tensor_s": one_s, "verified": restore_ok and one_ok,
        "first": _version(v1), "next": _version(v2), "unchanged": _version(v3),
        "catalog_v1": _catalog_view(store, v1.id), "catalog_v2": _catalog_view(store, v2.id),
        "stats": {k: v for k, v in store.ops.stats().to_dict().items()
                  if k in ("chunks", "packs", "unique_bytes", "stored_bytes", "pack_bytes")},
    }


def run_local(pair: StatePair, config: Config, workdir: Path, largest: str) -> dict[str, Any]:
    """One configuration on the local disk, in a fresh store that is removed afterwards."""
    where = workdir / "store"
    shutil.rmtree(where, ignore_errors=True)
    with _env(_compression_env(config)):
        store = casckpt.open(where, chunk_size=config.chunk_size, pack_size=config.pack_size)
    try:
        with store:
            out = run_store(pair, store, largest)
        out["catalog_db_bytes"] = _dir_bytes(where, "catalog.db*")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- S3


S3_JOBS = (  # (workload, pack size, compress): pack sizes with the default policy, then compression
    ("dense", 16 * MiB, True), ("dense", 64 * MiB, True), ("dense", 128 * MiB, True),
    ("dense", 64 * MiB, False), ("dense-bf16", 64 * MiB, True), ("dense-bf16", 64 * MiB, False),
)


def run_s3(pairs: dict[str, StatePair], jobs: list[tuple[str, int, bool]], chunk_size: int,
           workdir: Path, repeats: int, log: Log) -> dict[str, Any]:
    """Per job: raw boto3 upload/download of the state's bytes vs casckpt, on moto.

    Each round uploads the raw objects (the state's bytes cut at the pack size),
    downloads them, then commits v1 and v2 to a fresh store on the bucket,
    re-commits v2, restores v2 and loads its largest tensor; then deletes it all.
    """
    from benchmarks.s3 import (
        BUCKET,
        casckpt_transfer_defaults,
        remove_prefix,
        s3_client,
        split_objects,
        transfer_config,
        warm_up,
    )
    from casckpt.testing.s3 import fake_aws_environment, moto_server

    defaults = casckpt_transfer_defaults()
    results: dict[str, Any] = {"transfer": defaults, "chunk_size": chunk_size, "configs": {}}
    with fake_aws_environment(workdir), moto_server() as endpoint:
        client = s3_client(endpoint, defaults)
        client.create_bucket(Bucket=BUCKET)
        warm_up(client)
        tconfig = transfer_config(defaults)
        extra = {"ChecksumAlgorithm": defaults["checksum"]} if defaults["checksum"] else {}
        for job, (name, pack, compress) in enumerate(jobs):
            pair = pairs[name]
            largest = pair.info["largest_tensor"]["path"]
            logical = pair.info["logical_bytes"]
            config = Config(chunk_size, pack, compress)
            label = f"{name} {config.label}"
            objects = split_objects((measure.raw_bytes(t) for _, t in measure.tensor_leaves(pair.v1)), pack)
            rounds = []
            for r in range(repeats):
                log(f"s3: {label} round {r + 1}/{repeats}")
                keys = [f"raw-{job}-{r}/{i:05d}" for i in range(len(objects))]

                def up(keys: list[str] = keys, objects: list[bytes] = objects) -> None:
                    for key, body in zip(keys, objects, strict=True):
                        client.upload_fileobj(io.BytesIO(body), BUCKET, key, ExtraArgs=extra,
                                              Config=tconfig)

                def down(keys: list[str] = keys) -> int:
                    total = 0
                    for key in keys:
                        buf = io.BytesIO()
                        client.download_fileobj(BUCKET, key, buf, Config=tconfig)
                        total += buf.getbuffer().nbytes
                    return total

                raw_up = measure.timed(up)[1]
                got, raw_down = measure.timed(down)
                where = workdir / f"s3-{job}-{r}"
                prefix = f"ckpt-{job}-{r}"
                with _env(_compression_env(config)):
                    store = casckpt.open(where / "store", blobs=f"s3://{BUCKET}/{prefix}",
                                         cache=where / "cache", pack_size=pack, chunk_size=chunk_size,
                                         s3={"endpoint_url": endpoint})
                with store:
                    out = run_store(pair, store, largest)
                count, nbytes = remove_prefix(client, prefix + "/")
                remove_prefix(client, f"raw-{job}-{r}/")
                shutil.rmtree(where, ignore_errors=True)
                out.update({"raw_upload_s": raw_up, "raw_download_s": raw_down,
                            "raw_download_ok": got == logical, "objects": count,
                            "object_bytes": nbytes, "raw_objects": len(objects)})
                rounds.append(out)
            objects = []  # free the copy before the next job
            med = {k: _median([rd[k] for rd in rounds]) for k in
                   ("raw_upload_s", "raw_download_s", "first_s", "next_s", "unchanged_s",
                    "restore_s", "one_tensor_s")}
            results["configs"][label] = {"workload": name, "config": asdict(config),
                                         "logical_bytes": logical, "median": med, "rounds": rounds}
        client.close()
    return results


# --------------------------------------------------------------------------- driver


def _ratios(run: dict[str, Any], base: dict[str, Any], logical: int) -> dict[str, float]:
    return {
        "first_vs_save": run["first_s"] / base["save_s"],
        "next_vs_save": run["next_s"] / base["save_s"],
        "unchanged_vs_save": run["unchanged_s"] / base["save_s"],
        "restore_vs_load": run["restore_s"] / base["load_s"],
        "one_tensor_vs_restore": run["one_tensor_s"] / run["restore_s"],
        "first_stored_vs_logical": run["first"]["stored_bytes"] / logical,
        "next_new_vs_logical": run["next"]["new_bytes"] / logical,
        "next_stored_vs_logical": run["next"]["stored_bytes"] / logical,
    }


def sweep_workload(name: str, scale: float, workdir: Path, repeats: int, quick: bool,
                   log: Log) -> dict[str, Any]:
    """Every local configuration for workload ``name``."""
    started = time.perf_counter()
    pair = build_pair(name, scale)
    info = pair.info
    largest = info["largest_tensor"]["path"]
    log(f"{name}: {_size(info['logical_bytes'])} logical, {info['tensors']} tensors, "
        f"changed tensors {_size(info['changed_tensor_bytes'])}, built in "
        f"{time.perf_counter() - started:.1f}s")
    profile = chunk_profile(pair)
    codecs = codec_profile(pair)
    base = baseline(pair.v2, workdir, largest)
    log(f"{name}: torch.save {base['save_s']:.3f}s torch.load {base['load_s']:.3f}s")
    runs = []
    configs = configs_for(name, quick)
    for rep in range(repeats):
        order = configs if rep % 2 == 0 else list(reversed(configs))
        for config in order:
            run = run_local(pair, config, workdir, largest)
            runs.append({"config": asdict(config), "label": config.label, "repeat": rep, **run})
            log(f"{name}: {config.label}: first {run['first_s']:.3f}s next {run['next_s']:.3f}s "
                f"unchanged {run['unchanged_s']:.3f}s restore {run['restore_s']:.3f}s "
                f"one {run['one_tensor_s']:.3f}s new {_size(run['next']['new_bytes'])} "
                f"stored {_size(run['next']['stored_bytes'])} "
                f"manifest {_size(run['catalog_v2']['manifest_bytes'])}"
                f"{'' if run['verified'] else ' NOT VERIFIED'}")
    summary = []
    for config in configs:
        mine = [r for r in runs if r["config"] == asdict(config)]
        med = {k: _median([r[k] for r in mine]) for k in
               ("first_s", "next_s", "unchanged_s", "restore_s", "one_tensor_s")}
        row = {**mine[0], **med, "verified": all(r["verified"] for r in mine)}
        row.pop("repeat", None)
        summary.append({"label": config.label, "config": asdict(config),
                        "ratios": _ratios(row, base, info["logical_bytes"]), **row})
    out = {"name": name, "info": info, "baseline": base, "profile": profile, "codecs": codecs,
           "configs": summary, "runs": runs, "duration_s": time.perf_counter() - started}
    return out


def _print_table(result: dict[str, Any]) -> None:
    info = result["info"]
    print(f"\n== {result['name']}: {_size(info['logical_bytes'])} logical, "
          f"torch.save {result['baseline']['save_s']:.3f}s, torch.load {result['baseline']['load_s']:.3f}s")
    head = (f"{'config':34} {'first/sv':>8} {'next/sv':>8} {'same/sv':>8} {'rest/ld':>8} "
            f"{'one/rst':>8} {'new%':>7} {'stored%':>8} {'1st st%':>8} {'manif':>8} {'chunks':>7}")
    print(head)
    for row in result["configs"]:
        r = row["ratios"]
        print(f"{row['label']:34} {r['first_vs_save']:8.2f} {r['next_vs_save']:8.2f} "
              f"{r['unchanged_vs_save']:8.2f} {r['restore_vs_load']:8.2f} "
              f"{r['one_tensor_vs_restore']:8.3f} {100 * r['next_new_vs_logical']:7.2f} "
              f"{100 * r['next_stored_vs_logical']:8.2f} {100 * r['first_stored_vs_logical']:8.2f} "
              f"{_size(row['catalog_v2']['manifest_bytes']):>8} {row['catalog_v2']['chunk_refs']:7d}")
    prof = result["profile"]
    print("chunk-change profile (new bytes % of logical): " + ", ".join(
        f"{_size(int(s))}: {100 * v['new_bytes'] / info['logical_bytes']:.2f}%"
        for s, v in prof["by_chunk_size"].items()))
    print("codec sample (1 MiB chunks, one core): " + "; ".join(
        f"{role} {'/'.join(r['dtype'])}: zstd1 saves {100 * r['zstd1_saving']:.1f}% "
        f"({100 * r['zstd1_compressed_chunk_fraction']:.0f}% of chunks) "
        f"at {r['zstd1_encode_MBps']:.0f} MB/s, "
        f"zstd3 {100 * r['zstd3_saving']:.1f}% at {r['zstd3_encode_MBps']:.0f} MB/s"
        for role, r in result["codecs"]["roles"].items()))
    print("rules: " + ", ".join(f"{k}: {100 * v['new_bytes'] / info['logical_bytes']:.2f}% "
                                f"({v['chunks']} chunks)" for k, v in prof["rules"].items()))


def _print_s3(result: dict[str, Any]) -> None:
    print(f"\n== s3 (moto, loopback), chunk {_size(result['chunk_size'])}")
    print(f"{'config':46} {'raw up MB/s':>11} {'commit/up':>9} {'next/up':>8} {'raw dn MB/s':>11} "
          f"{'restore/dn':>10} {'one s':>7} {'stored%':>7} {'objects':>7} {'raw obj':>7}")
    for label, entry in result["configs"].items():
        m, rd, logical = entry["median"], entry["rounds"][0], entry["logical_bytes"]
        print(f"{label:46} {logical / MB / m['raw_upload_s']:11.1f} "
              f"{m['first_s'] / m['raw_upload_s']:9.2f} {m['next_s'] / m['raw_upload_s']:8.2f} "
              f"{logical / MB / m['raw_download_s']:11.1f} {m['restore_s'] / m['raw_download_s']:10.2f} "
              f"{m['one_tensor_s']:7.3f} {100 * rd['first']['stored_bytes'] / logical:7.1f} "
              f"{rd['objects']:7d} {rd['raw_objects']:7d}")


def _s3_configs(s3: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The S3 entries of a sweep file by label (files of the first format had pack sizes only)."""
    if not s3:
        return {}
    if "configs" in s3:
        return dict(s3["configs"])
    return {f"dense {Config(s3['chunk_size'], int(pack), True).label}":
            {"logical_bytes": s3["logical_bytes"], **entry}
            for pack, entry in s3["by_pack_size"].items()}


def combine(paths: list[Path]) -> str:
    """Markdown tables of several sweep JSON files: per config, the median over runs of each ratio.

    Each ratio is first taken within its own run (against that run's baseline),
    then the median over runs is shown; ``spread`` is max/min of the first-commit
    ratio over runs (how noisy the machine was).
    """
    docs = [json.loads(p.read_text()) for p in paths]
    scales = {d["scale"] for d in docs}
    if len(scales) > 1:
        raise SystemExit(f"--combine needs runs of one scale, got {sorted(scales)}")
    lines: list[str] = []
    names = [n for n in WORKLOADS if any(n in d["workloads"] for d in docs)]
    for name in names:
        results = [d["workloads"][name] for d in docs if name in d["workloads"]]
        info, n_runs = results[0]["info"], len(results)
        saves = [r["baseline"]["save_s"] for r in results]
        loads = [r["baseline"]["load_s"] for r in results]
        lines += ["", f"### {name}: {_size(info['logical_bytes'])} logical, {info['tensors']} tensors "
                  f"({n_runs} runs; torch.save {min(saves):.2f}-{max(saves):.2f} s, "
                  f"torch.load {min(loads):.2f}-{max(loads):.2f} s)", "",
                  "| config | first / save | next / save | unchanged / save | restore / load | "
                  "one tensor / restore | next new | next stored | first stored | manifest | chunks "
                  "| spread |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in results[0]["configs"]:
            same = [c for r in results for c in r["configs"] if c["label"] == row["label"]]
            med = {k: _median([c["ratios"][k] for c in same]) for k in row["ratios"]}
            firsts = [c["ratios"]["first_vs_save"] for c in same]
            lines.append(
                f"| {row['label']} | {med['first_vs_save']:.2f} | {med['next_vs_save']:.2f} | "
                f"{med['unchanged_vs_save']:.2f} | {med['restore_vs_load']:.2f} | "
                f"{med['one_tensor_vs_restore']:.3f} | {100 * med['next_new_vs_logical']:.1f}% | "
                f"{100 * med['next_stored_vs_logical']:.1f}% | {100 * med['first_stored_vs_logical']:.1f}% | "
                f"{_size(row['catalog_v2']['manifest_bytes'])} | {row['catalog_v2']['chunk_refs']} | "
                f"{max(firsts) / min(firsts):.2f} |")
    entries: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        for label, entry in _s3_configs(d.get("s3")).items():
            entries.setdefault(label, []).append(entry)
    if entries:
        lines += ["", "### s3 (moto on loopback), 1 MiB chunks", "",
                  "| workload, config | rounds | raw upload MB/s | first commit / raw upload | "
                  "next commit / raw upload | raw download MB/s | restore / raw download | "
                  "one tensor (s) | first stored | objects written | raw objects |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, group in entries.items():
            logical = group[0]["logical_bytes"]
            rds = [rd for e in group for rd in e["rounds"]]
            up = _median([rd["raw_upload_s"] for rd in rds])
            down = _median([rd["raw_download_s"] for rd in rds])
            lines.append(
                f"| {label} | {len(rds)} | {logical / MB / up:.0f} | "
                f"{_median([rd['first_s'] / rd['raw_upload_s'] for rd in rds]):.2f} | "
                f"{_median([rd['next_s'] / rd['raw_upload_s'] for rd in rds]):.2f} | "
                f"{logical / MB / down:.0f} | "
                f"{_median([rd['restore_s'] / rd['raw_download_s'] for rd in rds]):.2f} | "
                f"{_median([rd['one_tensor_s'] for rd in rds]):.3f} | "
                f"{100 * rds[0]['first']['stored_bytes'] / logical:.1f}% | {rds[0]['objects']} | "
                f"{rds[0]['raw_objects']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; write JSON; print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/sweep.json")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where temporary stores and baseline files go (a real disk)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every local config")
    parser.add_argument("--s3-repeats", type=int, default=2)
    parser.add_argument("--s3-packs", default=",".join(str(p // MiB) for p in PACK_SIZES),
                        help="pack sizes in MiB for the S3 part")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--quick", action="store_true", help="two chunk sizes only (smoke test)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="print markdown tables (medians over runs) of earlier sweep files; run nothing")
    args = parser.parse_args(argv)
    if args.combine:
        print(combine(args.combine), end="")
        return 0

    started = time.perf_counter()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix=".casckpt-sweep-", dir=args.dir))
    names = [n for n in args.workloads.split(",") if n]
    doc: dict[str, Any] = {
        "schema": "casckpt-sweep/1", "started_at": datetime.now(timezone.utc).isoformat(),
        "scale": args.scale, "repeats": args.repeats, "workdir": str(workdir),
        "cpus": os.cpu_count(), "torch": torch.__version__, "workloads": {}, "errors": {},
    }
    try:
        from benchmarks.machine import machine_info

        doc["machine"] = machine_info(workdir, REPO_ROOT)
    except Exception as exc:  # noqa: BLE001 - machine info is a nicety
        doc["machine"] = {"error": repr(exc)}
    failed = False
    try:
        for name in names:
            try:
                result = sweep_workload(name, args.scale, workdir, args.repeats, args.quick, log)
                doc["workloads"][name] = result
                _print_table(result)
            except Exception:  # noqa: BLE001 - report and go on with the others
                failed = True
                doc["errors"][name] = traceback.format_exc()
                traceback.print_exc()
            measure.release_memory()
        if not args.no_s3:
            try:
                packs = {int(p) * MiB for p in args.s3_packs.split(",") if p}
                jobs = [j for j in S3_JOBS if j[1] in packs]
                pairs = {}
                for name in dict.fromkeys(j[0] for j in jobs):
                    log(f"s3: building the {name} state")
                    pairs[name] = build_pair(name, args.scale)
                doc["s3"] = run_s3(pairs, jobs, DEFAULT_CHUNK, workdir, args.s3_repeats, log)
                _print_s3(doc["s3"])
            except Exception:  # noqa: BLE001
                failed = True
                doc["errors"]["s3"] = traceback.format_exc()
                traceback.print_exc()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        doc["duration_s"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nwrote {args.out}; sweep took {doc['duration_s']:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
