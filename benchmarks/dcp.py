"""The ``dcp`` workload: PyTorch Distributed Checkpoint through casckpt against DCP's own files.

Two ranks (two spawned processes, ``torch.distributed`` gloo on 127.0.0.1, a
free port) hold the same state: the GPT-style decoder of
:mod:`benchmarks.workloads` (fp32 weights as built by ``Decoder(cfg)`` after
``torch.manual_seed``) plus AdamW-like ``exp_avg`` / ``exp_avg_sq`` of the same
shapes and a scalar ``step`` per parameter, every tensor a ``DTensor`` sharded
``Shard(0)`` over a 2-rank CPU ``DeviceMesh``. Every rank builds the full
tensors from the seed and keeps its shard, so both agree without
communicating. Each operation runs with ``torch.distributed.checkpoint`` once
with ``FileSystemWriter`` / ``FileSystemReader`` (files fsync'd) and once with
``store.dcp_writer`` / ``store.dcp_reader``, in that order, in the same work
directory. The clock starts after a barrier; a figure is the slowest rank's.

On 2 ranks:

1. first save (casckpt step 1);
2. full load into freshly allocated DTensors, checked bit for bit;
3. a dense update of every tensor (every chunk changes), save (step 2);
4. the same state saved again (step 3): nothing new to store.

Then in the benchmark process itself, on 1 rank (``no_dist=True``), with the
full tensors rebuilt from the seed and given the same update:

5. a load of the 2-rank step 3 (DCP reshards 2 -> 1), checked bit for bit;
6. a save of the full tensors (step 4): casckpt chunks a shard on the whole
   tensor's grid, so only the chunks the 2-rank shard boundary cut are new.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import casckpt
from benchmarks import measure, ranks
from benchmarks.workloads import Decoder, ModelConfig
from casckpt.config import settings
from casckpt.format.chunks import aligned_chunk_size

Log = Callable[[str], None]
T = TypeVar("T")

NAME = "dcp"
RUN = "dcp"
RANKS = 2
SEED = 0
WARMUP_RUN = "dcp-warmup"  # a tiny save + load of each kind first, so one-time costs are not timed
DECAY, SHIFT = 0.999, 1e-7  # the dense update: x * DECAY + SHIFT, elementwise (same bits however sharded)
LR = 1e-3
STORE_DIR = "store"


@dataclass(frozen=True)
class Pair:
    """One operation done both ways on the same state: casckpt, and DCP's FileSystemWriter/Reader.

    ``casckpt_s`` / ``filesystem_s``: wall time of the slowest rank (each rank's
    in ``*_ranks_s``). ``version``: the casckpt ``Version`` a save made;
    ``filesystem_bytes``: FileSystemWriter's files on disk; ``verified``
    (loads): both loads returned the saved state bit for bit.
    """

    ranks: int
    casckpt_s: float
    filesystem_s: float
    casckpt_ranks_s: list[float]
    filesystem_ranks_s: list[float]
    version: dict[str, Any] | None = None
    filesystem_bytes: int | None = None
    verified: bool | None = None


@dataclass(frozen=True)
class DcpResult:
    """Every raw number of the ``dcp`` workload.

    ``first``, ``load``, ``dense``, ``unchanged``: on 2 ranks (steps 1, 1, 2, 3);
    ``reshard_load`` (step 3 onto 1 rank) and ``reshard_save`` (step 4, full
    tensors from 1 rank): in the benchmark process. ``launch_s``: spawning the
    ranks until they finished (imports, building the state and every step:
    never part of a timed figure); ``build_s``: the slowest rank's state build.
    """

    name: str
    model: dict[str, int]
    ranks: int
    tensors: int
    logical_bytes: int
    chunk_size: int
    boundary_bytes: int  # chunks the 2-rank shard boundaries cut: reshard_save's expected new bytes
    launch_s: float
    build_s: float
    first: Pair
    load: Pair
    dense: Pair
    unchanged: Pair
    reshard_load: Pair
    reshard_save: Pair

    def pairs(self) -> dict[str, Pair]:
        """The measured operations, in the order they ran."""
        return {"first": self.first, "load": self.load, "dense": self.dense,
                "unchanged": self.unchanged, "reshard_load": self.reshard_load,
                "reshard_save": self.reshard_save}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


# ---- the state: identical on every rank and in the benchmark process ---------------------------


def full_state(cfg: ModelConfig, seed: int = SEED) -> dict[str, Any]:
    """Decoder weights (as initialised) + AdamW-like moments and step, as whole tensors.

    Deterministic in ``seed``: every process that calls it gets the same bits.
    """
    torch.manual_seed(seed)
    weights = {k: v.detach() for k, v in Decoder(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    moments = {
        k: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(v.shape, generator=gen).mul_(1e-3),
            "exp_avg_sq": torch.rand(v.shape, generator=gen).mul_(1e-6),
        }
        for k, v in weights.items()
    }
    groups = [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
               "params": list(weights)}]
    return {"model": weights, "optim": {"state": moments, "param_groups": groups}}


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn, other) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn, other) for v in tree]
    return other(tree)


def _shard(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """Every tensor of rank >= 1 as a DTensor, ``Shard(0)`` over ``mesh``, from this rank's copy."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(t: torch.Tensor) -> torch.Tensor:
        if not t.dim():
            return t  # the optimizer's step: a plain (replicated) tensor, as FSDP2 keeps it
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    return dict(_map_tensors(state, shard, lambda v: v))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def dense_update(state: Any) -> None:
    """Change every element of every tensor, in place (DTensors through their local shards).

    ``x * DECAY + SHIFT`` (a weight-decay-like shrink that keeps each tensor's
    value distribution, so compression sees what it saw before); the few
    elements it leaves as they were (about 1 in a million: rounding, the fixed
    point) move to the next float up. The optimizer's step counts up by one.
    Elementwise, so a shard and the whole tensor get the same bits.
    """
    for _, t in _leaves(state):
        if not isinstance(t, torch.Tensor):
            continue
        local = _local(t)
        if not local.dim():
            local.add_(1.0)
            continue
        before = local.clone()
        local.mul_(DECAY).add_(SHIFT)
        same = local.view(torch.int32) == before.view(torch.int32)
        local[same] = torch.nextafter(before[same], torch.tensor(float("inf")))


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, tree


