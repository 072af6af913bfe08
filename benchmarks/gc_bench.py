"""GC benchmark: mark + sweep of a synthetic catalog of 1,000 versions / 1 M chunks.

    python benchmarks/gc_bench.py [--scale S] [--out FILE] [--dir DIR]

Builds the catalog directly through SQL (bulk inserts, no tensor data: GC
reads only the catalog and deletes pack objects, which exist as small files),
deletes half of the versions, and times one ``Store.gc(grace=0)`` in a fresh
child process whose peak RSS is read from the kernel. Targets
(BENCHMARKS.md): mark + sweep <= 60 s, memory <= 512 MiB, at scale 1.0.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # measure the casckpt of this checkout
    sys.path.insert(0, str(REPO_ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import casckpt  # noqa: E402
from benchmarks.oldformats import encode_manifest  # noqa: E402
from casckpt.catalog import schema as s  # noqa: E402
from casckpt.engine.versions.tensorrows import tensor_rows  # noqa: E402
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry  # noqa: E402
from casckpt.testing.internals import internals  # noqa: E402

VERSIONS, CHUNKS = 1000, 1_000_000
TENSORS_PER_VERSION = 10
CHUNKS_PER_PACK = 4096
TARGET_S, TARGET_MIB = 60.0, 512.0


def _chunk_id(n: int) -> bytes:
    return n.to_bytes(32, "big")


def build(root: Path, scale: float) -> dict[str, int]:
    """A store whose catalog holds VERSIONS*scale versions over CHUNKS*scale distinct chunks."""
    versions = max(4, int(VERSIONS * scale))
    per_tensor = max(1, int(CHUNKS * scale) // (versions * TENSORS_PER_VERSION))
    chunks = versions * TENSORS_PER_VERSION * per_tensor
    with casckpt.open(root) as store:
        catalog = internals(store).catalog
        now = time.time()
        _insert_packs_and_chunks(catalog, root, chunks, now)
        _insert_versions(catalog, versions, per_tensor, now)
        for v in range(versions // 2):  # the older half: their packs become wholly dead
            store.delete(f"bench@{v}")
    return {"versions": versions, "chunks": chunks, "deleted_versions": versions // 2}


def _insert_packs_and_chunks(catalog: Any, root: Path, chunks: int, now: float) -> None:
    packs = (chunks + CHUNKS_PER_PACK - 1) // CHUNKS_PER_PACK
    with catalog.write() as conn:
        conn.execute(s.packs.insert(), [
            {"id": f"{p:064x}", "key": f"packs/{p:064x}"[:8] + f"/{p:064x}", "size": CHUNKS_PER_PACK * 4096,
             "chunks": CHUNKS_PER_PACK, "state": "live", "created_at": now - 3600, "verified_at": None}
            for p in range(packs)
        ])
    for p in range(packs):
        path = root / "packs" / f"{p:064x}"[:2] / f"{p:064x}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    for start in range(0, chunks, 50_000):
        with catalog.write() as conn:
            conn.execute(s.chunks.insert(), [
                {"id": _chunk_id(n).hex(), "pack_id": f"{n // CHUNKS_PER_PACK:064x}",
                 "offset": 8 + (n % CHUNKS_PER_PACK) * 4188, "stored_len": 4096, "raw_len": 4096,
                 "codec": 0, "base_id": None, "state": "live", "created_at": now - 3600,
                 "condemned_at": None}
                for n in range(start, min(start + 50_000, chunks))
            ])


def _manifest(v: int, first: int, per_tensor: int, now: float) -> tuple[str, bytes, list[Any], list[Any]]:
    """Version ``v``: TENSORS_PER_VERSION tensors of ``per_tensor`` chunks each, from chunk ``first``.

    GC marks from verified manifests, so each version gets a real one (and the tensor and
    content rows a commit would derive from it).
    """
    names = [f"layer{t}.weight" for t in range(TENSORS_PER_VERSION)]
    extents = tuple(ExtentEntry(per_tensor * 4096, 4096, tuple(_chunk_id(first + t * per_tensor + i)
                                                               for i in range(per_tensor)))
                  for t in range(TENSORS_PER_VERSION))
    tensors = tuple(TensorEntry(name, "torch", "float32", (per_tensor * 1024,), t)
                    for t, name in enumerate(names))
    root = {"t": "dict", "k": names, "v": [{"t": "tensor", "i": t} for t in range(len(names))]}
    manifest = Manifest("bench", v, None, now - 3600, root, tensors, extents)  # type: ignore[arg-type]
    version_id, data = encode_manifest(manifest)
    rows, contents = tensor_rows(version_id, manifest.tensors, manifest.extents)
    return version_id, data, rows, contents


def _insert_versions(catalog: Any, versions: int, per_tensor: int, now: float) -> None:
    with catalog.write() as conn:
        conn.execute(s.runs.insert().values(name="bench", created_at=now))
        run_id = conn.execute(s.runs.select()).first().id
    for v in range(versions):
        version_id, data, tensors, contents = _manifest(v, v * TENSORS_PER_VERSION * per_tensor,
                                                        per_tensor, now)
        with catalog.write() as conn:
            conn.execute(s.versions.insert().values(
                id=version_id, run_id=run_id, step=v, parent_id=None, state="visible",
                created_at=now - 3600, committed_at=now - 3600, logical_bytes=0, new_bytes=0,
                stored_bytes=0, duration_s=0.0, meta={}, metrics={}, message=None, manifest=data,
            ))
            conn.execute(s.contents.insert(), contents)
            conn.execute(s.tensors.insert(), tensors)


def _child(root: str) -> None:
    with casckpt.open(root, create=False) as store:
        started = time.perf_counter()
        report = store.gc(grace=0)
        elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": elapsed, "peak_rss": peak, "report": report.to_dict()}))


def measure(root: Path) -> dict[str, Any]:
    """Run one GC in a fresh process (so its peak RSS is GC's own) and return its figures."""
    baseline = subprocess.run(
        [sys.executable, "-c", "import resource, casckpt.store;"
         "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
        check=True, capture_output=True, text=True, cwd=REPO_ROOT,
    )
    run = subprocess.run([sys.executable, __file__, "--child", str(root)], check=True,
                         capture_output=True, text=True, cwd=REPO_ROOT)
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    result["import_rss"] = int(baseline.stdout.strip())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/gc.json")
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return 0
    work = Path(tempfile.mkdtemp(prefix=".casckpt-gc-bench-", dir=args.dir))
    try:
        shape = build(work / "store", args.scale)
        result = measure(work / "store")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak_mib, import_mib = result["peak_rss"] / 2**20, result["import_rss"] / 2**20
    table = Table(title=f"GC benchmark (scale {args.scale:g}; targets at scale 1)")
    for column in ("versions", "chunks", "swept", "mark + sweep", "target",
                   "peak RSS of the gc process", "(import alone)", "target"):
        table.add_column(column, justify="right")
    table.add_row(str(shape["versions"]), f"{shape['chunks']:,}",
                  f"{result['report']['chunks_swept']:,}", f"{result['seconds']:.2f} s",
                  f"<= {TARGET_S:g} s", f"{peak_mib:.0f} MiB", f"{import_mib:.0f} MiB",
                  f"<= {TARGET_MIB:g} MiB")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"scale": args.scale, **shape, **result,
                                    "peak_rss_mib": peak_mib, "import_rss_mib": import_mib},
                                   indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
