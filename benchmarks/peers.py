"""The ``peers`` workload: casckpt side by side with what a user would pick instead (issue 32).

Tools (``benchmarks/peers_tools.py``), each saving the same live state at every checkpoint:
``torch.save`` (+ fsync, one file each), DCP ``save`` (``FileSystemWriter``), DCP
``async_save`` (default, and with one reused ``DefaultStager``: DCP's cached staging),
casckpt (blocking ``commit``; ``commit(block=False)``; the same with
``trust_versions=True``), borg (``create --compression zstd,1`` and ``none`` of a torch.save
file) and restic (``backup`` of a torch.save file, its defaults). borg and restic are run
as installed by ``benchmarks/peers_setup.sh``; where one is missing its rows say so and the
targets that need it are waived.

Workload: a GPT-style decoder (8 layers, d_model 512, vocab 32000, tied embeddings: 41.7M
parameters at scale 1; width and vocabulary grow with ``sqrt(scale)``), AdamW (lr 5e-5,
weight decay 0.01) and a LambdaLR schedule (10 warm-up steps, then linear decay). The state
is ``{"model", "optimizer", "scheduler", "step"}``. One warm-up step, then checkpoint 1;
``STEPS_PER_INTERVAL`` real steps between checkpoints, ``CHECKPOINTS`` checkpoints. Regimes:
``full`` (everything trains), ``frozen`` (embedding/head and the first 6 blocks frozen),
``lora`` (rank-8 adapters on every block's qkv and proj; the base frozen).

Each of ``ROUNDS`` rounds gives every regime a fresh model (same seed) and fresh folders. At
checkpoint ``k`` of round ``r`` the tools save in the order of ``TOOL_KEYS`` rotated by
``k + r``; an asynchronous save is waited for before the next tool starts, so tools never
overlap. After the last checkpoint: ``RESTORE_REPS`` restores per tool (rotated likewise,
warm page cache), each compared bit for bit with the live state (a mismatch fails the
workload); bytes on disk; then prune to the newest ``KEEP`` (timed; bytes reclaimed), and
casckpt's newest version restored and checked once more.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import measure
from benchmarks.peers_tools import ABSENT, NEEDS, TOOL_KEYS, Tool, dcp_group, find_peers, make_tools
from benchmarks.workloads import Decoder, ModelConfig, _add_lora, _train_step

Log = Callable[[str], None]

NAME = "peers"
REGIMES = ("full", "frozen", "lora")
REGIME_LABELS = {"full": "full fine-tune", "frozen": "frozen backbone", "lora": "LoRA-like"}
ROUNDS = 3
CHECKPOINTS = 10
STEPS_PER_INTERVAL = 2
RESTORE_REPS = 3
KEEP = 3
FROZEN_TRAINABLE_BLOCKS = 2  # of 8: blocks 6-7 and the final norm (15.1% of parameters at scale 1)
WARMUP_STEPS = 10
DECAY_STEPS = 100
_N_LAYERS = 8
_HEAD_DIM = 64


def model_config(scale: float) -> ModelConfig:
    """The decoder at ``scale``: 8 layers, d_model 512 and vocab 32000 times sqrt(scale)."""
    width = math.sqrt(scale)
    d_model = max(_HEAD_DIM, round(512 * width / _HEAD_DIM) * _HEAD_DIM)
    vocab = max(256, round(32000 * width / 64) * 64)
    return ModelConfig(vocab, d_model, _N_LAYERS, d_model // _HEAD_DIM, 256)


def _lr_factor(step: int) -> float:
    """Linear warm-up over ``WARMUP_STEPS``, then linear decay to 10% over ``DECAY_STEPS``."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    return max(0.1, 1.0 - (step - WARMUP_STEPS) / DECAY_STEPS)


@dataclass
class Training:
    """A live model, its optimizer and schedule; ``state()`` is what every tool saves."""

    regime: str
    cfg: ModelConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    params: int
    trainable: int
    step: int = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            _train_step(self.model, self.optimizer, self.cfg)
            self.scheduler.step()
            self.step += 1


