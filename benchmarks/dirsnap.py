"""Directory snapshots (issue 18): checkpoint folders added with ``Store.add_dir``.

A fine-tune (the ``frozen`` workload: backbone frozen, ~15% of parameters train, real AdamW
steps) saves ``SAVES`` checkpoint folders the way a Hugging Face Trainer does:
``model.safetensors`` (weights), ``optimizer.pt`` (``torch.save`` of the optimizer state)
and ``trainer_state.json``. Each folder is added as a version. Reported, all from one run:

* bytes: the folders' total size against what casckpt wrote (``new_bytes``, ``stored_bytes``),
  for the format-aware cut and for content-defined chunking alone (the same folders in a
  second store whose files are cut by FastCDC only: what format awareness buys);
* time: ``add_dir`` of each folder against copying it (``shutil.copytree`` + fsync: the cost
  of keeping the folder; the first ``add_dir`` of the process includes its imports, the
  median ratio is reported), and ``checkout`` of the last one (after a warm-up checkout of
  the first) against copying it back (+ fsync).

Run: ``python -m benchmarks.dirsnap --scale 0.1 [--dir DIR] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import save_file

import casckpt
from benchmarks.measure import flat_tensors, path_bytes
from benchmarks.workloads import build
from casckpt.format import segments

SAVES = 5


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _copy(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    shutil.copytree(src, dst, symlinks=True)
    _fsync_tree(dst)
    return time.perf_counter() - start


def _save_checkpoint(state: dict[str, Any], folder: Path, step: int) -> None:
    folder.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in flat_tensors(state["model"]).items()}
    save_file(weights, folder / "model.safetensors")
    torch.save(state["optim"], folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _cdc_only(name: str, data: memoryview, items: Any = None, cdc: Any = None) -> list[segments.Segment]:
    return segments.cdc_segments(data)


def run(scale: float, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure the workload in ``work``; returns the raw numbers and ratios."""
    workload = build("frozen", scale)
    folders = []
    for i in range(SAVES):
        if i:
            workload.advance()
        folders.append(work / f"checkpoint-{i + 1}")
        _save_checkpoint(workload.state(), folders[-1], i + 1)
    logical = [path_bytes(f) for f in folders]
    copies, adds, new, stored, cdc_new = [], [], [], [], []
    with casckpt.open(work / "store") as store, casckpt.open(work / "store-cdc") as cdc_store:
        for i, folder in enumerate(folders):
            copies.append(_copy(folder, work / f"copy-{i}"))
            start = time.perf_counter()
            version = store.add_dir(folder, run="ft", step=i + 1)
            adds.append(time.perf_counter() - start)
            new.append(version.new_bytes)
            stored.append(version.stored_bytes)
            with mock.patch("casckpt.engine.transfer.dirscan.plan_segments", _cdc_only):
                cdc_new.append(cdc_store.add_dir(folder, run="ft", step=i + 1).new_bytes)
            log(f"checkpoint-{i + 1}: {logical[i]} B, new {new[i]} B (cdc only {cdc_new[i]} B), "
                f"add {adds[i]:.3f} s vs copy {copies[i]:.3f} s")
        store.checkout("ft@1", work / "warm-up")  # the process's first read pays for imports
        start = time.perf_counter()
        store.checkout(f"ft@{SAVES}", work / "out")
        _fsync_tree(work / "out")
        checkout_s = time.perf_counter() - start
        copy_back_s = _copy(folders[-1], work / "copy-back")
        identical = all((work / "out" / p.relative_to(folders[-1])).read_bytes() == p.read_bytes()
                        for p in folders[-1].rglob("*") if p.is_file())
    later = slice(1, None)
    return {
        "scale": scale, "saves": SAVES, "folder_bytes": logical, "new_bytes": new,
        "stored_bytes": stored, "cdc_only_new_bytes": cdc_new, "add_s": adds, "copy_s": copies,
        "checkout_s": checkout_s, "copy_back_s": copy_back_s, "identical": identical,
        "ratios": {
            "stored_over_folders_all": sum(stored) / sum(logical),
            "new_over_folder_later": sum(new[later]) / sum(logical[later]),
            "format_aware_over_cdc_only_new_later": sum(new[later]) / max(1, sum(cdc_new[later])),
            "add_over_copy_median": statistics.median(a / c for a, c in zip(adds, copies, strict=True)),
            "checkout_over_copy": checkout_s / copy_back_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=".casckpt-bench-dirsnap-", dir=args.dir))
    try:
        result = run(args.scale, work, lambda line: print(line, file=sys.stderr))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
