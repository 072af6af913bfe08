"""casckpt quickstart: commit full training state, survive a crash, resume bit-identically.

    python examples/quickstart.py [--store DIR]

1. A child process trains a small classifier, commits its whole training state
   (model, optimizer, LR scheduler, RNG, data position) every EVERY steps, and
   is killed with SIGKILL partway through.
2. A fresh trainer restores "quickstart@latest" and trains on to the end.
3. The result is compared, bit for bit, with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

import torch
from torch import nn

import casckpt
from casckpt.format.state import iter_leaves

RUN, STEPS, EVERY, CRASH_AT, BATCH = "quickstart", 40, 10, 25, 64

# A bit-identical continuation needs bit-identical arithmetic in the crashed child and in the
# process that resumes: with several threads, how a matrix product is split between them (and
# so the order of its float sums) can change with the machine's load, and the last bits with
# it. One thread makes the demo's training itself deterministic; what is stored and restored
# is exact either way (every byte is verified).
torch.set_num_threads(1)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Trainer:
    """Everything a resumed run needs, behind state_dict() / load_state_dict()."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)  # a fixed synthetic data set
        self.x = torch.randn(1024, 64, generator=g)
        self.y = (self.x @ torch.randn(64, 10, generator=g)).argmax(dim=1)
        torch.manual_seed(0)  # the same initial weights in every process
        self.model = nn.Sequential(
            nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 10)
        )
        self.model[0].requires_grad_(False)  # a frozen "backbone": its chunks dedup
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=3e-3, total_steps=STEPS)
        self.step, self.epoch, self.position = 0, 0, 0

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state()},  # dropout draws from it
            "data": {"step": self.step, "epoch": self.epoch, "position": self.position},
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        data = state["data"]
        self.step, self.epoch, self.position = data["step"], data["epoch"], data["position"]

    def train_step(self) -> float:
        # A deterministic data loader: one shuffle per epoch, resumable from (epoch, position).
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        batch = order[self.position : self.position + BATCH]
        self.position += BATCH
        if self.position >= len(self.x):
            self.epoch, self.position = self.epoch + 1, 0
        loss = nn.functional.cross_entropy(self.model(self.x[batch]), self.y[batch])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        return loss.item()


def train(trainer: Trainer, run: casckpt.Run | None = None, crash_at: int | None = None) -> None:
    while trainer.step < STEPS:
        loss = trainer.train_step()
        if run is not None and trainer.step % EVERY == 0:
            v = run.save(trainer.state_dict(), trainer.step, metrics={"loss": loss})
            print(f"   commit {RUN}@{v.step:<3} loss {loss:.4f}  {v.short_id}  logical "
                  f"{human(v.logical_bytes)}, new {human(v.new_bytes)}, stored "
                  f"{human(v.stored_bytes)}", flush=True)
        if trainer.step == crash_at:
            print(f"   ** killed at step {trainer.step} **", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def differences(actual: dict, expected: dict) -> list[str]:
    """Dotted paths of the leaves that differ; tensors compared with torch.equal (bitwise)."""
    want, differ = dict(iter_leaves(expected)), []
    for path, value in iter_leaves(actual):
        same = torch.equal(value, want[path]) if torch.is_tensor(value) else value == want[path]
        if not same:
            differ.append(path)
    return differ


def show(store: casckpt.Store) -> None:
    print(f"\nstore.log({RUN!r}):")
    print(f"   {'step':>4}  {'id':12}  {'loss':>6}  {'logical':>9}  {'new':>9}  {'stored':>9}")
    for v in store.log(RUN):
        sizes = "  ".join(f"{human(n):>9}" for n in (v.logical_bytes, v.new_bytes, v.stored_bytes))
        print(f"   {v.step:>4}  {v.short_id}  {v.metrics['loss']:>6.4f}  {sizes}")
    s = store.ops.stats()
    print(f"\nstore.ops.stats(): {s.versions} versions, {s.chunks} chunks in {s.packs} pack(s); "
          f"logical {human(s.logical_bytes)}, unique {human(s.unique_bytes)}, stored "
          f"{human(s.stored_bytes)} (dedup {s.dedup_ratio:.2f}x, "
          f"compression {s.compression_ratio:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="a new store directory (default: a fresh temp dir)")
    parser.add_argument("--crash-at", type=int, help=argparse.SUPPRESS)  # used by the child
    args = parser.parse_args()
    if args.crash_at is not None:
        with casckpt.open(args.store) as store:
            train(Trainer(), store.run(RUN), crash_at=args.crash_at)
        return 0

    path = args.store or tempfile.mkdtemp(prefix="casckpt-quickstart-")
    print(f"store: {path}\n1. training in a child process, committing every {EVERY} steps")
    child = subprocess.run([sys.executable, __file__, "--store", path, "--crash-at", str(CRASH_AT)])
    print(f"   child exited with code {child.returncode}")

    with casckpt.open(path) as store:
        run = store.run(RUN)  # a handle on the run: save / restore / latest_step / log ...
        resumed = Trainer()  # fresh weights, empty optimizer state, reseeded RNG
        run.restore("latest", into=resumed)  # calls resumed.load_state_dict(...)
        print(f"2. restored {RUN}@latest (step {run.latest_step()}) into a fresh trainer at step "
              f"{resumed.step}")
        train(resumed, run)
        final = resumed.state_dict()

        print(f"3. an uninterrupted {STEPS}-step run, for comparison")
        reference = Trainer()
        train(reference)
        differ = differences(final, reference.state_dict())
        if differ:
            print(f"   continuation DIFFERS from the uninterrupted run at: {', '.join(differ)}")
        else:
            print("   continuation is bit-identical to the uninterrupted run")

        show(store)
        report = store.ops.check()
        print(f"store.ops.check(): {'ok' if report.ok else report.problems}")

    crashed = child.returncode == -signal.SIGKILL
    return 0 if crashed and not differ and report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