def build_training(regime: str, scale: float, seed: int = 0) -> Training:
    """The ``regime``'s decoder (tied embeddings) after its one warm-up step."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)}")
    torch.manual_seed(seed)
    cfg = model_config(scale)
    model = Decoder(cfg)
    model.head.weight = model.tok.weight  # tied: one storage under two names
    if regime == "frozen":
        model.requires_grad_(False)
        for module in (*model.blocks[-FROZEN_TRAINABLE_BLOCKS:], model.ln_f):
            module.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
    elif regime == "lora":
        params = _add_lora(model)
    else:
        params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor)
    training = Training(regime, cfg, model, optimizer, scheduler,
                        sum(p.numel() for p in model.parameters()), sum(p.numel() for p in params))
    training.advance(1)  # so checkpoint 1 already holds optimizer moments
    return training


# ---- raw results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRound:
    """One tool in one regime and round (seconds; bytes on disk after the last checkpoint)."""

    saves_s: list[float]  # per checkpoint, until the save (and any background part) was done
    stalls_s: list[float]  # per checkpoint, until control came back (= saves_s when blocking)
    restores_s: list[float]  # RESTORE_REPS restores of the newest checkpoint, each checked
    disk: int | None  # None: keeps no history (DCP async: its files are DCP's)
    aside: int | None  # caches kept apart (casckpt index cache, borg/restic caches)
    stored_sum: int | None  # casckpt: sum of Version.stored_bytes
    prune_s: float | None
    reclaimed: int | None


@dataclass(frozen=True)
class RegimeRound:
    """Every tool's figures for one regime in one round."""

    regime: str
    round: int
    params: int
    trainable: int
    logical_bytes: int
    order: list[str]  # the tools in the order of checkpoint 1
    tools: dict[str, ToolRound]


@dataclass(frozen=True)
class PeersResult:
    """Every raw number of the ``peers`` workload."""

    name: str
    scale: float
    rounds: int
    checkpoints: int
    regimes: list[str]
    tools: dict[str, str]  # tool -> "measured", "not run" or why absent
    versions: dict[str, str | None]  # borg / restic version lines (None: absent)
    installed: str | None  # the setup command this run ran, if any
    runs: list[RegimeRound] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PeersResult:
        """The result :meth:`to_dict` wrote (e.g. ``results.peers.raw`` of run.py's JSON)."""
        runs = [RegimeRound(**{**run, "tools": {k: ToolRound(**t) for k, t in run["tools"].items()}})
                for run in raw["runs"]]
        return cls(**{**raw, "runs": runs})


# ---- measuring ----------------------------------------------------------------------------------


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """``items`` starting at index ``by`` (mod its length): who goes first changes every time."""
    n = by % len(items) if items else 0
    return [*items[n:], *items[:n]]


def _check(live: Any, restored: Any, what: str) -> None:
    if not measure.trees_equal(live, restored):
        raise RuntimeError(f"peers: {what} is not the saved state bit for bit")


@dataclass
class _Samples:
    saves: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    restores: list[float] = field(default_factory=list)


def _checkpoints(training: Training, tools: list[Tool], samples: dict[str, _Samples], r: int,
                 checkpoints: int, log: Log) -> None:
    for k in range(1, checkpoints + 1):
        if k > 1:
            training.advance(STEPS_PER_INTERVAL)
        state = training.state()
        log(f"{NAME} {training.regime}: round {r + 1}, checkpoint {k}/{checkpoints}")
        for tool in rotated(tools, k + r):
            measure.release_memory()
            start = time.perf_counter()
            stall = tool.save(state, k)
            total = time.perf_counter() - start
            tool.after_save()
            samples[tool.key].saves.append(total)
            samples[tool.key].stalls.append(total if stall is None else stall)


def _restores(training: Training, tools: list[Tool], samples: dict[str, _Samples], r: int, reps: int) -> None:
    live = training.state()
    for rep in range(reps):
        for tool in rotated(tools, rep + r):
            measure.release_memory()
            start = time.perf_counter()
            restored = tool.restore(live)
            samples[tool.key].restores.append(time.perf_counter() - start)
            _check(live, restored, f"{tool.key}'s restore of {training.regime} (round {r + 1})")
            del restored
            tool.after_restore()


def _prune(training: Training, tool: Tool) -> tuple[float, int, int]:
    """(seconds, bytes before, bytes after) of pruning ``tool`` to the newest ``KEEP``."""
    before = tool.disk().stored
    measure.release_memory()
    start = time.perf_counter()
    tool.prune(KEEP)
    seconds = time.perf_counter() - start
    if tool.verify_after_prune:
        _check(training.state(), tool.restore(training.state()), f"{tool.key} after prune")
    return seconds, before, tool.disk().stored


