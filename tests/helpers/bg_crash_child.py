"""A process that queues background commits, for the SIGKILL test of tests/test_background.py.

Usage::

    python bg_crash_child.py DIR STEPS

Opens (creating) the store ``DIR/store`` with its packs in ``DIR/blobs``,
behind a blob store that sleeps before every write so that commits stay
pending. Then, like a training loop, for each step ``0 .. STEPS-1`` it
brings its one state to :func:`advance`'s values IN PLACE and commits
it with ``block=False``, printing ``submitted STEP PENDING`` (the commits
pending right after the submit) once ``commit`` has returned. After the last
step it prints ``all submitted``, closes the store (finishing every commit)
and prints ``closed``. The test kills it long before that.

The parent imports this file for :func:`make_state` / :func:`expected`, so
both sides compute the same values.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

RUN = "r"
CHUNK_SIZE = 4096
PACK_SIZE = 4 * CHUNK_SIZE
ELEMS = CHUNK_SIZE // 4  # float32 elements per chunk
WRITE_DELAY = 0.03  # seconds before each blob write


def make_state() -> dict[str, Any]:
    """The state before step 0."""
    gen = torch.Generator().manual_seed(11)
    return {
        "model": {"w": torch.randn(8 * ELEMS, generator=gen), "b": torch.randn(2 * ELEMS, generator=gen)},
        "optim": {"m": torch.zeros(4 * ELEMS), "count": torch.zeros((), dtype=torch.int64)},
    }


def advance(state: dict[str, Any], step: int) -> None:
    """Bring ``state`` from step ``step - 1`` to ``step``, in place (two to four chunks change)."""
    model, optim = state["model"], state["optim"]
    i = step % 8
    model["w"][i * ELEMS : (i + 1) * ELEMS].add_(step + 1)
    model["b"][(step % 2) * ELEMS] = float(step)
    if step % 3 == 2:
        optim["m"].zero_()
    else:
        optim["m"][(step % 4) * ELEMS : (step % 4 + 1) * ELEMS] = float(step)
    optim["count"].fill_(step)


def expected(step: int) -> dict[str, Any]:
    """The state committed at ``step``."""
    state = make_state()
    for s in range(step + 1):
        advance(state, s)
    return state


def main(argv: list[str]) -> int:
    import casckpt
    from casckpt.storage import LocalBlobStore

    class SlowBlobs:
        def __init__(self, inner: LocalBlobStore) -> None:
            self.inner, self.url = inner, inner.url

        def put(self, key: str, data: Any) -> None:
            time.sleep(WRITE_DELAY)
            self.inner.put(key, data)

        def put_file(self, key: str, path: Path) -> None:
            time.sleep(WRITE_DELAY)
            self.inner.put_file(key, path)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    root, steps = Path(argv[0]), int(argv[1])
    blobs = SlowBlobs(LocalBlobStore(root / "blobs"))
    store = casckpt.open(root / "store", blobs=blobs, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE,
                         workers=2, max_pending_commits=3)
    print("ready", flush=True)
    state = make_state()
    for step in range(steps):
        advance(state, step)
        store.commit(state, run=RUN, step=step, block=False)
        print(f"submitted {step} {len(store.pending_commits())}", flush=True)
    print("all submitted", flush=True)
    store.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
