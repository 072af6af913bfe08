"""Build the golden store whose second location was being emptied when it was written,
under tests/golden/store-draining (``store.locations.drain`` then, ``retire`` since schema
0012). It runs only at commit 6e44d68, the last whose casckpt wrote the state ``draining``
(the catalog at schema 0011, the ``refs/locations`` records on both locations):

    git worktree add /tmp/old 6e44d68
    PYTHONPATH=/tmp/old python tests/golden/make_draining.py tests/golden/store-draining

Never rerun it to "fix" a failing test: later releases must open what it wrote. Tests copy it
with :func:`copy`, which points the catalog and the records at the copy's two directories.

The store: ``replicate:2`` over ``loc0`` (the store directory) and ``loc1`` (``second/``
inside it), versions ``r@1``, ``r@2`` (:func:`state`), then ``loc1`` emptied (pre-0012
spelling: drain) but not repaired yet, so its shards are still there.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "store-draining"


def state(step: int) -> dict[str, object]:
    """The store at ``r@step`` (steps 1 and 2)."""
    return {"w": torch.arange(2000, dtype=torch.float32) * step, "step": step}


def copy(root: Path) -> Path:
    """A copy of the golden store at ``root`` (opening upgrades it: never the original), its
    catalog and its ``refs/locations`` records naming the copy's directories."""
    shutil.copytree(GOLDEN, root)
    urls = {"loc0": root.as_uri(), "loc1": (root / "second").as_uri()}
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:
        for name, url in urls.items():
            db.execute("UPDATE locations SET url = ? WHERE name = ?", (url, name))
    for where in (root, root / "second"):
        record = json.loads((where / "refs" / "locations").read_bytes())
        for entry in record["locations"]:
            entry["url"] = urls[entry["name"]]
        (where / "refs" / "locations").write_text(json.dumps(record, sort_keys=True))
    return root


def main(target: str) -> int:
    import casckpt

    out = Path(target)
    if out.exists():
        shutil.rmtree(out)
    with casckpt.open(out) as store:
        store.locations.add("second", domain="second")
        store.locations.set_redundancy("replicate:2")
        for step in (1, 2):
            store.commit(state(step), run="r", step=step, tags=[f"t{step}"])
        store.locations.drain("loc1")  # pre-0012 spelling: the golden store was written so
    shutil.rmtree(out / "cache")  # this host's index cache: not part of the store
    for wal in out.glob("catalog.db-*"):
        wal.unlink()
    print(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
