"""torchtitan checkpointing on gloo ranks: ``python torchtitan_worker.py --zygote``.

The ranks are forked as in dist_worker.py (same protocol); the zygote imports torchtitan's
checkpoint manager once. A scenario trains a tiny MLP, sharded by FSDP2 (``fully_shard``,
on CPU) when ``fsdp``, with torchtitan's own ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer``, checkpointed by torchtitan's real ``CheckpointManager`` (files)
or :class:`~casckpt.integrations.torchtitan.CasckptCheckpointManager` (the store), the way
torchtitan's trainer drives it: ``load()`` first, then ``save(step, last_step=...)`` after
every step and ``close()`` at the end.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import (
    OptimizersContainer,
    ParamGroupConfig,
)

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402

from casckpt.integrations.torchtitan import CasckptCheckpointManager  # noqa: E402


class TrainState:
    """What torchtitan's ``Trainer`` saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _config(args: dict[str, Any]) -> Any:
    common = {"enable": True, "interval": args.get("interval", 5),
              "keep_latest_k": args.get("keep", 0), "async_mode": args.get("async_mode", "disabled"),
              "last_save_model_only": args.get("model_only", True),
              "export_dtype": args.get("export_dtype", "float32")}
    if args.get("store") is None:
        return CheckpointManager.Config(**common)
    return CasckptCheckpointManager.Config(**common, store=args["store"], run=args.get("run", "tiny"))


def _digest(model: torch.nn.Module, optimizers: Any) -> dict[str, str]:
    """The BLAKE2 of every tensor's bytes, this rank's shard (model and optimizer)."""
    out = {}
    state = {**model.state_dict(), **{f"optimizer.{k}": v for k, v in optimizers.state_dict().items()}}
    for key, value in sorted(state.items()):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            out[key] = hashlib.blake2b(dist_worker.bits(local.reshape(-1))).hexdigest()
    return out


def _kill_after_writing(rank: int, kill: int | None) -> None:
    """Rank ``kill`` SIGKILLs itself once its chunks of a save are written, before publishing."""
    if rank != kill:
        return
    import casckpt.dcp as casckpt_dcp

    original = casckpt_dcp.save_pieces

    def dying(*a: Any, **k: Any) -> Any:
        original(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    casckpt_dcp.save_pieces = dying  # type: ignore[assignment]


def scenario_tt_train(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Resume (``load()``), train to ``args["steps"]`` saving every ``interval``, close."""
    torch.set_num_threads(1)  # bit-identical arithmetic whichever run it is
    torch.manual_seed(args.get("seed", 0))  # another seed: only a real load makes runs agree
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if args.get("fsdp", True):
        fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers,
                                                                     training_steps=args["last"])
    state = TrainState()
    manager = _config(args).build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                  lr_schedulers=schedulers, states={"train_state": state},
                                  sd_adapter=None, base_folder=args["folder"])
    manager.load(step=args.get("load_step", -1))
    loaded = state.step
    _kill_after_writing(rank, args.get("kill"))
    while state.step < args["steps"]:
        state.step += 1
        data = torch.Generator().manual_seed(1000 * state.step + rank)
        x = torch.randn(8, 16, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.ntokens_seen += 8
        manager.save(state.step, last_step=state.step == args["last"])
    manager.close()
    return {"loaded": loaded, "digest": _digest(model, optimizers),
            "lr_epoch": schedulers.schedulers[0].last_epoch, "ntokens": state.ntokens_seen,
            "dist": dist.get_world_size()}


dist_worker.SCENARIOS.update({name.removeprefix("scenario_"): fn for name, fn in list(globals().items())
                              if name.startswith("scenario_")})

if __name__ == "__main__":
    if sys.argv[1:] != ["--zygote"]:
        sys.exit("usage: torchtitan_worker.py --zygote")
    dist_worker.main()
