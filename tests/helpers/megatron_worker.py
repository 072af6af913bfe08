"""Megatron-Core ``dist_checkpointing`` scenarios on gloo ranks: ``python megatron_worker.py --zygote``.

The ranks are forked as in dist_worker.py (same protocol); the zygote also imports
Megatron-Core once. The sharded state is the smallest kind Megatron's own
dist_checkpointing tests build: ``ShardedTensor.from_rank_offsets`` pieces of global
tensors (split on dim 0, on dim 1, replicated) and ``ShardedObject`` values, as a
tensor-parallel layout of ``world`` ranks would hold them. ``device`` "cuda" in a scenario's
args puts them on the rank's GPU (a job with ``backend`` "nccl"), where Megatron's own
torch_dist save strategy runs (on CPU, CpuTorchDist stands in for it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: E402
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.models.gpt import gpt_model  # noqa: E402, F401  (imported once, in the zygote)
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402
from dist_worker import CHUNK, PACK, bits  # noqa: E402
from exact import exact_differences  # noqa: E402

import casckpt  # noqa: E402
from casckpt.integrations.megatron import CasckptLoadStrategy, CasckptSaveStrategy  # noqa: E402


def full_tensors(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """The global tensors: rows and columns divisible by 1, 2 and 4 ranks (``scale`` times the
    rows of the two largest, for timings)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "decoder.w": torch.randn(1024 * scale, 96, generator=g),  # split on dim 0 (column parallel)
        "decoder.proj": torch.randn(64, 512, generator=g).to(torch.bfloat16),  # dim 1 (row parallel)
        "decoder.norm": torch.randn(96, generator=g),  # replicated
        "optimizer.exp_avg": torch.randn(1024 * scale, 96, generator=g),  # dim 0
    }


SPLIT = {"decoder.w": 0, "decoder.proj": 1, "optimizer.exp_avg": 0}


def sharded_state(tensors: dict[str, torch.Tensor], rank: int, world: int, *,
                  axis: dict[str, int] | None = None, objects: bool = True,
                  seed: int = 0) -> dict[str, Any]:
    """This rank's sharded state dict: pieces of ``tensors`` split as ``axis`` says (SPLIT by default)."""
    axis = SPLIT if axis is None else axis
    out: dict[str, Any] = {"model": {}, "optimizer": {}}
    for key, tensor in tensors.items():
        group, _, name = key.partition(".")
        dim = axis.get(key)
        if dim is None:
            piece = ShardedTensor.from_rank_offsets(key, tensor.clone(), replica_id=rank)
        else:
            local = tensor.chunk(world, dim)[rank].clone()
            piece = ShardedTensor.from_rank_offsets(key, local, (dim, rank, world))
        out["model" if group == "decoder" else "optimizer"][name] = piece
    shared = {"iteration": 100 + seed, "lr": 3e-4, "betas": (0.9, 0.95), "name": f"s{seed}"}
    out["shared"] = ShardedObject("shared", shared, (1,), (0,), replica_id=rank)
    if objects:  # one object per rank (as Megatron keeps each TP rank's RNG): same world only
        out["per_rank"] = ShardedObject("per_rank", {"rank": rank, "seed": seed}, (world,), (rank,))
    return out


def expected(tensors: dict[str, torch.Tensor], rank: int, world: int, axis: dict[str, int] | None,
             objects: bool, seed: int) -> dict[str, Any]:
    state = sharded_state(tensors, rank, world, axis=axis, objects=objects, seed=seed)
    return {"model": {k: v.data for k, v in state["model"].items()},
            "optimizer": {k: v.data for k, v in state["optimizer"].items()},
            "shared": state["shared"].data,
            **({"per_rank": state["per_rank"].data} if objects else {})}


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        return [] if same and bits(got) == bits(want) else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [where]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    return [] if got == want else [where]


class CpuTorchDist(TorchDistSaveShardedStrategy):  # type: ignore[misc]
    """Megatron's torch_dist format, written by DCP's own FileSystemWriter: torch_dist's writer
    (FileSystemWriterAsync) and its finalize step call ``torch.cuda`` unconditionally, which a
    CPU-only torch refuses. The conversion and the planner are torch_dist's; the files are
    what torch_dist's load strategy (which runs on CPU) reads."""

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=FileSystemWriter(checkpoint_dir),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))


