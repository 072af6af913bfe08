"""The ``megatron`` workload: Megatron-Core ``dist_checkpointing`` through casckpt against torch_dist.

Two ranks (spawned processes, gloo on 127.0.0.1, one thread each) hold the state a 2-way
tensor-parallel layout of the ``dcp`` workload's model would: the decoder's weights (as
initialised) and AdamW-like ``exp_avg`` / ``exp_avg_sq`` (:func:`benchmarks.dcp.full_state`,
~1 GiB at scale 1.0), every matrix a ``ShardedTensor`` split in two (the attention's ``qkv``,
the MLP's first layer, the embeddings and the head on dim 0 as column / vocab parallel layers
are; ``proj`` and the MLP's second layer on dim 1, row parallel), every vector (norms, biases)
replicated on both ranks (``replica_id`` = rank: only rank 0's copy is saved), plus a
``ShardedObject`` of plain values and the iteration as a common value (Megatron's
``common.pt``). Each operation runs with Megatron's own ``dist_checkpointing.save`` / ``load``:

* **torch_dist**: Megatron's ``torch_dist`` format. Its save strategy calls ``torch.cuda``
  (its writer and finalize step), so the baseline is that strategy's conversion and planner
  with DCP's ``FileSystemWriter`` (fsync'd, one file per rank) writing the files, as in
  tests/helpers/megatron_worker.py; loads use ``torch_dist``'s own load strategy;
* **casckpt**: ``CasckptSaveStrategy`` / ``CasckptLoadStrategy`` on a store with default
  settings (what a user gets).

First torch_dist, then casckpt, in the same work directory; the clock starts after a GC and a
barrier, a figure is the slowest rank's. Operations: first save (step 1); load into zeroed
tensors of the same layout, checked bit for bit; a dense update of every element
(``x * 0.999 + 1e-7``), save (step 2); the same state saved again (step 3).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.dcp import dense_update, full_state, mismatches
from benchmarks.ranks import Clock, freeze_heap, launch, slowest
from benchmarks.workloads import ModelConfig

Log = Callable[[str], None]

NAME = "megatron"
RANKS = 2
RUN = "mcore"
KINDS = ("torch_dist", "casckpt")
OPERATIONS = ("first", "load", "dense", "unchanged")
ROW_PARALLEL = (".proj.", ".fc2.", ".mlp.2.")  # split on dim 1; every other matrix on dim 0


@dataclass(frozen=True)
class MegatronResult:
    """Every raw number: per operation and kind, the slowest rank's wall seconds (``seconds``),
    both ranks' CPU seconds together (``cpu``); ``versions``: casckpt's ``Version`` of each save;
    ``folder_bytes``: each torch_dist checkpoint directory; ``verified``: both loads bit-exact."""

    name: str
    model: dict[str, int]
    ranks: int
    tensors: int
    logical_bytes: int
    launch_s: float
    seconds: dict[str, dict[str, float]]
    cpu: dict[str, dict[str, float]]
    versions: dict[str, dict[str, Any]]
    folder_bytes: dict[str, int]
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


# ---- one rank -----------------------------------------------------------------------------------


def split_dim(key: str, tensor: torch.Tensor) -> int | None:
    """The dim a tensor-parallel layout splits ``key`` on; None: replicated (vectors, scalars)."""
    if tensor.dim() < 2:
        return None
    return 1 if any(part in f".{key}." for part in ROW_PARALLEL) else 0


def global_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every whole tensor, ``{megatron key: tensor}``: weights and moments (no scalar steps)."""
    state = full_state(cfg)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for k, moments in state["optim"]["state"].items():
        flat.update({f"optimizer.{k}.{m}": v for m, v in moments.items() if m != "step"})
    return flat


def local_state(cfg: ModelConfig, rank: int) -> dict[str, torch.Tensor]:
    """This rank's pieces of every tensor, ``{megatron key: local tensor}`` (replicas whole)."""
    out = {}
    for key, tensor in global_tensors(cfg).items():
        dim = split_dim(key, tensor)
        out[key] = tensor if dim is None else tensor.chunk(RANKS, dim)[rank].clone()
    return out


