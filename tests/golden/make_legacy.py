"""Build the golden format-1 stores the tests of old stores start from, under
tests/golden/store-legacy/ (one directory per store, named by its recipe).

casckpt writes only tree manifests (format 3) now; format 1 stays readable and convertible
(``store.ops.migrate_trees``). These stores were written by casckpt's own format-1 writer, so
this script runs only at commit de427d5 (the last commit with that writer, behind
``engine/write/commit.py`` ``TREE_MANIFESTS``), with the states defined here:

    git worktree add /tmp/old de427d5
    PYTHONPATH=/tmp/old python tests/golden/make_legacy.py tests/golden/store-legacy

Never rerun it to "fix" a failing test: later releases must read what it wrote.

Tests copy a store with :func:`legacy`; with a ``catalog`` URL (PostgreSQL) or separate
``blobs``, the copy's objects become the store's location and its catalog is rebuilt from
them, as ``casckpt.open(..., recover=True)`` and ``store.ops.rebuild_catalog()`` do.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).parent / "store-legacy"
KEY = Path(__file__).parent / "store-legacy-encrypted.key"  # a test key: guards nothing real
LAYERS = 6
BIG = 52 << 20  # a plain value whose base64 JSON (69 MiB) passes the 64 MiB a tree node holds
OPTIONS: dict[str, dict[str, Any]] = {  # how each store was opened (and must be opened again)
    "migrations": {"chunk_size": 4096, "pack_size": 64 * 1024},
    "deltas": {"chunk_size": 4096},
    "tree-migration": {"chunk_size": 4096},
    "gc-guard": {"chunk_size": 4096, "pack_size": 16 << 10},
}


def migration_state(step: int) -> dict[str, object]:
    """``migrations`` at ``r@step`` (steps 1-3, tagged ``t<step>``)."""
    return {"w": torch.arange(3000, dtype=torch.float32) * step, "step": step}


def delta_weights(step: int) -> torch.Tensor:
    """``deltas`` at ``r@step`` (steps 1-3; 2 and 3 are delta-coded against 1)."""
    return torch.arange(3000, dtype=torch.float32) * (1 + step * 1e-4)


def tree_state(step: int) -> dict[str, Any]:
    """``tree-migration`` at ``r@0..3`` and ``f@7, f@8`` (``f`` forked at ``r@1``, ``r@2``
    tagged ``best``): layers sharing most tensors across steps, a tied pair (one storage), a
    tensor that changes a little each step (delta-coded), and plain values."""
    g = torch.Generator().manual_seed(0)
    layers = {f"l{i}.w": torch.randn(2000, generator=g) for i in range(LAYERS)}
    layers[f"l{step % LAYERS}.w"] = layers[f"l{step % LAYERS}.w"] + step
    emb = torch.arange(4000, dtype=torch.float32) / 7
    return {"model": {"layers": layers, "emb": emb, "head": emb,  # tied: one extent, two tensors
                      "w": torch.arange(3000, dtype=torch.float32) * (1 + step * 1e-4)},
            "opt": {"lr": 0.1 / (step + 1), "betas": (0.9, 0.99), "name": "adam"}, "step": step}


TREE_REFS = ["r@0", "r@1", "r@2", "r@3", "f@7", "f@8"]


def large_state() -> dict[str, Any]:
    """``large-value`` at ``r@0``: a plain value larger than any tree node may be."""
    return {"w": torch.arange(6, dtype=torch.float32), "blob": bytes(BIG)}


def guard_state(seed: int, n: int = 12_000) -> dict[str, Any]:
    """``gc-guard`` at ``r@1..3``."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g), "step": seed}


def values_state(step: int) -> dict[str, torch.Tensor]:
    """``catalog-values`` at ``r@1, r@2`` (metadata ``{"lr": 1, "note": [1, 2.5, None]}``,
    metrics ``{"loss": 0.5}``)."""
    return {"w": torch.arange(12.0).reshape(3, 4) + step - 1}