def _regime_round(regime: str, r: int, scale: float, keys: list[str], workdir: Path, checkpoints: int,
                  reps: int, log: Log) -> RegimeRound:
    log(f"{NAME} {regime}: round {r + 1}: building the model")
    training = build_training(regime, scale)
    logical = measure.logical_bytes(training.state())
    root = workdir / f"{regime}-{r}"
    tools = make_tools(root, regime, keys)
    samples = {tool.key: _Samples() for tool in tools}
    # Everything alive now (torch's imports, the model) is left out of the collections that
    # release_memory runs before every timed call: with torch._dynamo imported, each took
    # ~0.2 s of CPU. Garbage the tools make is still collected; unfrozen after the round.
    gc.freeze()
    try:
        _checkpoints(training, tools, samples, r, checkpoints, log)
        log(f"{NAME} {regime}: round {r + 1}: {reps} restores per tool, each checked")
        _restores(training, tools, samples, r, reps)
        out: dict[str, ToolRound] = {}
        for tool in rotated(tools, r):
            s = samples[tool.key]
            disk = tool.disk() if tool.keeps_history else None
            pruned = _prune(training, tool) if tool.keeps_history else None
            out[tool.key] = ToolRound(
                s.saves, s.stalls, s.restores, None if disk is None else disk.stored,
                None if disk is None else disk.aside, tool.stored_sum(),
                None if pruned is None else pruned[0], None if pruned is None else pruned[1] - pruned[2])
    finally:
        gc.unfreeze()
        for tool in tools:
            tool.close()
        shutil.rmtree(root, ignore_errors=True)
    return RegimeRound(regime, r, training.params, training.trainable, logical, rotated(keys, 1 + r),
                       {k: out[k] for k in keys})


def run_peers(scale: float, workdir: Path, log: Log, *, rounds: int = ROUNDS, checkpoints: int = CHECKPOINTS,
              regimes: Sequence[str] = REGIMES, tools: Sequence[str] = TOOL_KEYS,
              restore_reps: int = RESTORE_REPS, install: bool = True) -> PeersResult:
    """Measure the ``peers`` workload at ``scale`` in the empty directory ``workdir``.

    ``tools``: a subset of ``TOOL_KEYS`` (``torch`` is the baseline and always runs; the
    DCP async rows are the stall baselines). borg and restic rows need the programs:
    missing ones are installed first when ``install`` (see ``peers_tools.find_peers``),
    else reported absent.
    """
    versions, installed = find_peers(install, log)
    status: dict[str, str] = {}
    keys = []
    for key in TOOL_KEYS:
        program = NEEDS.get(key)
        if key not in tools and key != "torch":
            status[key] = "not run"
        elif program is not None and versions[program] is None:
            status[key] = ABSENT
        else:
            status[key] = "measured"
            keys.append(key)
    added_addr = "MASTER_ADDR" not in os.environ
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    created = dcp_group(workdir)
    try:
        runs = [_regime_round(regime, r, scale, keys, workdir, checkpoints, restore_reps, log)
                for r in range(rounds) for regime in regimes]
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
        if added_addr:
            del os.environ["MASTER_ADDR"]
    return PeersResult(NAME, scale, rounds, checkpoints, list(regimes), status, versions, installed, runs)


def _main() -> None:
    """``python -m benchmarks.peers --scale 0.1``: the peers workload alone, with its README table
    (the full suite runs it through benchmarks/run.py)."""
    import argparse
    import json
    import sys
    import tempfile

    from rich.console import Console

    from benchmarks.peers_report import markdown_table, raw_table

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--checkpoints", type=int, default=CHECKPOINTS)
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--tools", default=",".join(TOOL_KEYS))
    parser.add_argument("--no-install-peers", action="store_true", help="never run peers_setup.sh")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None, help="write the raw result as JSON here")
    parser.add_argument("--table-from", default=None, metavar="JSON",
                        help="run nothing: print the README table of a result written by --out or by "
                        "benchmarks/run.py (its results.peers.raw)")
    args = parser.parse_args()
    if args.table_from:
        document = json.loads(Path(args.table_from).read_text())
        raw = document["results"][NAME]["raw"] if "results" in document else document
        print(markdown_table(PeersResult.from_dict(raw)))
        return

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run_peers(args.scale, Path(tmp), log, rounds=args.rounds, checkpoints=args.checkpoints,
                           regimes=[x for x in args.regimes.split(",") if x],
                           tools=[x for x in args.tools.split(",") if x], install=not args.no_install_peers)
    Console(width=160).print(raw_table({NAME: result}))
    print(f"\nscale {args.scale:g}, {args.rounds} round(s), {time.perf_counter() - started:.0f} s\n")
    print(markdown_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")


if __name__ == "__main__":
    _main()
