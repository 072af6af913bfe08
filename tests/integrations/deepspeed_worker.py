"""One rank of a DeepSpeed scenario for tests/integrations/test_deepspeed.py.

``python deepspeed_worker.py SCENARIO ARGS_JSON OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and DS_ACCELERATOR=cpu set; writes ``OUT_DIR/rankN.json`` with what it saw.
Real DeepSpeed engines (ZeRO-1/2/3, AdamW with torch_adam, WarmupLR) on gloo, a tiny model, in
fp32 or ARGS ``precision`` ("bf16", "fp16": a dynamic loss scaler; the CPU accelerator runs
both). With CASCKPT_TEST_DEVICE=cuda (and DS_ACCELERATOR=cuda): DeepSpeed's CUDA accelerator
on NCCL, rank r on GPU r.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

DEVICE = os.environ.get("CASCKPT_TEST_DEVICE", "cpu")
os.environ.setdefault("DS_ACCELERATOR", DEVICE)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from casckpt.integrations import deepspeed as casckpt_ds  # noqa: E402


def build(stage: int, seed: int, frozen: int = 0) -> Any:
    """A ZeRO engine over a tiny MLP (plus, with ``frozen``, a frozen frozen x frozen layer)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    if frozen:
        first = torch.nn.Linear(frozen, 16)
        first.requires_grad_(False)
        layers.append(first)
    layers += [torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)]
    model = torch.nn.Sequential(*layers)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 1_000_000,
              "casckpt": {"store": ARGS.get("store", ""), "run": "ds"}}
    config |= PRECISION.get(ARGS.get("precision", "fp32"), {})
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


PRECISION: dict[str, dict[str, Any]] = {
    "bf16": {"bf16": {"enabled": True}},
    # the dynamic loss scaler from 2**8, doubled every 2 clean steps: its state moves with each save
    "fp16": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2,
                      "hysteresis": 2, "min_loss_scale": 1}},
}


def train(engine: Any, steps: int, frozen: int = 0) -> None:
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * engine.global_steps + dist.get_rank())
        x = torch.randn(2, frozen or 16, generator=g).to(engine.device, dtype)  # a no-op on CPU, fp32
        noise = torch.rand(()).item()  # draws from the global RNG: a restored RNG state shows
        loss = (engine(x) - noise).pow(2).mean()
        engine.backward(loss)
        engine.step()


def digest(obj: Any) -> str:
    """A hash of every tensor's bytes and every plain value in ``obj``, in order."""
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k, v in o.items():
                h.update(f"K{k!r}".encode())
                walk(v)
        elif isinstance(o, (list, tuple)):
            h.update(f"L{len(o)}".encode())
            for v in o:
                walk(v)
        elif o is None or isinstance(o, (int, float, str, bytes, bool, torch.dtype)):  # fp16's scaler
            h.update(f"V{type(o).__name__}{o!r}".encode())
        else:
            h.update(f"O{type(o).__qualname__}".encode())
            walk(vars(o))

    walk(obj)
    return h.hexdigest()


def state(engine: Any) -> dict[str, str]:
    """Digests of what a checkpoint must bring back, part by part."""
    return {"module": digest(engine.module.state_dict()), "optimizer": digest(engine.optimizer.state_dict()),
            "lr_scheduler": digest(engine.lr_scheduler.state_dict()), "steps": str(engine.global_steps),
            "rng": digest(torch.get_rng_state())}


CLIENT_KEYS = ("epoch", "note", "betas")


def client_state(engine: Any) -> dict[str, Any]:
    return {"rng": torch.get_rng_state(), "epoch": 3, "note": "ds", "betas": (0.9, 0.95)}


def resumed(engine: Any, client: Any) -> dict[str, str]:
    torch.set_rng_state(client["rng"])
    return {**state(engine), "client": digest({k: client[k] for k in CLIENT_KEYS})}