def tied(step: int) -> dict[str, torch.Tensor]:
    """``tied`` at ``r@0, r@2``: w and wt share one storage (one shared extent)."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    return {"w": w, "wt": w.t(), "b": torch.ones(3)}


def flat(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Many small tensors: ``previous`` holds ``{"model": flat(300, 1)}`` at ``r@1``;
    ``release`` holds ``{"model": flat(600, i), "step": i}`` at ``r@i``, i in 0-2."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(8, generator=g) for i in range(n)}


def encrypted_state(step: int) -> dict[str, torch.Tensor]:
    """``encrypted`` at ``r@1, r@2`` (keyed chunk ids, key :data:`KEY`)."""
    return {"w": (torch.arange(20_000 * step) % 251).to(torch.uint8)}


def legacy(name: str, root: Path, *, catalog: str | None = None, blobs: Path | None = None) -> Path:
    """A copy of golden store ``name`` at ``root`` (opening may upgrade it: never the original),
    its SQLite catalog naming the copy's location. With ``blobs``, the objects move there.
    With ``catalog`` (PostgreSQL), the objects go to ``blobs`` (default: ``<root>-objects`` beside it) and
    the catalog is rebuilt from them; the location keeps the golden identity record, so the
    catalog may be taken back to revisions older than store generations."""
    if catalog is not None:
        import casckpt

        blobs = blobs or root.parent / f"{root.name}-objects"
        shutil.copytree(GOLDEN / name, blobs,
                        ignore=shutil.ignore_patterns("catalog.db*", "casckpt.toml", "cache"))
        _relocate(blobs)
        with casckpt.open(root, catalog=catalog, blobs=str(blobs), recover=True,
                          **OPTIONS.get(name, {})) as store:
            store.ops.rebuild_catalog()
        shutil.copy(GOLDEN / name / "casckpt-identity", blobs / "casckpt-identity")
        return root
    shutil.copytree(GOLDEN / name, root)
    where = root
    if blobs is not None:
        blobs.mkdir(parents=True)
        for part in ("packs", "manifests", "refs", "casckpt-identity"):
            shutil.move(root / part, blobs / part)
        with (root / "casckpt.toml").open("a") as config:
            config.write(f'blobs = "{blobs}"\n')
        where = blobs
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        db.execute("UPDATE locations SET url = ?", (where.as_uri(),))
    _relocate(where)
    return root


def _relocate(where: Path) -> None:
    """The location record of a copy at ``where`` names the copy (an encrypted record is left
    to ``store.ops.repair()``, which writes it again)."""
    data = (where / "refs" / "locations").read_bytes()
    if not data.startswith(b"{"):
        return
    record = json.loads(data)
    record["locations"][0]["url"] = where.as_uri()
    (where / "refs" / "locations").write_text(json.dumps(record, sort_keys=True))


def _recipes() -> dict[str, Callable[[Path], None]]:
    import casckpt

    def migrations(root: Path) -> None:
        with casckpt.open(root, **OPTIONS["migrations"]) as store:
            for step in (1, 2, 3):
                store.commit(migration_state(step), run="r", step=step, tags=[f"t{step}"])

    def deltas(root: Path) -> None:
        with casckpt.open(root, **OPTIONS["deltas"]) as store:
            for step in (1, 2, 3):
                store.commit({"w": delta_weights(step)}, run="r", step=step)
            assert store.ops.stats().delta_chunks > 0

    def tree_migration(root: Path) -> None:
        with casckpt.open(root, **OPTIONS["tree-migration"]) as store:
            for step in range(4):
                store.commit(tree_state(step), run="r", step=step, tags=["best"] if step == 2 else ())
            store.fork("r@1", "f")
            store.commit(tree_state(7), run="f", step=7)
            store.commit(tree_state(8), run="f", step=8)
            assert store.ops.stats().delta_chunks > 0

    def large_value(root: Path) -> None:
        with casckpt.open(root) as store:
            store.commit(large_state(), run="r", step=0)

    def gc_guard(root: Path) -> None:
        with casckpt.open(root, **OPTIONS["gc-guard"]) as store:
            for step in (1, 2, 3):
                store.commit(guard_state(step), run="r", step=step)

    def catalog_values(root: Path) -> None:
        with casckpt.open(root) as store:
            for step in (1, 2):
                store.commit(values_state(step), run="r", step=step,
                             metadata={"lr": 1, "note": [1, 2.5, None]}, metrics={"loss": 0.5})

    def tied_pair(root: Path) -> None:
        with casckpt.open(root) as store:
            store.commit(tied(0), run="r", step=0)
            store.commit(tied(2), run="r", step=2)

    def previous(root: Path) -> None:
        with casckpt.open(root) as store:
            store.commit({"model": flat(300, 1)}, run="r", step=1)

    def release(root: Path) -> None:
        with casckpt.open(root) as store:
            for i in range(3):
                store.commit({"model": flat(600, i), "step": i}, run="r", step=i)

    def encrypted(root: Path) -> None:
        with casckpt.open(root, key_file=KEY) as store:
            for step in (1, 2):
                store.commit(encrypted_state(step), run="r", step=step)

    return {"migrations": migrations, "deltas": deltas, "tree-migration": tree_migration,
            "large-value": large_value, "gc-guard": gc_guard, "catalog-values": catalog_values,
            "tied": tied_pair, "previous": previous, "release": release, "encrypted": encrypted}


def main(target: str) -> int:
    import casckpt
    from casckpt.engine.write import commit as commit_engine

    if not hasattr(commit_engine, "TREE_MANIFESTS"):
        print("this casckpt writes no format 1: run this script at commit de427d5", file=sys.stderr)
        return 2
    setattr(commit_engine, "TREE_MANIFESTS", False)  # noqa: B010 (gone from later releases)
    out = Path(target)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if not KEY.exists():
        casckpt.generate_key_file(KEY)
    for name, build in _recipes().items():
        build(out / name)
        shutil.rmtree(out / name / "cache")  # this host's index cache: not part of the store
        for wal in (out / name).glob("catalog.db-*"):  # a WAL the last close checkpointed
            wal.unlink()
        print(name, sum(p.stat().st_size for p in (out / name).rglob("*") if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