def sharded(local: Mapping[str, torch.Tensor], rank: int, iteration: int) -> dict[str, Any]:
    """Megatron's sharded state dict over the local pieces (views, no copies)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out: dict[str, Any] = {}
    for key, tensor in local.items():
        dim = split_dim(key, tensor)
        if dim is None:
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=rank)
        else:
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, (dim, rank, RANKS))
    shared = {"lr": 3e-4, "betas": (0.9, 0.95), "schedule": "cosine"}
    out["shared"] = ShardedObject("shared", shared, (1,), (0,), replica_id=rank)
    out["iteration"] = iteration  # a common value: dist_checkpointing.save puts it in common.pt
    return out


def _torch_dist_save(sharded_state_dict: Any, checkpoint_dir: str) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=_cpu_torch_dist())


def _cpu_torch_dist() -> Any:
    """torch_dist's conversion and planner, DCP's FileSystemWriter writing its files."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter

    class CpuTorchDist(TorchDistSaveShardedStrategy):  # type: ignore[misc]
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            dcp.save(mcore_to_pyt_state_dict(flat, False),
                     storage_writer=FileSystemWriter(checkpoint_dir, sync_files=True),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return CpuTorchDist("torch_dist", 1)


class _Rank:
    def __init__(self, rank: int, store: casckpt.Store, workdir: Path) -> None:
        self.rank, self.store, self.workdir = rank, store, workdir
        self.clock = Clock(torch.distributed.barrier)
        self.out: dict[str, Any] = {"rank": rank, "mismatches": {}, "versions": {}, "folder_bytes": {}}

    def folder(self, kind: str, step: int) -> str:
        path = self.workdir / kind / f"iter_{step:07d}"
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        return str(path)

    def save(self, label: str, local: Mapping[str, torch.Tensor], step: int) -> None:
        from megatron.core import dist_checkpointing

        from casckpt.integrations.megatron import CasckptSaveStrategy

        state = sharded(local, self.rank, step)
        where = self.folder("torch_dist", step)
        self.clock(f"{label}/torch_dist", lambda: _torch_dist_save(state, where))
        state, ours = sharded(local, self.rank, step), self.folder("casckpt", step)
        strategy = CasckptSaveStrategy(self.store, run=RUN)
        self.clock(f"{label}/casckpt",
                   lambda: dist_checkpointing.save(state, ours, sharded_strategy=strategy))
        torch.distributed.barrier()
        if self.rank == 0:
            self.out["versions"][label] = self.store.resolve(f"{RUN}@{step}").to_dict()
            self.out["folder_bytes"][label] = measure.path_bytes(Path(where))
            if label in ("dense", "unchanged"):  # the others stay for a load
                measure.remove(Path(where))

    def drop(self, step: int) -> None:
        """Delete torch_dist's folder of ``step`` once every rank is done with it."""
        torch.distributed.barrier()
        if self.rank == 0:
            measure.remove(self.workdir / "torch_dist" / f"iter_{step:07d}")

    def load(self, label: str, local: Mapping[str, torch.Tensor], step: int) -> None:
        from megatron.core import dist_checkpointing

        from casckpt.integrations.megatron import CasckptLoadStrategy

        template = {k: torch.zeros_like(v) for k, v in local.items()}
        for kind in KINDS:
            where = str(self.workdir / kind / f"iter_{step:07d}")
            strategy = CasckptLoadStrategy(self.store) if kind == "casckpt" else None
            target = sharded({k: v.clone() for k, v in template.items()}, self.rank, -1)
            loaded = self.clock(f"{label}/{kind}", lambda: dist_checkpointing.load(
                target, where, sharded_strategy=strategy))  # noqa: B023  (called at once)
            got = {k: loaded[k] for k in local}
            self.out["mismatches"][f"{label}/{kind}"] = (
                mismatches(dict(local), got) + ([] if loaded["iteration"] == step else ["iteration"]))
            del loaded, got


def rank_steps(rank: _Rank, cfg: ModelConfig) -> None:
    """Warm-up (untimed), then first save, load, dense update + save, unchanged save."""
    local = local_state(cfg, rank.rank)
    freeze_heap()
    tiny = {"model.warmup": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
    warm = {k: v.chunk(RANKS, 0)[rank.rank].clone() for k, v in tiny.items()}
    rank.save("warmup", warm, 0)
    rank.load("warmup", warm, 0)
    rank.drop(0)
    rank.save("first", local, 1)
    rank.load("load", local, 1)
    rank.drop(1)
    dense_update({"state": dict(local)})
    rank.save("dense", local, 2)
    rank.save("unchanged", local, 3)


def rank_main(rank: int, port: int, cfg: ModelConfig, workdir: Path) -> None:
    """One rank's process: join the group, run the operations, write JSON."""
    warnings.simplefilter("ignore")  # Megatron's and DCP's notices would flood the console
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=RANKS, timeout=timedelta(seconds=1800))
    try:
        with casckpt.open(workdir / "store") as store:
            r = _Rank(rank, store, workdir)
            rank_steps(r, cfg)
        r.out["seconds"], r.out["cpu"] = r.clock.seconds, r.clock.cpu
        (workdir / f"rank-{rank}.json").write_text(json.dumps(r.out, default=str))
    finally:
        torch.distributed.destroy_process_group()


# ---- the benchmark process ----------------------------------------------------------------------


def run_megatron(scale: float, workdir: Path, log: Log) -> MegatronResult:
    """Measure the ``megatron`` workload at ``scale``; ``workdir`` must be an empty directory."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            import megatron.core  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("the megatron workload needs Megatron-Core: pip install 'casckpt[megatron]'"
                           ) from exc
    cfg = ModelConfig.for_scale(scale)
    casckpt.open(workdir / "store").close()  # created once, before the ranks open it
    whole = global_tensors(cfg)
    tensors, logical = len(whole), sum(t.nbytes for t in whole.values())
    del whole
    log(f"{NAME}: {RANKS} ranks (spawned, gloo), TP-2 sharded state ({measure.fmt_bytes(logical)}): "
        "first save, load, save after a dense update, unchanged save; torch_dist, then casckpt")
    start = time.perf_counter()
    ranks = launch(rank_main, (cfg, workdir), workdir, RANKS, 300 + 1800 * scale, NAME)
    bad = {f"rank {r['rank']} {k}": v for r in ranks for k, v in r["mismatches"].items() if v}
    if bad:
        raise RuntimeError(f"megatron: a load differs from the saved state: {bad}")
    seconds = {op: {k: slowest(ranks, f"{op}/{k}") for k in KINDS} for op in OPERATIONS}
    cpu = {op: {k: sum(r["cpu"][f"{op}/{k}"] for r in ranks) for k in KINDS} for op in OPERATIONS}
    lead = ranks[0]
    return MegatronResult(NAME, dataclasses.asdict(cfg), RANKS, tensors, logical,
                          time.perf_counter() - start, seconds, cpu,
                          {k: v for k, v in lead["versions"].items() if k != "warmup"},
                          {k: v for k, v in lead["folder_bytes"].items() if k != "warmup"}, True)


def _ratio(op: str, field: str = "seconds") -> Callable[[MegatronResult], float | None]:
    def compute(r: MegatronResult) -> float | None:
        times: dict[str, float] = getattr(r, field)[op]
        return times["casckpt"] / times["torch_dist"] if times["torch_dist"] else None
    return compute


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[MegatronResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("save_first_vs_torch_dist", "save, first, 2 ranks / torch_dist", "ratio", _ratio("first")),
    Measure("save_first_cpu_vs_torch_dist", "save, first: CPU seconds / torch_dist's", "ratio",
            _ratio("first", "cpu")),
    Measure("load_vs_torch_dist", "load, verified, 2 ranks / torch_dist", "ratio", _ratio("load")),
    Measure("save_dense_vs_torch_dist", "save after a dense update / torch_dist", "ratio", _ratio("dense")),
    Measure("save_unchanged_vs_torch_dist", "save, unchanged / torch_dist", "ratio", _ratio("unchanged")),
    Measure("new_unchanged_of_logical", "save, unchanged: new bytes / logical", "fraction",
            lambda r: r.versions["unchanged"]["new_bytes"] / r.logical_bytes),
    Measure("stored_first_vs_folder", "save, first: stored bytes / torch_dist's folder", "fraction",
            lambda r: r.versions["first"]["stored_bytes"] / r.folder_bytes["first"]),
)

TARGETS: dict[str, float] = {  # issue 33: "save <= 1.0x torch_dist"; unchanged as for dcp
    "save_first_vs_torch_dist": 1.0,
    "new_unchanged_of_logical": 0.001,
}

NOTES = (f"see benchmarks/mcore.py; {RANKS} spawned gloo ranks, one thread each, a TP-2 sharded state "
         "(the dcp workload's decoder + AdamW-like moments); torch_dist's format written by DCP's "
         "FileSystemWriter (fsync'd; torch_dist's own writer needs CUDA), then casckpt's strategies on "
         "a default store; slowest rank's wall time after a barrier; loads checked bit for bit")


def raw_table(outcomes: Mapping[str, MegatronResult]) -> Table:
    """One row per operation: both kinds' wall and CPU seconds, casckpt's new / stored bytes."""
    table = Table(title=f"megatron: dist_checkpointing, {RANKS} gloo ranks (slowest rank; CPU: both ranks)")
    for column in ("operation", "torch_dist", "casckpt", "torch_dist CPU", "casckpt CPU", "new", "stored",
                   "folder"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for r in outcomes.values():
        for op in OPERATIONS:
            version = r.versions.get(op, {})
            table.add_row(op, f"{r.seconds[op]['torch_dist']:.2f} s", f"{r.seconds[op]['casckpt']:.2f} s",
                          f"{r.cpu[op]['torch_dist']:.2f} s", f"{r.cpu[op]['casckpt']:.2f} s",
                          measure.fmt_bytes(version["new_bytes"]) if version else "",
                          measure.fmt_bytes(version["stored_bytes"]) if version else "",
                          measure.fmt_bytes(r.folder_bytes[op]) if op in r.folder_bytes else "")
    return table
