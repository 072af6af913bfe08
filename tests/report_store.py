"""A small store with something in every section of a report (tests, and docs/report.png).

    python tests/report_store.py STORE_DIR OUT.html   # builds the store, writes the report

Three runs (a base run and two forks of it) with metrics and tags, one run with a
keep_best retention, a gc that purged versions, and restore drills. Until the drills
branch (issue 21) is merged, :func:`contract_stand_ins` gives ``Store.drill_history`` and
``Version.stall_s`` hand-made stand-ins (the contract's shapes); with the real ones in
place it changes nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import casckpt
from casckpt.types import Version

RUNS = ("base", "ft-lr", "ft-wd")


@dataclass(frozen=True)
class StandInDrill:
    """The shape of the contract's DrillResult."""

    drill_id: str
    at: float
    version_id: str
    run: str
    step: int
    bytes: int
    seconds: float
    ok: bool
    error: str | None


@contextmanager
def contract_stand_ins() -> Iterator[None]:
    """Stand-ins for ``Store.drill_history`` (recorded drills: ``store._stand_in_drills``)
    and ``Version.stall_s`` (a quarter of the commit's time) where they do not exist yet."""
    added: list[tuple[type, str]] = []
    if not hasattr(casckpt.Store, "drill_history"):
        def drill_history(self: Any, limit: int = 100, run: str | None = None) -> list[StandInDrill]:
            found = [d for d in getattr(self, "_stand_in_drills", []) if run is None or d.run == run]
            return sorted(found, key=lambda d: -d.at)[:limit]
        casckpt.Store.drill_history = drill_history  # type: ignore[attr-defined]
        added.append((casckpt.Store, "drill_history"))
    if not hasattr(Version, "stall_s"):
        Version.stall_s = property(lambda self: self.duration_s / 4)  # type: ignore[attr-defined]
        added.append((Version, "stall_s"))
    try:
        yield
    finally:
        for owner, name in added:
            delattr(owner, name)


_STAND_IN_ERROR = "ChunkCorruptError: chunk 3f2a... of pack 91c0... does not match its id"


def _failed(drill: int, run: str) -> bool:
    return drill == 1 and run == "ft-wd"


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
    if hasattr(store, "drill"):
        store.drill(count=3)
    else:
        latest = [store.resolve(f"{r}@latest") for r in RUNS]
        now = time.time()
        store._stand_in_drills = [  # type: ignore[attr-defined]
            StandInDrill(f"d{i}", now - 3600 * (3 - i), v.id, v.run, v.step, v.logical_bytes,
                         0.05 + 0.01 * i, not _failed(i, v.run),
                         _STAND_IN_ERROR if _failed(i, v.run) else None)
            for i in range(3) for v in latest]
    return store


if __name__ == "__main__":
    with contract_stand_ins(), build(Path(sys.argv[1])) as demo:
        print(demo.report(sys.argv[2]))
