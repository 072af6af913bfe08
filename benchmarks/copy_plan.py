"""Planning a copy (issue 34): CPU seconds and peak resident memory of ``copyplan.plan`` for
a run of many versions of many small tensors, in a fresh process.

    python benchmarks/copy_plan.py build STORE [--versions 50] [--tensors 2000] [--share 0.9]
    python benchmarks/copy_plan.py plan STORE
    python benchmarks/copy_plan.py copy STORE

``build`` commits ``--versions`` versions of ``--tensors`` small tensors (64 float32 each) to a
new local store as run ``ft``; at each step the last ``1 - share`` of the tensors change (a
fine-tune's head), the rest are the same as before. ``plan`` opens that store and a new empty
destination (in a temporary directory), then plans a copy of every version of ``ft`` into it
(what ``casckpt copy ft --to ... --dry-run`` does) and prints one JSON line: ``cpu_s``
(``time.process_time`` of the plan alone), ``peak_rss_mib`` (``ru_maxrss``, the whole
process), ``rss_before_mib`` and ``rss_after_mib`` (``/proc/self/statm`` before planning and
with the plan still held), and the plan's totals. Run each ``plan`` in its own process, A/B
interleaved against the base tree (``PYTHONPATH`` picks which casckpt plans). ``copy`` does the
whole copy (``Store.copy``: plan, send, publish) into a new destination and prints the same
measures of it: what reading the plan's nodes again when sending costs.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import casckpt
from casckpt.testing.internals import internals

OPTS = {"chunk_size": 1 << 16, "pack_size": 8 << 20}
_PAGE = 4096


def _rss_mib() -> float:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def state(step: int, tensors: int, share: float) -> dict[str, torch.Tensor]:
    """``tensors`` tensors of 64 float32; those from ``share * tensors`` on change at each step."""
    fixed = int(tensors * share)
    g = torch.Generator().manual_seed(1)
    out = {f"layers.{i}.w": torch.randn(64, generator=g) for i in range(fixed)}
    g = torch.Generator().manual_seed(1000 + step)
    out.update({f"layers.{i}.w": torch.randn(64, generator=g) for i in range(fixed, tensors)})
    return out


def build(root: Path, versions: int, tensors: int, share: float) -> None:
    with casckpt.open(root, **OPTS) as store:
        for step in range(1, versions + 1):
            store.commit(state(step, tensors, share), run="ft", step=step)


def plan(root: Path) -> dict[str, float]:
    from casckpt.engine.copying import copyplan
    from casckpt.engine.read.trees import store_nodes

    with casckpt.open(root, create=False, **OPTS) as src, \
            tempfile.TemporaryDirectory(prefix="copyplan-bench-") as empty, \
            casckpt.open(Path(empty) / "dst", **OPTS) as dst:
        source, dest = internals(src), internals(dst)
        rows = [source.core.row(v.id) for v in reversed(src.log("ft"))]
        before = _rss_mib()
        cpu, wall = time.process_time(), time.perf_counter()
        planned = copyplan.plan(source.catalog, dest.catalog, rows, store_nodes(source.context))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        after = _rss_mib()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"versions": len(planned.versions), "send_chunks": planned.send_chunks,
                "send_bytes": planned.send_bytes, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
                "peak_rss_mib": round(peak, 1)}


def copy(root: Path) -> dict[str, float]:
    with casckpt.open(root, create=False, **OPTS) as src, \
            tempfile.TemporaryDirectory(prefix="copyplan-bench-") as empty, \
            casckpt.open(Path(empty) / "dst", **OPTS) as dst:
        before = _rss_mib()
        cpu, wall = time.process_time(), time.perf_counter()
        report = src.copy("ft", to=dst)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"versions": len(report.versions), "chunks": report.chunks, "cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3), "rss_before_mib": round(before, 1), "peak_rss_mib": round(peak, 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["build", "plan", "copy"])
    parser.add_argument("store", type=Path)
    parser.add_argument("--versions", type=int, default=50)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--share", type=float, default=0.9)
    args = parser.parse_args(argv)
    if args.what == "build":
        build(args.store, args.versions, args.tensors, args.share)
    else:
        print(json.dumps((plan if args.what == "plan" else copy)(args.store)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