def compare(out: dict[str, Any]) -> None:
    """Save one state through DeepSpeed's TorchCheckpointEngine and through casckpt, load each
    into a fresh engine, train on: everything must match bit for bit."""
    stage, torch_dir, ds_dir = ARGS["stage"], ARGS["torch_dir"], ARGS["ds_dir"]
    engine = build(stage, seed=0)
    train(engine, 3)
    out["ran_on"] = {"device": str(engine.device), "backend": dist.get_backend(),
                     "dtype": str(next(engine.module.parameters()).dtype),
                     "loss_scale": getattr(engine.optimizer, "cur_scale", None)}
    client = client_state(engine)
    engine.save_checkpoint(torch_dir, tag="t3", client_state=client)
    ce = casckpt_ds.install(engine, background=ARGS.get("background", False))
    if ARGS.get("background"):
        slow_commits(ce.store)
    engine.save_checkpoint(ds_dir, tag="t3", client_state=client)
    out["saved"] = {**state(engine), "client": digest({k: client[k] for k in CLIENT_KEYS})}
    train(engine, 2)  # with background: while the commit thread has not read the files yet
    out["continued"] = state(engine)
    out["committed_during_training"] = ce.last_version is not None
    ce.close()

    by_torch = build(stage, seed=1)
    _, loaded = by_torch.load_checkpoint(torch_dir, tag="t3")
    out["torch_loaded"] = resumed(by_torch, loaded)
    train(by_torch, 2)
    out["torch_continued"] = state(by_torch)

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(ds_dir)  # resume from the catalog alone: markers and latest are rewritten
    dist.barrier()
    by_casckpt = build(stage, seed=2)
    ce = casckpt_ds.install(by_casckpt)
    _, loaded = casckpt_ds.load_checkpoint(by_casckpt, ds_dir)
    out["casckpt_loaded"] = resumed(by_casckpt, loaded)
    train(by_casckpt, 2)
    out["casckpt_continued"] = state(by_casckpt)
    out["files"] = sorted(str(p.relative_to(ds_dir)) for p in Path(ds_dir).rglob("*") if p.is_file())
    ce.close()


def slow_commits(store: Any) -> None:
    """Background commits start 1 s late: the training steps after the save run first."""
    commit = store.commit

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1)
        return commit(*args, **kwargs)

    store.commit = late


def killed_in_background(out: dict[str, Any]) -> None:
    """Save at step 3 (waited for); at step 5 rank 1 dies in its background commit, while rank 0
    waits for it: the wait raises, and the catalog holds step 3 only."""
    engine = build(ARGS["stage"], seed=0)
    ce = casckpt_ds.install(engine, background=True)
    train(engine, 3)
    engine.save_checkpoint(ARGS["ds_dir"], client_state=client_state(engine))
    ce.wait()
    out["saved"] = state(engine)
    Path(ARGS["out"], f"saved{dist.get_rank()}.json").write_text(json.dumps(out))
    train(engine, 2)
    if dist.get_rank() == 1:
        def die(*args: Any, **kwargs: Any) -> None:
            time.sleep(1)  # after save_checkpoint's last barrier (the training group's)
            os.kill(os.getpid(), signal.SIGKILL)
        ce.store.commit = die  # type: ignore[method-assign]
    engine.save_checkpoint(ARGS["ds_dir"], client_state=client_state(engine))
    out["save_returned"] = True
    Path(ARGS["out"], f"saved{dist.get_rank()}.json").write_text(json.dumps(out))
    out["wait"] = failure(ce.wait)
    out["versions"] = [v.step for v in ce.store.log("ds")]
    ce.store.close()


def marker_fails(out: dict[str, Any]) -> None:
    """Rank 1's disk is full as its background commit writes its markers (after the version is
    published): the next save raises on every rank, none waits for another."""
    engine = build(ARGS["stage"], seed=0)
    ce = casckpt_ds.install(engine, background=True)
    if dist.get_rank() == 1:
        def full(*args: Any) -> None:
            raise OSError(28, "No space left on device")
        casckpt_ds.write_marker = full  # type: ignore[attr-defined]
    train(engine, 2)
    engine.save_checkpoint(ARGS["ds_dir"])
    train(engine, 1)
    out["next_save"] = failure(lambda: engine.save_checkpoint(ARGS["ds_dir"]))
    out["versions"] = [v.step for v in ce.store.log("ds")]
    ce.close()


def exit_in_flight(out: dict[str, Any]) -> None:
    """Save in the background and end the script at once, without close(): the process
    waits for the commit as it ends."""
    engine = build(ARGS["stage"], seed=0)
    ce = casckpt_ds.install(engine, background=True)
    slow_commits(ce.store)
    train(engine, 2)
    engine.save_checkpoint(ARGS["ds_dir"], client_state=client_state(engine))
    out["saved"] = state(engine)
    out["in_flight"] = ce.last_version is None


def killed(out: dict[str, Any]) -> None:
    """Save at step 3; at step 5 rank 1 dies while handing DeepSpeed's files to the engine."""
    engine = build(ARGS["stage"], seed=0)
    ce = casckpt_ds.install(engine)
    train(engine, 3)
    engine.save_checkpoint(ARGS["ds_dir"], client_state=client_state(engine))
    out["saved"] = state(engine)
    Path(ARGS["out"], f"saved{dist.get_rank()}.json").write_text(json.dumps(out))
    train(engine, 2)
    if dist.get_rank() == 1:
        def die(state_dict: Any, path: str) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        ce.save = die  # type: ignore[method-assign]
    engine.save_checkpoint(ARGS["ds_dir"], client_state=client_state(engine))
    out["unexpected"] = "the save with a dead rank returned"