def _target(state: Any) -> Any:
    """What a load fills: every tensor ``empty_like`` (DTensors stay DTensors), every value None."""
    return _map_tensors(state, torch.empty_like, lambda v: None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def mismatches(expected: Any, actual: Any) -> list[str]:
    """Paths whose loaded leaf differs from the saved one (tensors compared byte for byte)."""
    left, right = dict(_leaves(expected)), dict(_leaves(actual))
    bad = sorted(set(left) ^ set(right))
    for path in sorted(set(left) & set(right)):
        a, b = left[path], right[path]
        if isinstance(a, torch.Tensor):
            same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(_bits(a), _bits(b)))
        else:
            same = type(a) is type(b) and a == b
        if not same:
            bad.append(path)
    return bad


def boundary_bytes(state: Any, chunk_size: int, ranks: int = RANKS) -> int:
    """Bytes of the chunks a 1-rank save cannot share with the ``ranks``-rank save of ``state``.

    A ``Shard(0)`` piece is chunked on the whole tensor's grid, so only the
    chunk each shard boundary falls inside differs (split in two pieces there,
    whole here); a tensor smaller than a chunk is all boundary. Identical
    chunks elsewhere in the state (dedup) can make the real figure smaller.
    """
    total = 0
    for _, t in _leaves(state):
        if not isinstance(t, torch.Tensor) or not t.dim() or not t.nbytes:
            continue
        size = aligned_chunk_size(chunk_size, t.element_size())
        row = t.nbytes // t.shape[0]
        per_rank = -(-t.shape[0] // ranks)  # DTensor's Shard(0): torch.chunk's split
        cuts = {k * per_rank * row // size for k in range(1, ranks)
                if 0 < k * per_rank * row < t.nbytes and k * per_rank * row % size}
        total += sum(min(size, t.nbytes - c * size) for c in cuts)
    return total


def tensor_stats(state: Any) -> tuple[int, int]:
    """(tensors, logical bytes) of a state of whole tensors."""
    tensors = [t for _, t in _leaves(state) if isinstance(t, torch.Tensor)]
    return len(tensors), sum(t.nbytes for t in tensors)


# ---- one rank -----------------------------------------------------------------------------------


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _fs_writer(directory: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter(directory, sync_files=True)  # its default, stated: every file fsync'd


def _fs_reader(directory: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(directory)


def _load(state: Any, reader: Callable[[], Any], no_dist: bool = False) -> Any:
    """Allocate the target (part of the timed load, as for torch.load) and ``dcp.load`` into it."""
    target = _target(state)
    _dcp().load(target, storage_reader=reader(), no_dist=no_dist)
    return target


class _Rank:
    """This rank's figures, written as JSON for the benchmark process."""

    def __init__(self, rank: int, store: casckpt.Store, workdir: Path) -> None:
        self.rank, self.store, self.workdir = rank, store, workdir
        self.out: dict[str, Any] = {"rank": rank, "seconds": {}, "mismatches": {}, "versions": {},
                                    "filesystem_bytes": {}}

    def timed(self, key: str, fn: Callable[[], T]) -> T:
        """``fn`` between a barrier and the clock stop, after a GC on every rank."""
        measure.release_memory()
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        self.out["seconds"][key] = time.perf_counter() - start
        return result

    def save(self, label: str, state: Any, step: int) -> None:
        """FileSystemWriter to ``fs-<step>``, then casckpt ``RUN@step``; rank 0 records sizes."""
        directory = self.workdir / f"fs-{step}"
        self.timed(f"{label}/filesystem",
                   lambda: _dcp().save(state, storage_writer=_fs_writer(directory)))
        self.timed(f"{label}/casckpt",
                   lambda: _dcp().save(state, storage_writer=self.store.dcp_writer(run=RUN, step=step)))
        dist.barrier()
        if self.rank == 0:
            self.out["versions"][label] = self.store.resolve(f"{RUN}@{step}").to_dict()
            self.out["filesystem_bytes"][label] = measure.path_bytes(directory)

    def load(self, label: str, state: Any, step: int) -> None:
        """FileSystemReader of ``fs-<step>``, then casckpt ``RUN@step``; both checked."""
        version = self.store.resolve(f"{RUN}@{step}").id  # resolved once, outside the clock
        readers = {"filesystem": lambda: _fs_reader(self.workdir / f"fs-{step}"),
                   "casckpt": lambda: self.store.dcp_reader(version)}
        for kind, reader in readers.items():
            loaded = self.timed(f"{label}/{kind}", functools.partial(_load, state, reader))
            self.out["mismatches"][f"{label}/{kind}"] = mismatches(state, loaded)
            del loaded

    def remove(self, name: str) -> None:
        """Delete FileSystemWriter's directory ``name`` once every rank is done with it."""
        dist.barrier()
        if self.rank == 0:
            measure.remove(self.workdir / name)


def _warm_up(rank: _Rank, mesh: Any) -> None:
    """One tiny save and load of each kind, untimed: DCP's lazy imports, first collectives."""
    state = _shard({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, mesh)
    directory = rank.workdir / "fs-warmup"
    _dcp().save(state, storage_writer=_fs_writer(directory))
    _dcp().save(state, storage_writer=rank.store.dcp_writer(run=WARMUP_RUN, step=0))
    _load(state, lambda: _fs_reader(directory))
    _load(state, lambda: rank.store.dcp_reader(f"{WARMUP_RUN}@0"))
    rank.remove(directory.name)


def _rank_steps(rank: _Rank, cfg: ModelConfig, mesh: Any) -> None:
    """Steps 1-4 of the module docstring, on this rank; FileSystemWriter's directories go as used."""
    start = time.perf_counter()
    state = _shard(full_state(cfg), mesh)
    rank.out["build_s"] = time.perf_counter() - start
    _warm_up(rank, mesh)
    rank.save("first", state, 1)
    rank.load("load", state, 1)
    rank.remove("fs-1")
    dense_update(state)
    rank.save("dense", state, 2)
    rank.remove("fs-2")
    rank.save("unchanged", state, 3)  # fs-3 stays: the benchmark process loads it on 1 rank


def rank_main(rank: int, port: int, cfg: ModelConfig, workdir: Path, timeout_s: float) -> None:
    """One rank's process: join the group, build and shard the state, run steps 1-4, write JSON."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")  # DCP's and DTensor's notices would flood the console
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for more than one rank per host
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS, timeout=timedelta(seconds=timeout_s))
    try:
        mesh = init_device_mesh("cpu", (RANKS,))
        with casckpt.open(workdir / STORE_DIR) as store:
            r = _Rank(rank, store, workdir)
            _rank_steps(r, cfg, mesh)
        (workdir / f"rank-{rank}.json").write_text(json.dumps(r.out, default=str))
    finally:
        dist.destroy_process_group()


# ---- the benchmark process ----------------------------------------------------------------------


def _launch(cfg: ModelConfig, workdir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Spawn the ranks, wait for all of them (or the first failure, or the timeout); their JSON."""
    return ranks.launch(rank_main, (cfg, workdir, timeout_s), workdir, RANKS, timeout_s, "dcp")


def _check(label: str, bad: dict[str, list[str]]) -> None:
    """Fail the workload loudly when a load did not return the saved bytes."""
    wrong = {who: paths for who, paths in bad.items() if paths}
    if wrong:
        detail = "; ".join(f"{who}: {len(paths)} leaves, e.g. {', '.join(paths[:3])}"
                           for who, paths in wrong.items())
        raise RuntimeError(f"dcp {label}: loaded state differs from the saved one ({detail})")


def _rank_pair(ranks: list[dict[str, Any]], label: str) -> Pair:
    """The figures of operation ``label`` from every rank's JSON (loads checked first)."""
    each = {kind: [r["seconds"][f"{label}/{kind}"] for r in ranks] for kind in ("casckpt", "filesystem")}
    checks = {f"{kind} rank {r['rank']}": r["mismatches"][f"{label}/{kind}"]
              for r in ranks for kind in ("casckpt", "filesystem") if f"{label}/{kind}" in r["mismatches"]}
    _check(label, checks)
    lead = ranks[0]
    return Pair(len(ranks), max(each["casckpt"]), max(each["filesystem"]), each["casckpt"],
                each["filesystem"], lead["versions"].get(label), lead["filesystem_bytes"].get(label),
                True if checks else None)


def _one_rank(fn: Callable[[], T]) -> tuple[T, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        return measure.timed(fn)


def _reshard_load(store: casckpt.Store, state: Any, workdir: Path) -> Pair:
    """Load the 2 ranks' step 3 (FileSystemWriter's fs-3, casckpt RUN@3) into whole tensors here."""
    version = store.resolve(f"{RUN}@3").id
    fs, fs_s = _one_rank(lambda: _load(state, lambda: _fs_reader(workdir / "fs-3"), no_dist=True))
    _check("load on 1 rank", {"filesystem": mismatches(state, fs)})
    del fs
    ours, ours_s = _one_rank(lambda: _load(state, lambda: store.dcp_reader(version), no_dist=True))
    _check("load on 1 rank", {"casckpt": mismatches(state, ours)})
    del ours
    measure.remove(workdir / "fs-3")
    return Pair(1, ours_s, fs_s, [ours_s], [fs_s], verified=True)


def _reshard_save(store: casckpt.Store, state: Any, workdir: Path) -> Pair:
    """Save the whole tensors from this one process: FileSystemWriter to fs-4, casckpt RUN@4."""
    directory = workdir / "fs-4"
    dcp = _dcp()
    _, fs_s = _one_rank(lambda: dcp.save(state, storage_writer=_fs_writer(directory), no_dist=True))
    _, ours_s = _one_rank(lambda: dcp.save(state, storage_writer=store.dcp_writer(run=RUN, step=4),
                                           no_dist=True))
    fs_bytes = measure.path_bytes(directory)
    measure.remove(directory)
    return Pair(1, ours_s, fs_s, [ours_s], [fs_s], store.resolve(f"{RUN}@4").to_dict(), fs_bytes)


def run_dcp(scale: float, workdir: Path, log: Log) -> DcpResult:
    """Measure the ``dcp`` workload at ``scale``; ``workdir`` must be an empty directory."""
    cfg = ModelConfig.for_scale(scale)
    casckpt.open(workdir / STORE_DIR).close()  # created once, before the ranks open it
    timeout_s = 300 + 1200 * scale
    log(f"{NAME}: {RANKS} ranks (spawned, gloo): first save, load, save after a dense update, "
        "unchanged save; FileSystemWriter/Reader, then casckpt")
    start = time.perf_counter()
    ranks = _launch(cfg, workdir, timeout_s)
    launch_s = time.perf_counter() - start
    pairs = {label: _rank_pair(ranks, label) for label in ("first", "load", "dense", "unchanged")}
    log(f"{NAME}: 1 rank (this process): load of the 2-rank save, save of the full tensors")
    state = full_state(cfg)
    dense_update(state)  # what the ranks saved as steps 2 and 3
    tensors, logical = tensor_stats(state)
    with casckpt.open(workdir / STORE_DIR) as store:
        reshard_load = _reshard_load(store, state, workdir)
        reshard_save = _reshard_save(store, state, workdir)
    chunk_size = settings().chunk_size  # what a store opened without overrides uses
    return DcpResult(NAME, dataclasses.asdict(cfg), RANKS, tensors, logical, chunk_size,
                     boundary_bytes(state, chunk_size), launch_s,
                     max(r["build_s"] for r in ranks), reshard_load=reshard_load,
                     reshard_save=reshard_save, **pairs)