def open_store(args: dict[str, Any]) -> casckpt.Store:
    """The store, with small chunks and packs unless ``args["open"]`` says otherwise."""
    return casckpt.open(args["path"], **{"chunk_size": CHUNK, "pack_size": PACK, **args.get("open", {})})


def _killing_save(strategy: CasckptSaveStrategy, rank: int, kill: int) -> None:
    """Kill rank ``kill`` once it is writing its part (the other rank has begun too)."""
    writer_save = strategy.save

    def save(sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        if rank == kill:
            import casckpt.dcp as casckpt_dcp

            original = casckpt_dcp.save_pieces

            def dying(*a: Any, **k: Any) -> Any:
                original(*a, **k)  # its chunks are written, the version not published
                os.kill(os.getpid(), signal.SIGKILL)

            casckpt_dcp.save_pieces = dying  # type: ignore[assignment]
        writer_save(sharded_state_dict, checkpoint_dir)

    strategy.save = save  # type: ignore[method-assign]


def scenario_mc_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    tensors = on_device(full_tensors(args["seed"], args.get("scale", 1)), args)
    state = sharded_state(tensors, rank, world, objects=args.get("objects", True), seed=args["seed"])
    state["iteration"] = 100 + args["seed"]  # a common (non-sharded) value: Megatron's common.pt
    folder = Path(args["dir"])
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if args.get("strategy") == "torch_dist":
        began, wall = time.process_time(), time.perf_counter()
        torch_dist = TorchDistSaveShardedStrategy if args.get("device") == "cuda" else CpuTorchDist
        dist_checkpointing.save(state, str(folder), sharded_strategy=torch_dist("torch_dist", 1))
        return {"cpu": time.process_time() - began, "wall": time.perf_counter() - wall}
    with open_store(args) as store:
        strategy = CasckptSaveStrategy(store, run=args["run"], step=args.get("step"),
                                       keep_only_main_replica=args.get("main_only", True))
        if "kill" in args:
            _killing_save(strategy, rank, args["kill"])
        began, wall = time.process_time(), time.perf_counter()
        dist_checkpointing.save(state, str(folder), sharded_strategy=strategy)
        return {"cpu": time.process_time() - began, "wall": time.perf_counter() - wall}


def on_device(tensors: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    device = args.get("device", "cpu")
    return tensors if device == "cpu" else {k: v.to(device) for k, v in tensors.items()}


def _devices(loaded: dict[str, Any]) -> list[str]:
    return sorted({str(v.device) for group in ("model", "optimizer") for v in loaded[group].values()})


def scenario_mc_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    tensors = on_device(full_tensors(args["seed"], args.get("scale", 1)), args)
    axis = args.get("axis")
    objects = args.get("objects", True)
    template = sharded_state({k: torch.zeros_like(v) for k, v in tensors.items()}, rank, world,
                             axis=axis, objects=objects, seed=-1)
    want = expected(tensors, rank, world, axis, objects, args["seed"])
    if args.get("strategy") == "torch_dist":
        loaded = dist_checkpointing.load(template, args["dir"])
        return {"bad": differences({k: loaded[k] for k in want}, want), "iteration": loaded["iteration"],
                "devices": _devices(loaded)}
    with open_store(args) as store:
        strategy = CasckptLoadStrategy(store, args.get("ref"))
        loaded = dist_checkpointing.load(template, args["dir"], sharded_strategy=strategy)
        shapes = {k: [list(v.global_shape), str(v.dtype)] for k, v in
                  dist_checkpointing.load_tensors_metadata(args["dir"], strategy).items()}
    return {"bad": differences({k: loaded[k] for k in want}, want), "iteration": loaded["iteration"],
            "shapes": shapes, "devices": _devices(loaded)}


def tiny_gpt(seed: int) -> torch.nn.Module:
    """A 2-layer GPTModel (local layer spec: no Transformer Engine), initialised on the CPU,
    tensor-parallel over every rank of the group."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32,
                               tensor_model_parallel_size=dist.get_world_size())
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=256, max_sequence_length=32)


def digests(model: torch.nn.Module) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(bits(v)).hexdigest() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)}


def scenario_mc_gpt(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save a tiny GPTModel's sharded state (``seed``), or load one into a model built from
    another seed; the digests of this rank's parameters either way."""
    torch_dist = args.get("strategy") == "torch_dist"
    with open_store(args) as store:
        if args["action"] == "save":
            model = tiny_gpt(args["seed"])
            if rank == 0:
                Path(args["dir"]).mkdir(parents=True)
            dist.barrier()
            strategy = CpuTorchDist("torch_dist", 1) if torch_dist else CasckptSaveStrategy(store, "gpt")
            dist_checkpointing.save(model.sharded_state_dict(), args["dir"], sharded_strategy=strategy)
            return {"digests": digests(model)}
        model = tiny_gpt(args["seed"] + 1000)
        before = digests(model)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), args["dir"],
                                         sharded_strategy=None if torch_dist else CasckptLoadStrategy(store))
        model.load_state_dict(loaded)
        return {"digests": digests(model), "before": before}


