"""Runs multi-rank scenarios for tests: ``python dist_worker.py --zygote``.

The zygote imports torch, torch.distributed.checkpoint and casckpt once, then
for every JSON line ``{"scenario", "world", "args", "timeout"}`` forks
``world`` ranks that join a gloo process group on 127.0.0.1 (the job's
``backend`` if it names one: with "nccl", rank r uses GPU r), run the
scenario and exit. It answers ``{"codes": [...], "results": [...],
"errors": [...]}`` (exit code, JSON result and traceback per rank; code
"timeout" for a rank it had to kill). A scenario may SIGKILL its own rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

import casckpt
from casckpt.testing.internals import internals

CHUNK = 1 << 16  # small chunks, so shard boundaries cut through tensors of test size
PACK = 1 << 18


def full_state(seed: int) -> dict[str, Any]:
    """The whole (unsharded) state every scenario saves: row counts that do not divide evenly."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.emb": torch.randn(4001, 64, generator=g),  # sharded on dim 0, uneven
        "model.w1": torch.randn(1030, 130, generator=g).to(torch.bfloat16),  # dim 0
        "model.w2": torch.randn(96, 250, generator=g),  # sharded on dim 1
        "model.bias": torch.randn(777, generator=g),  # replicated
        "optim.exp_avg": torch.randn(4001, 64, generator=g),  # dim 0
        "optim.count": torch.arange(300, dtype=torch.int64) * seed,  # replicated int
        "step": 1000 + seed,
        "meta": {"lr": 3e-4, "betas": (0.9, 0.95), "name": f"seed{seed}", "blob": b"\x00\xff"},
    }


PLACEMENT = {"model.emb": Shard(0), "model.w1": Shard(0), "model.w2": Shard(1), "optim.exp_avg": Shard(0)}


def sharded(full: dict[str, Any], world: int) -> dict[str, Any]:
    """``full`` as this rank holds it: DTensors for the sharded entries, the rest replicated."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for key, value in full.items():
        placement = PLACEMENT.get(key)
        out[key] = distribute_tensor(value, mesh, [placement]) if placement is not None else value
    return out


def blank(full: dict[str, Any], world: int) -> dict[str, Any]:
    """A state of the same structure with every tensor zeroed and every value wrong."""
    zeros = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in full.items()}
    state = sharded(zeros, world)
    state["step"], state["meta"] = -1, {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "blob": b""}
    return state


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def compare(loaded: dict[str, Any], full: dict[str, Any], world: int) -> list[str]:
    """Keys whose loaded value (this rank's piece) differs from ``full`` bit for bit."""
    expected = sharded(full, world)
    bad = []
    for key, want in expected.items():
        got = loaded[key]
        if isinstance(want, DTensor):
            if not isinstance(got, DTensor) or bits(got.to_local()) != bits(want.to_local()):
                bad.append(key)
        elif isinstance(want, torch.Tensor):
            if bits(got) != bits(want):
                bad.append(key)
        elif got != want:
            bad.append(key)
    return bad


def open_store(args: dict[str, Any]) -> casckpt.Store:
    os.environ.update(args.get("env", {}))
    return casckpt.open(args["path"], chunk_size=CHUNK, pack_size=PACK, **args.get("open", {}))


def _publish_points() -> dict[str, tuple[type, str, Any]]:
    """The steps of a coordinator's publish a test may stop it at: (class, method, which calls)."""
    from casckpt.catalog import Catalog
    from casckpt.storage import LocalBlobStore

    def is_manifest(args: tuple[Any, ...]) -> bool:
        return str(args[0]).startswith("manifests/")

    return {
        "catalog.add_pack": (Catalog, "add_pack", None),  # a pack of the coordinator's own chunks
        "blobs.put_manifest": (LocalBlobStore, "put", is_manifest),  # the manifest object's write
        # the manifest's temporary file is written and fsync'd, not yet renamed into place
        "blobs.place_manifest": (LocalBlobStore, "_place", lambda args: is_manifest(args[1:])),
        "catalog.add_version": (Catalog, "add_version", None),  # the publishing transaction
        # the publishing transaction's last statement (its audit row), not yet committed
        "catalog.audit_in": (Catalog, "audit_in", lambda args: args[1] == "commit"),
        # the transaction that ends a lease, not begun yet (``before`` only)
        "catalog.end_lease": (Catalog, "write", lambda args: sys._getframe(2).f_code.co_name == "end_lease"),
    }


def arm(rank: int, args: dict[str, Any]) -> None:
    """Arm each of ``args["stops"]`` (or the one ``args["stop"]``) meant for this rank."""
    for stop in args.get("stops", [args["stop"]] if "stop" in args else []):
        if stop.get("rank", 0) == rank:
            _arm_one(stop)


def _arm_one(stop: dict[str, Any]) -> None:
    """Stop this rank (the coordinator unless ``stop["rank"]`` says) at ``stop["point"]``
    (``before`` or ``after`` the real call, ``stop["when"]``): SIGKILL it (``how: kill``), or
    (``how: pause``) write its pid to ``DIR/paused`` and wait until ``DIR/go`` exists
    (``stop["dir"]``), or (``how: raise``) raise a transient CatalogError. Only the first call
    that reaches the point stops. ``elsewhere``: the rank's leases say another host took them
    (gc judges them by age alone, never by pid)."""
    if stop.get("elsewhere"):
        from casckpt.catalog import leases
        leases._process_space = lambda: "another-host|boot|pid-ns"
    cls, name, accept = _publish_points()[stop["point"]]
    original = getattr(cls, name)

    stopped = [False]

    def halt() -> None:
        if stop["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if stop["how"] == "raise":
            from casckpt.errors import CatalogError
            raise CatalogError("injected: connection reset by peer")
        where = Path(stop["dir"])
        (where / "paused.tmp").write_text(str(os.getpid()))
        (where / "paused.tmp").rename(where / "paused")
        while not (where / "go").exists():
            time.sleep(0.01)

    def wrapper(self: object, *args: Any, **kwargs: Any) -> Any:
        hit = not stopped[0] and (accept is None or accept(args))
        stopped[0] = stopped[0] or hit
        if hit and stop["when"] == "before":
            halt()
        result = original(self, *args, **kwargs)
        if hit and stop["when"] == "after":
            halt()
        return result

    setattr(cls, name, wrapper)


class FailingPlanner(DefaultSavePlanner):
    """Raises (or SIGKILLs the rank) on the rank and at the item ``fail`` names."""

    def __init__(self, fail: dict[str, Any], rank: int) -> None:
        super().__init__()
        self.fail, self.rank, self.seen = fail, rank, 0

    def resolve_data(self, write_item: Any) -> Any:
        self.seen += 1
        if self.rank == self.fail["rank"] and self.seen > self.fail["after"]:
            if self.fail["how"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, "injected: no space left on device")
        return super().resolve_data(write_item)


def scenario_dcp_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = sharded(full_state(args["seed"]), world)
    planner = FailingPlanner(args["fail"], rank) if "fail" in args else None
    arm(rank, args)
    with open_store(args) as store:
        writer = store.dcp_writer(run=args["run"], step=args["step"], metrics={"loss": 0.5})
        if args.get("async"):  # as docs/guides/dcp.md: on a gloo group of its own
            group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group)
            for _ in range(3):  # training's collectives on the default group, while the save runs
                dist.all_reduce(torch.ones(1))
            future.result()
        else:
            dcp.save(state, storage_writer=writer, planner=planner)
    return {}


def scenario_dcp_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    bad = {}
    with open_store(args) as store:
        for ref, seed in args["refs"]:
            full = full_state(seed)
            state = blank(full, world)
            dcp.load(state, storage_reader=store.dcp_reader(ref))
            bad[ref] = compare(state, full, world)
    return {"bad": bad}


def group_state(rank: int, seed: int) -> dict[str, Any]:
    """Per-rank state: a replicated model (same on every rank) and rank-specific parts."""
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        "model": {"w": torch.randn(300, 100, generator=shared), "b": torch.randn(100, generator=shared)},
        "rng": torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=own),
        "loader": {"position": rank * 1000 + seed, "epoch": 3},
    }


