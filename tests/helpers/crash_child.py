"""A committing process for the crash tests (tests/e2e/test_crash.py).

Usage::

    python crash_child.py STORE SEED STEPS DONE_FILE [POINT WHEN STEP N]

Opens the store at ``STORE`` with small chunks and packs, then commits steps
``0 .. STEPS-1`` of run ``r`` (each state from :func:`make_state`), appending
each step to ``DONE_FILE`` once ``commit`` has returned. It writes ``ready``
to stdout after opening the store (the timing tests start their clock there).

With ``POINT WHEN STEP N``, one protocol function is wrapped, in this process
only, so that the process SIGKILLs itself on the N-th call of ``POINT`` made
while step ``STEP`` is being committed, ``before`` or ``after`` the real call.
If that call never happens the process exits with status 3, so a test whose
kill point is not reached fails instead of passing vacuously.

The tests run it forked from the warm fork server (forkserver.py, the
``forked_python`` fixture): a separate process like any other, which only
skips the seconds of importing torch.

The parent imports this file for :func:`make_state` and :func:`assert_same`,
so both sides build the identical deterministic state.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import numpy as np
import torch

RUN = "r"
CHUNK_SIZE = 4096
PACK_SIZE = 64 << 10
BASE_ELEMS = 64 * 1024  # 256 KiB of float32 shared by every step (deduplicated)
FRESH_ELEMS = 48 * 1024  # 192 KiB of new random float32 per step: several packs per commit


def make_state(seed: int, step: int) -> dict[str, Any]:
    """The state committed at ``step``: part shared across steps, part new, plain values."""
    base = torch.Generator().manual_seed(seed)
    fresh = torch.Generator().manual_seed(seed * 100_003 + step + 1)
    shared = torch.randn(BASE_ELEMS, generator=base)
    weight = torch.randn(FRESH_ELEMS, generator=fresh)
    return {
        "model": {
            "shared": shared,
            "weight": weight.reshape(-1, 64),
            # a counter table that shifts by one each step: later steps store it as deltas (8 KiB:
            # above CHUNK_SIZE, so it is not packed with the small tensors)
            "bias": torch.arange(step, step + 1024, dtype=torch.int64),
            "half": weight[:1000].to(torch.bfloat16),
            # nudged a little every step, like trained weights: later steps store it as deltas
            "drift": shared[: BASE_ELEMS // 2] * (1.0 + 1e-3 * step),
        },
        "optimizer": ({"exp_avg": weight[:5000] * 0.5, "count": step}, [1.5, None, b"\x00\x01"]),
        "numpy": np.random.default_rng(seed + step).standard_normal(300).astype(np.float64),
        "step": step,
        "tag": f"v{step}",
        "lr": 0.1 / (step + 1),
    }


def assert_same(got: object, want: object, path: str = "") -> None:
    """Raise AssertionError unless ``got`` equals ``want`` exactly, types and dtypes included."""
    where = path or "<root>"
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape differ"
        assert torch.equal(got, want), f"{where}: tensor bytes differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape differ"
        assert np.array_equal(got, want), f"{where}: array bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}" if path else str(key))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}.{i}" if path else str(i))
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _targets() -> dict[str, tuple[type, str, Any]]:
    from casckpt.catalog import Catalog
    from casckpt.engine.write.packer import Packer
    from casckpt.storage import LocalBlobStore

    def is_manifest(args: tuple[Any, ...]) -> bool:
        return str(args[0]).startswith("manifests/")

    return {
        # a pack is being filled (staging file half written)
        "packer.add": (Packer, "add", None),
        # a finished pack is being made durable in the blob store
        "blobs.put_file": (LocalBlobStore, "put_file", None),
        # a durable pack is being recorded in the catalog
        "catalog.add_pack": (Catalog, "add_pack", None),
        # the manifest object is being written
        "blobs.put_manifest": (LocalBlobStore, "put", is_manifest),
        # the manifest's temporary file is written and fsync'd, not yet renamed into place
        "blobs.place_manifest": (LocalBlobStore, "_place", lambda args: is_manifest(args[1:])),
        # the publishing transaction is about to run / has run
        "catalog.add_version": (Catalog, "add_version", None),
        # inside the publishing transaction, after the version and tensor rows are inserted
        "catalog._set_tag": (Catalog, "_set_tag", None),
        # the publishing transaction's last statement: the commit's audit row
        "catalog.audit_in": (Catalog, "audit_in", lambda args: args[1] == "commit"),
    }


def _arm(point: str, when: str, at_step: int, nth: int, current: list[int]) -> None:
    cls, name, accept = _targets()[point]
    original = getattr(cls, name)
    calls = 0

    def wrapper(self: object, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        hit = False
        if current[0] == at_step and (accept is None or accept(args)):
            calls += 1
            hit = calls == nth
        if hit and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(self, *args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(cls, name, wrapper)


def main(argv: list[str]) -> int:
    import casckpt

    store_dir, seed, steps, done_file = argv[0], int(argv[1]), int(argv[2]), argv[3]
    current = [-1]
    if len(argv) > 4:
        point, when, at_step, nth = argv[4], argv[5], int(argv[6]), int(argv[7])
        _arm(point, when, at_step, nth, current)
    store = casckpt.open(store_dir, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE, workers=2)
    print("ready", flush=True)
    with open(done_file, "a", encoding="ascii") as done:
        for step in range(steps):
            current[0] = step
            store.commit(make_state(seed, step), run=RUN, step=step, tags=[f"s{step}"],
                         metrics={"loss": 1.0 / (step + 1)})
            done.write(f"{step}\n")
            done.flush()
    store.close()
    return 3 if len(argv) > 4 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
