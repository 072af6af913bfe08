"""The ``deepspeed`` workload: DeepSpeed ZeRO-2 saves through casckpt against TorchCheckpointEngine.

Two ranks (spawned processes, ``DS_ACCELERATOR=cpu``, ``deepspeed.init_distributed`` on gloo,
one thread each) train the GPT-style decoder of :mod:`benchmarks.workloads` (106M parameters
at scale 1.0: ``ModelConfig.for_scale(1.15 * scale)``) with a real DeepSpeed engine: ZeRO
stage 2, AdamW with ``torch_adam``, fp32, micro-batch 1 of 32 random tokens, next-token loss.
Two regimes, each its own engine and store:

* ``full``: every parameter trains;
* ``frozen``: the backbone is frozen, only the last block, the final norm and the head train
  (~15% of the parameters; the optimizer holds those only, the model file every weight).

Each regime runs ``SAVES`` (10) rounds of one training step then one
``engine.save_checkpoint`` with DeepSpeed's own ``TorchCheckpointEngine`` (``torch.save`` of
each file into ``torch/<tag>/``, no fsync) and one with casckpt's engine
(:func:`casckpt.integrations.deepspeed.install`: one version per tag, files committed rank by
rank) of the same state; which goes first alternates per round. The clock starts after a GC
and a barrier on both ranks; a figure is the slowest rank's. Every DeepSpeed folder is
measured, then deleted (the last is kept): the bytes are what keeping all 10 would take.

Then both resume into the same engine after one more step (so every tensor differs): DeepSpeed's
``load_checkpoint`` of the last folder, and casckpt's ``load_checkpoint`` of the last version;
each is checked against the saved state (BLAKE3 of the module's and optimizer's state dicts,
every tensor's bytes and every plain value), a mismatch fails the workload.

(Named ``ds_zero``, not ``deepspeed``: ``python benchmarks/run.py`` puts this folder first on
``sys.path``, where a ``deepspeed.py`` would shadow the package; ``mcore`` likewise.)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.ranks import Clock, freeze_heap, launch, slowest, thaw_heap
from benchmarks.workloads import Decoder, ModelConfig

Log = Callable[[str], None]

NAME = "deepspeed"
RANKS = 2
SAVES = 10
REGIMES = ("full", "frozen")
PARAM_SCALE = 1.15  # ModelConfig.for_scale(1.15): 106M parameters, the ">= 100M"
TOKENS = 32
SEED = 0


@dataclass(frozen=True)
class Regime:
    """One regime's raw figures; times are the slowest rank's wall seconds, per save.

    ``folder_bytes``: each TorchCheckpointEngine folder; ``store_bytes``: the casckpt store's
    directory after the last save (packs, catalog, everything); ``marker_bytes``: the folder
    casckpt's engine wrote (markers and ``latest``); ``versions``: each save's ``Version``.
    """

    params: int
    trainable: int
    torch_save_s: list[float]
    casckpt_save_s: list[float]
    torch_save_cpu_s: list[float]  # both ranks' CPU seconds together
    casckpt_save_cpu_s: list[float]
    folder_bytes: list[int]
    store_bytes: int
    marker_bytes: int
    versions: list[dict[str, Any]]
    torch_load_s: float
    casckpt_load_s: float
    verified: bool
    build_s: float  # deepspeed.initialize of the engine (slowest rank), untimed elsewhere
    regime_s: float  # the whole regime on the slowest rank: build, steps, saves, resumes, checks


@dataclass(frozen=True)
class DeepSpeedResult:
    """Every raw number of the ``deepspeed`` workload."""

    name: str
    model: dict[str, int]
    ranks: int
    saves: int
    launch_s: float
    start_s: float  # the slowest rank's start: importing DeepSpeed, joining the group
    regimes: dict[str, Regime]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


# ---- one rank -----------------------------------------------------------------------------------


def tree_digest(obj: Any) -> str:
    """BLAKE3 of every tensor's dtype, shape and bytes and every plain value of ``obj``, in order."""
    from blake3 import blake3

    h = blake3()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(f"T{o.dtype}{tuple(o.shape)}".encode())
            h.update(measure.raw_bytes(o.detach().cpu()))
        elif isinstance(o, dict):
            for k, v in o.items():
                h.update(f"K{k!r}".encode())
                walk(v)
        elif isinstance(o, (list, tuple)):
            h.update(f"L{len(o)}".encode())
            for v in o:
                walk(v)
        elif o is None or isinstance(o, (int, float, str, bytes, bool)):
            h.update(f"V{type(o).__name__}{o!r}".encode())
        else:
            h.update(f"O{type(o).__qualname__}".encode())
            walk(vars(o))

    walk(obj)
    return str(h.hexdigest())