def scenario_group_commit(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = group_state(rank, args["seed"])
    if args.get("bad_rank") == rank:
        state["loader"]["sampler"] = object()  # unsupported: this rank fails while hashing
    arm(rank, args)
    if args.get("read_only_rank") == rank:  # a store read-only on this rank's host alone
        args = {**args, "open": {**args.get("open", {}), "read_only": True}}
    with open_store(args) as store:
        if args.get("preflight_fail") == rank:  # this rank fails before any collective of its own
            def unreachable() -> None:
                raise casckpt.errors.StorageError("injected: a location cannot be listed")

            internals(store).core.refresh_locations = unreachable  # type: ignore[method-assign]
        try:
            version = store.commit(state, run=args["run"], step=args["step"], group=dist.group.WORLD)
        except casckpt.errors.GroupCommitError as exc:
            return {"error": str(exc), "cause": type(exc.__cause__).__name__}
        return {"id": version.id, "new_bytes": version.new_bytes}


def scenario_group_restore(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    want = group_state(rank, args["seed"])
    with open_store(args) as store:
        got = store.restore(args["ref"], group=dist.group.WORLD)
    same = (bits(got["model"]["w"]) == bits(want["model"]["w"]) and bits(got["rng"]) == bits(want["rng"])
            and got["loader"] == want["loader"])
    return {"same": same}


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items()
             if name.startswith("scenario_")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, job: dict[str, Any], out: Path) -> None:
    code = 1
    try:
        backend = job.get("backend", "gloo")
        if "nccl" in backend:  # CUDA must not be initialised in the zygote (fork)
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=job.get("pg_timeout", 60)))
        result = SCENARIOS[job["scenario"]](rank, world, job["args"])
        (out / f"{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        code = 0
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
    finally:
        sys.stdout.flush()
        os._exit(code)


def _run(job: dict[str, Any]) -> dict[str, Any]:
    world, port = int(job["world"]), _free_port()
    out = Path(tempfile.mkdtemp(prefix="dist-job-"))
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank_main(rank, world, port, job, out)
        pids.append(pid)
    deadline = time.monotonic() + float(job.get("timeout", 120))
    codes: list[Any] = [None] * world
    while any(c is None for c in codes):
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[i] = "timeout"
        time.sleep(0.02)
    results = [json.loads(p.read_text()) if (p := out / f"{r}.json").exists() else None for r in range(world)]
    errors = [p.read_text() if (p := out / f"{r}.err").exists() else None for r in range(world)]
    return {"codes": codes, "results": results, "errors": errors}


def main() -> None:
    for line in sys.stdin:
        reply = _run(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] != ["--zygote"]:
        sys.exit("usage: dist_worker.py --zygote")
    main()