def _error(call: Any) -> list[str] | None:
    try:
        call()
    except casckpt.errors.CasckptError as exc:
        return [type(exc).__name__, str(exc)]
    return None


def scenario_mc_refusals(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """What the strategies refuse, each before anything is published."""
    tensors = full_tensors(1)
    folder = Path(args["dir"])
    folder.mkdir(parents=True)
    with open_store(args) as store:
        def holding_tensor() -> None:
            state = sharded_state(tensors, rank, world, objects=False)
            state["rng"] = ShardedObject("rng", {"dtype": torch.float32}, (1,), (0,))
            dist_checkpointing.save(state, str(folder), sharded_strategy=CasckptSaveStrategy(store, "gpt", 1))

        def without_step() -> None:
            dist_checkpointing.save(sharded_state(tensors, rank, world, objects=False), str(folder),
                                    sharded_strategy=CasckptSaveStrategy(store, "gpt"))

        def never_saved() -> None:
            (folder / "metadata.json").write_text(json.dumps(
                {"sharded_backend": "casckpt", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}))
            dist_checkpointing.load(sharded_state(tensors, rank, world, objects=False), str(folder),
                                    sharded_strategy=CasckptLoadStrategy(store))

        return {"object_with_tensor": _error(holding_tensor), "no_step": _error(without_step),
                "never_saved": _error(never_saved)}


def scenario_mc_bad_key(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Only the last rank's object has a key no version may hold ('/'): every rank must fail."""
    state = sharded_state(full_tensors(1), rank, world, objects=False)
    bad = {"loader/state": 1} if rank == world - 1 else {"loader_state": 1}
    state["loader"] = ShardedObject("loader", bad, (world,), (rank,), replica_id=0)
    folder = Path(args["dir"])
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    with open_store(args) as store:
        began = time.perf_counter()
        error = _error(lambda: dist_checkpointing.save(state, str(folder),
                                                       sharded_strategy=CasckptSaveStrategy(store, "gpt")))
        return {"error": error, "wall": time.perf_counter() - began}


def rng_state(rank: int, seed: int) -> list[dict[str, Any]]:
    """What Megatron's training loop saves as ``rng_state`` (megatron/training/checkpointing.py
    ``get_rng_state``): Python's, numpy's and torch's RNG states and the tensor-parallel
    tracker's (the CUDA states are uint8 tensors like the CPU one), one dict per DP rank."""
    import random

    import numpy as np

    random.seed(seed * 10 + rank)
    np.random.seed(seed * 10 + rank)
    before = torch.get_rng_state()
    torch.manual_seed(seed * 10 + rank)
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state()[:16].clone(),
             "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()[-16:].clone(),
                                    "expert-parallel-rng": torch.arange(rank, rank + 16, dtype=torch.uint8)}}
    torch.set_rng_state(before)
    return [state]


def extra_state(layer: int, seed: int) -> Any:
    """A Transformer Engine layer's ``_extra_state``: TE 2's uint8 tensor of its (pickled) FP8
    metadata, TE 2's empty tensor without FP8, or TE 1's ``io.BytesIO``."""
    import io

    payload = bytes((seed + layer + i) % 256 for i in range(200 + layer))
    if layer == 0:
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if layer == 1:
        return torch.empty(0, dtype=torch.uint8)
    buffer = io.BytesIO(payload)
    buffer.seek(len(payload))  # where torch.save leaves it
    return buffer


def mixed_object(rank: int, seed: int) -> dict[Any, Any]:
    """Every other kind of leaf an object may hold (an optimizer's scalars and tensors)."""
    import numpy as np

    return {0: (None, True, -0.0, float("nan"), 2**70, b"\x00\xff"), "step": seed,
            "exp_avg": [torch.full((3, 2), seed + rank, dtype=torch.bfloat16), torch.tensor(1.5)],
            "mask": np.array([[True, False]]), "ids": np.arange(4, dtype=np.int16)[::2],
            "shared": torch.ones(0, 3), "name": "adam",
            "transposed": torch.arange(6, dtype=torch.int64).reshape(2, 3).t()}  # not contiguous


