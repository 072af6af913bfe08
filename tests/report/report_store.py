"""A small store with something in every section of a report (tests, and docs/report.png).

    python tests/report/report_store.py STORE_DIR OUT.html   # builds the store, writes the report

Three runs (a base run and two forks of it) with metrics and tags, one run with a
keep_best retention, a gc that purged versions, and two restore drills.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

import casckpt

RUNS = ("base", "ft-lr", "ft-wd")


def _state(step: int, drift: float) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1234)
    frozen = torch.randn(256, 256, generator=gen)  # never changes: dedup keeps one copy
    head = torch.randn(128, 256, generator=gen) + drift * step
    return {"model": {"embed": frozen, "head": head}, "step": step}


def build(path: Path) -> casckpt.Store:
    """Build the demo store at ``path`` (open; the caller closes it)."""
    store = casckpt.open(path)
    base = store.run("base", retention={"keep_best": ("loss", 2, "min"), "keep_last": 3})
    for step in range(0, 1200, 100):
        loss = 2.5 * math.exp(-step / 500) + 0.3 + 0.05 * math.sin(step / 90)
        base.save(_state(step, 0.01), step=step, metrics={"loss": loss, "accuracy": 1 - loss / 3})
    store.tag("base@500", "warmup-done")
    store.fork("base@600", "ft-lr")
    store.fork("base@800", "ft-wd")
    for name, drift, bias in (("ft-lr", 0.02, -0.1), ("ft-wd", 0.03, 0.05)):
        fork = store.run(name)
        for step in range(700 if name == "ft-lr" else 900, 1500, 100):
            loss = 2.5 * math.exp(-step / 450) + 0.3 + bias * step / 1500
            fork.save(_state(step, drift), step=step, metrics={"loss": loss, "accuracy": 1 - loss / 3})
    store.tag("ft-lr@1400", "release")
    store.gc(grace=0)
    store.gc(grace=0)  # the first condemns, the second sweeps: two gc rows
    store.ops.drill(count=3)
    store.ops.drill(count=5, seed=1)
    store.mirrors.add("archive", str(path.parent / "archive"), runs=["*"], tags=["release"])
    store.mirrors.push("archive")
    return store


if __name__ == "__main__":
    with build(Path(sys.argv[1])) as demo:
        print(demo.ops.report(sys.argv[2]))