def resume(out: dict[str, Any]) -> None:
    engine = build(ARGS["stage"], seed=5)
    ce = casckpt_ds.install(engine)
    _, loaded = casckpt_ds.load_checkpoint(engine, ARGS["ds_dir"])
    torch.set_rng_state(loaded["rng"])
    out["loaded"] = state(engine)
    out["versions"] = [v.step for v in ce.store.log("ds")]
    ce.close()


def rollback(out: dict[str, Any]) -> None:
    """Saves at steps 2, 3, 4, a rollback to global_step2, and what the saves after it do."""
    engine = build(ARGS["stage"], seed=0)
    ce = casckpt_ds.install(engine)
    folder = ARGS["ds_dir"]
    for steps in (2, 1, 1):
        train(engine, steps)
        engine.save_checkpoint(folder)
    casckpt_ds.load_checkpoint(engine, folder, tag="global_step2")
    out["released"] = ce._loaded is None
    train(engine, 1)
    out["resave"] = failure(lambda: engine.save_checkpoint(folder))  # step 3 again
    out["refused"] = failure(lambda: engine.save_checkpoint(folder, tag="odd", client_state={"x": object()}))
    if dist.get_rank() == 0:  # what the resave's message says to do
        ce.store.fork("ds@2", "ds-b")
    dist.barrier()
    ce.close()
    ce = casckpt_ds.install(engine, run="ds-b")
    engine.save_checkpoint(folder)
    out["saved"] = state(engine)
    ce.close()
    fresh = build(ARGS["stage"], seed=5)
    ce = casckpt_ds.install(fresh, run="ds-b")
    out["resumed_tag"], _ = casckpt_ds.load_checkpoint(fresh, folder)
    out["loaded"] = state(fresh)
    out["steps"] = {run: [v.step for v in ce.store.log(run)] for run in ("ds", "ds-b")}
    ce.close()


def failure(call: Any) -> str | None:
    try:
        call()
    except Exception as exc:  # the test compares the error types of the ranks
        return type(exc).__name__
    return None


def dedup(out: dict[str, Any]) -> None:
    """Two saves of a model whose big layer is frozen: the second stores little."""
    frozen = ARGS["frozen"]
    engine = build(ARGS["stage"], seed=0, frozen=frozen)
    ce = casckpt_ds.install(engine)
    saves = []
    for _ in range(2):
        train(engine, 2, frozen)
        engine.save_checkpoint(ARGS["ds_dir"])
        version = ce.last_version
        assert version is not None
        saves.append({"logical": version.logical_bytes, "new": version.new_bytes,
                      "stored": version.stored_bytes})
    out["saves"] = saves
    ce.close()


def universal(out: dict[str, Any]) -> None:
    """Load a universal checkpoint (ds_to_universal's output) on this world size: a reshard."""
    stage = ARGS["stage"]
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1_000_000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(ARGS["load_dir"], tag=ARGS["tag"])
    out["loaded"] = state(engine)


def timing(out: dict[str, Any]) -> None:
    """Not a test: CPU seconds of saves through TorchCheckpointEngine and through casckpt, each
    save after a step, on a ``width``-wide MLP (the report's quick measurement)."""
    import time

    width = ARGS["width"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1_000_000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "casckpt": {"store": ARGS["store"], "run": "t"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    original = engine.checkpoint_engine
    ce = casckpt_ds.install(engine)
    rows = []
    for i in range(ARGS["saves"]):
        pair = (("torch", original), ("casckpt", ce))
        for name, chosen in (pair[::-1] if ARGS.get("casckpt_first") else pair):
            engine.checkpoint_engine = chosen
            x = torch.randn(2, width)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            engine.save_checkpoint(ARGS[f"{name}_dir"])
            rows.append({"save": i, "engine": name, "cpu_s": time.process_time() - cpu,
                         "wall_s": time.perf_counter() - wall})
    out["rows"] = rows
    ce.close()


ARGS: dict[str, Any] = {}

if __name__ == "__main__":
    scenario, ARGS, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    if DEVICE == "cuda":  # one GPU a rank: NCCL cannot run two ranks on one GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # The CPU accelerator compiles a shared-memory allreduce kernel (g++, about a minute, cached
        # in ~/.cache, which the suite points into its temp dir): the tests run on gloo without it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo",
                               timeout=timedelta(seconds=60))
    result: dict[str, Any] = {}
    scenarios = {"compare": compare, "killed": killed, "killed_in_background": killed_in_background,
                 "resume": resume, "dedup": dedup, "timing": timing, "marker_fails": marker_fails,
                 "exit_in_flight": exit_in_flight,
                 "universal": universal, "rollback": rollback}
    scenarios[scenario](result)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