def object_state(rank: int, world: int, seed: int, rng_from: list[int] | None = None,
                 saved_world: int | None = None) -> dict[str, Any]:
    """Objects holding tensors as a TP layout of ``world`` ranks holds them: RNG states and
    mixed objects, one per rank (this rank holds those of the saving ranks ``rng_from``, of
    ``saved_world``), and three layers' ``_extra_state`` replicated over TP (saved by TP rank 0)."""
    rng_from = [rank] if rng_from is None else rng_from
    saved_world = world if saved_world is None else saved_world
    out: dict[str, Any] = {}
    for r in rng_from:
        out[f"rng_state{r}"] = ShardedObject("rng_state", rng_state(r, seed), (1, saved_world), (0, r),
                                             replica_id=0)
        out[f"mixed{r}"] = ShardedObject("mixed", mixed_object(r, seed), (saved_world,), (r,))
    for layer in range(3):
        key = "decoder.layers.linear_qkv._extra_state"  # one per layer, replicated over TP
        out[f"layer{layer}"] = ShardedObject(key, extra_state(layer, seed), (3,), (layer,),
                                             replica_id=(0, rank, 0))
    return out


def scenario_mc_objects(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save objects holding tensors (with the usual sharded tensors), or load them into a
    template of empty objects on any number of ranks; ``rng_from`` maps each loading rank to
    the saving rank whose RNG state it asks for (``saved_world`` ranks saved)."""
    tensors = full_tensors(args["seed"])
    folder = Path(args["dir"])
    with open_store(args) as store:
        if args["action"] == "save":
            state = {**sharded_state(tensors, rank, world, objects=False, seed=args["seed"]),
                     **object_state(rank, world, args["seed"])}
            if rank == 0:
                folder.mkdir(parents=True)
            dist.barrier()
            dist_checkpointing.save(state, str(folder), sharded_strategy=CasckptSaveStrategy(store, "gpt"))
            return {}
        rng_from = args.get("rng_from", [[r] for r in range(world)])[rank]
        want = object_state(rank, world, args["seed"], rng_from, args.get("saved_world"))
        template = {**sharded_state({k: torch.zeros_like(v) for k, v in tensors.items()}, rank, world,
                                    objects=False, seed=-1),
                    **{k: ShardedObject(v.key, None, v.global_shape, v.global_offset, replica_id=v.replica_id)
                       for k, v in want.items()}}
        strategy = CasckptLoadStrategy(store)
        loaded = dist_checkpointing.load(template, str(folder), sharded_strategy=strategy)
        bad = exact_differences({k: loaded[k] for k in want}, {k: v.data for k, v in want.items()})
        expect = expected(tensors, rank, world, None, False, args["seed"])
        return {"bad": bad + differences({k: loaded[k] for k in expect}, expect),
                "metadata": sorted(strategy.load_sharded_metadata(str(folder)))}


def scenario_mc_bad_object(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Only the last rank's object holds what casckpt cannot store without pickle (a torch.dtype
    key, as a distributed optimizer's per-dtype buffers have; or another object): every rank
    must fail, and no version appear."""
    state = {**sharded_state(full_tensors(1), rank, world, objects=False), **object_state(rank, world, 1)}
    kinds = {"dtype_key": {(torch.float32, torch.float32): [torch.ones(2)]}, "object": Path("/x")}
    bad = kinds[args["kind"]] if rank == world - 1 else {"ok": torch.ones(2)}
    state["optimizer_state"] = ShardedObject("optimizer_state", bad, (world,), (rank,), replica_id=0)
    folder = Path(args["dir"])
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    with open_store(args) as store:
        error = _error(lambda: dist_checkpointing.save(state, str(folder),
                                                       sharded_strategy=CasckptSaveStrategy(store, "gpt")))
        return {"error": error}


dist_worker.SCENARIOS.update({name.removeprefix("scenario_"): fn for name, fn in list(globals().items())
                              if name.startswith("scenario_")})

if __name__ == "__main__":
    if sys.argv[1:] != ["--zygote"]:
        sys.exit("usage: megatron_worker.py --zygote")
    dist_worker.main()