def _engine_digest(engine: Any) -> str:
    return tree_digest({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                        "steps": engine.global_steps})


def _build(deepspeed: Any, cfg: ModelConfig, regime: str) -> Any:
    torch.manual_seed(SEED)
    model = Decoder(cfg)
    if regime == "frozen":
        model.requires_grad_(False)
        for part in (model.blocks[-1], model.ln_f, model.head):
            part.requires_grad_(True)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 1 << 30}
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def _train_step(engine: Any, vocab: int) -> None:
    g = torch.Generator().manual_seed(1000 * engine.global_steps + torch.distributed.get_rank())
    tokens = torch.randint(0, vocab, (1, TOKENS + 1), generator=g)
    logits = engine(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()


def _run_regime(deepspeed: Any, cfg: ModelConfig, regime: str, workdir: Path, rank: int) -> dict[str, Any]:
    """One regime on this rank: build its engine, measure, let the engine go."""
    began = time.perf_counter()
    engine = _build(deepspeed, cfg, regime)
    build_s = time.perf_counter() - began
    freeze_heap()
    with casckpt.open(workdir / f"store-{regime}") as store:
        out = _rounds(engine, store, cfg, regime, workdir, rank)
    out["build_s"], out["regime_s"] = build_s, time.perf_counter() - began
    del engine
    thaw_heap()  # the engine's reference cycles go before the next regime builds its own
    return out


def _rounds(engine: Any, store: casckpt.Store, cfg: ModelConfig, regime: str, workdir: Path,
            rank: int) -> dict[str, Any]:
    """``SAVES`` rounds of one step then both saves, then both resumes, each checked."""
    from casckpt.integrations import deepspeed as casckpt_ds

    dist = torch.distributed
    clock = Clock(dist.barrier)
    torch_ce = engine.checkpoint_engine
    ours = casckpt_ds.install(engine, store=store, run=regime)
    torch_dir, ours_dir = workdir / f"torch-{regime}", workdir / f"casckpt-{regime}"
    out: dict[str, Any] = {"folder_bytes": [], "versions": []}
    kinds = {"torch": (torch_ce, torch_dir), "casckpt": (ours, ours_dir)}
    tag = ""
    for i in range(SAVES):
        _train_step(engine, cfg.vocab)
        tag = f"global_step{engine.global_steps}"
        for kind in (("torch", "casckpt") if i % 2 == 0 else ("casckpt", "torch")):
            engine.checkpoint_engine, folder = kinds[kind]
            clock(f"{kind}/{i}", lambda folder=folder, tag=tag: engine.save_checkpoint(str(folder), tag=tag))
        dist.barrier()
        if rank == 0:
            out["folder_bytes"].append(measure.path_bytes(torch_dir / tag))
            out["versions"].append(store.resolve(f"{regime}@{engine.global_steps}").to_dict())
            if i < SAVES - 1:
                measure.remove(torch_dir / tag)
        dist.barrier()
    saved = _engine_digest(engine)
    _train_step(engine, cfg.vocab)  # the resumes must overwrite every tensor
    engine.checkpoint_engine = torch_ce
    clock("torch/load", lambda: engine.load_checkpoint(str(torch_dir), tag=tag))
    out["torch_ok"] = _engine_digest(engine) == saved
    _train_step(engine, cfg.vocab)
    engine.checkpoint_engine = ours
    clock("casckpt/load", lambda: casckpt_ds.load_checkpoint(engine, ours_dir, tag=tag))
    out["casckpt_ok"] = _engine_digest(engine) == saved
    dist.barrier()
    if rank == 0:
        out["store_bytes"] = measure.path_bytes(workdir / f"store-{regime}")
        out["marker_bytes"] = measure.path_bytes(ours_dir)
        measure.remove(torch_dir)
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    out["trainable"] = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    out["seconds"], out["cpu"] = clock.seconds, clock.cpu
    engine.checkpoint_engine = torch_ce
    ours.close()
    return out


def rank_main(rank: int, port: int, cfg: ModelConfig, workdir: Path) -> None:
    """One rank's process: DeepSpeed on gloo, both regimes, JSON for the benchmark process."""
    import json

    began = time.perf_counter()
    os.environ.update({"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
                       "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    warnings.simplefilter("ignore")
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for more than one rank per host
    # The CPU accelerator compiles a shared-memory allreduce kernel (g++, about a minute where
    # ~/.cache has none yet); gloo's collectives do here, as in tests/integrations
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        out: dict[str, Any] = {"rank": rank, "start_s": time.perf_counter() - began}
        out.update({r: _run_regime(deepspeed, cfg, r, workdir, rank) for r in REGIMES})
        (workdir / f"rank-{rank}.json").write_text(json.dumps(out, default=str))
    finally:
        torch.distributed.destroy_process_group()


# ---- the benchmark process ----------------------------------------------------------------------


def _regime(ranks: list[dict[str, Any]], regime: str) -> Regime:
    per = [r[regime] for r in ranks]
    lead = per[0]
    bad = [f"rank {r['rank']} {kind}" for r in ranks for kind in ("torch", "casckpt")
           if not r[regime][f"{kind}_ok"]]
    if bad:
        raise RuntimeError(f"deepspeed {regime}: a resume differs from the saved state ({', '.join(bad)})")

    def each(kind: str, field: str = "seconds") -> list[float]:
        if field == "cpu":
            return [sum(p["cpu"][f"{kind}/{i}"] for p in per) for i in range(SAVES)]
        return [max(p["seconds"][f"{kind}/{i}"] for p in per) for i in range(SAVES)]

    return Regime(lead["params"], lead["trainable"], each("torch"), each("casckpt"), each("torch", "cpu"),
                  each("casckpt", "cpu"), lead["folder_bytes"], lead["store_bytes"], lead["marker_bytes"],
                  lead["versions"], slowest(per, "torch/load"), slowest(per, "casckpt/load"), True,
                  max(p["build_s"] for p in per), max(p["regime_s"] for p in per))


def run_deepspeed(scale: float, workdir: Path, log: Log) -> DeepSpeedResult:
    """Measure the ``deepspeed`` workload at ``scale``; ``workdir`` must be an empty directory."""
    try:
        import deepspeed  # noqa: F401  (checked here: the ranks import it after setting DS_ACCELERATOR)
    except ImportError as exc:
        raise RuntimeError("the deepspeed workload needs DeepSpeed: pip install 'casckpt[deepspeed]'"
                           ) from exc
    cfg = ModelConfig.for_scale(PARAM_SCALE * scale)
    for regime in REGIMES:
        casckpt.open(workdir / f"store-{regime}").close()  # created once, before the ranks open it
    log(f"{NAME}: {RANKS} ranks (spawned, gloo, DS_ACCELERATOR=cpu), ZeRO-2, regimes {', '.join(REGIMES)}: "
        f"{SAVES} x (step, TorchCheckpointEngine save, casckpt save), then both resumes")
    start = time.perf_counter()
    ranks = launch(rank_main, (cfg, workdir), workdir, RANKS, 600 + 3000 * scale, NAME)
    return DeepSpeedResult(NAME, dataclasses.asdict(cfg), RANKS, SAVES, time.perf_counter() - start,
                           max(r["start_s"] for r in ranks), {r: _regime(ranks, r) for r in REGIMES})


# ---- figures ------------------------------------------------------------------------------------


def _median_ratio(regime: str, first: bool) -> Callable[[DeepSpeedResult], float | None]:
    def compute(r: DeepSpeedResult) -> float | None:
        g = r.regimes[regime]
        if first:
            return g.casckpt_save_s[0] / g.torch_save_s[0]
        return statistics.median(g.casckpt_save_s[1:]) / statistics.median(g.torch_save_s[1:])
    return compute


def _bytes_ratio(regime: str) -> Callable[[DeepSpeedResult], float | None]:
    def compute(r: DeepSpeedResult) -> float | None:
        g = r.regimes[regime]
        return (g.store_bytes + g.marker_bytes) / sum(g.folder_bytes)
    return compute


def _load_ratio(regime: str) -> Callable[[DeepSpeedResult], float | None]:
    return lambda r: r.regimes[regime].casckpt_load_s / r.regimes[regime].torch_load_s


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[DeepSpeedResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("full_save_first_vs_torch", "full: first save, casckpt / TorchCheckpointEngine", "ratio",
            _median_ratio("full", True)),
    Measure("full_save_next_vs_torch", "full: later saves (median), casckpt / TorchCheckpointEngine",
            "ratio", _median_ratio("full", False)),
    Measure("frozen_save_first_vs_torch", "frozen: first save, casckpt / TorchCheckpointEngine", "ratio",
            _median_ratio("frozen", True)),
    Measure("frozen_save_next_vs_torch", "frozen: save after an update (median), casckpt / Torch...",
            "ratio", _median_ratio("frozen", False)),
    Measure("full_bytes_vs_folders", f"full: store after {SAVES} saves / the {SAVES} folders", "fraction",
            _bytes_ratio("full")),
    Measure("frozen_bytes_vs_folders", f"frozen: store after {SAVES} saves / the {SAVES} folders",
            "fraction", _bytes_ratio("frozen")),
    Measure("full_load_vs_torch", "full: resume, verified, casckpt / DeepSpeed's load", "ratio",
            _load_ratio("full")),
    Measure("frozen_load_vs_torch", "frozen: resume, verified, casckpt / DeepSpeed's load", "ratio",
            _load_ratio("frozen")),
)

TARGETS: dict[str, float] = {  # issue 33
    "full_save_first_vs_torch": 1.0,
    "frozen_save_next_vs_torch": 0.5,
}

NOTES = (f"see benchmarks/ds_zero.py; {RANKS} spawned gloo ranks, DeepSpeed ZeRO-2 on CPU, fp32, AdamW "
         f"(torch_adam); {SAVES} rounds of one step then TorchCheckpointEngine and casckpt saves of the "
         "same state (order alternating), slowest rank's wall time after a barrier; TorchCheckpointEngine "
         "does not fsync, casckpt does; bytes: the casckpt store directory plus its marker folder vs "
         "the sum of the 10 DeepSpeed folders; both resumes checked bit for bit")


def raw_table(outcomes: Mapping[str, DeepSpeedResult]) -> Table:
    """One row per regime: parameters, save times (first, median of the rest), bytes, resumes."""
    table = Table(title=f"deepspeed: ZeRO-2, {RANKS} gloo ranks, {SAVES} saves per regime "
                        "(TorchCheckpointEngine vs casckpt, slowest rank)")
    for column in ("regime", "params", "trainable", "torch 1st", "casckpt 1st", "torch next",
                   "casckpt next", "folders", "store", "torch load", "casckpt load", "bit-exact"):
        table.add_column(column, justify="left" if column == "regime" else "right")
    for r in outcomes.values():
        for name, g in r.regimes.items():
            table.add_row(name, f"{g.params / 1e6:.1f}M", f"{g.trainable / g.params:.0%}",
                          f"{g.torch_save_s[0]:.2f} s", f"{g.casckpt_save_s[0]:.2f} s",
                          f"{statistics.median(g.torch_save_s[1:]):.2f} s",
                          f"{statistics.median(g.casckpt_save_s[1:]):.2f} s",
                          measure.fmt_bytes(sum(g.folder_bytes)),
                          measure.fmt_bytes(g.store_bytes + g.marker_bytes),
                          f"{g.torch_load_s:.2f} s", f"{g.casckpt_load_s:.2f} s",
                          "yes" if g.verified else "[red]NO[/]")
    return table
