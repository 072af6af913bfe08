"""Processes for the fast tier fault tests (tests/engine/tiering/test_tier_faults.py).

    python tier_child.py killed-drain ROOT BLOBS FAST ENDPOINT VERSIONS POINT N
    python tier_child.py killed-commit ROOT BLOBS FAST ENDPOINT
    python tier_child.py committer ROOT BLOBS FAST ENDPOINT RUN COUNT DONE_FILE

``killed-drain`` opens the store with its drain worker switched off, commits versions
0..VERSIONS-1 of run ``r`` (all ``fast``), then drains the tier itself and SIGKILLs itself at
the N-th call of the drain step POINT (exit status 3 if that call never happens).

``killed-commit`` commits r@0 (left on the tier) and SIGKILLs itself as it publishes r@1.

``committer`` commits COUNT versions of run RUN with the drain running as usual, appending
each step to DONE_FILE once its commit returned; then closes the store (the last drain).
With TIER_UPLOAD_LOG set, it appends the id of every pack it stores on the locations there.

ENDPOINT is the S3 endpoint of the moto server ("-": BLOBS is a local directory).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

import casckpt

CHUNK = 64 << 10
PACK = 1 << 20


def state(run: str, i: int) -> dict[str, torch.Tensor]:
    """Version i of a run (~1.9 MiB): one tensor every version of every run shares, one
    shared by the versions of a run, and one of its own."""
    def noise(seed: int, n: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(seed))

    salt = sum(map(ord, run)) * 1000
    return {"common": noise(1, 150_000), "run": noise(2 + salt, 100_000),
            "own": noise(3 + salt + i, 230_000), "step": torch.tensor([i])}


def open_store(root: str, blobs: str, fast: str, endpoint: str, **kwargs: Any) -> casckpt.Store:
    """BLOBS: one location, or several separated by commas (then with the redundancy
    TIER_REDUNDANCY says, e.g. ``ec:2+1``)."""
    s3 = None if endpoint == "-" else {"endpoint_url": endpoint}
    if "," in blobs:
        kwargs.setdefault("redundancy", os.environ.get("TIER_REDUNDANCY"))
    return casckpt.open(root, blobs=blobs.split(","), s3=s3, fast_tier=fast, chunk_size=CHUNK,
                        pack_size=PACK, **kwargs)


def _die_at(owner: Any, name: str, n: int, after: bool, prefix: str | None = None) -> None:
    """SIGKILL this process at the ``n``-th call of ``owner.name`` (before it, or ``after``);
    with ``prefix``, only calls whose object name (the first argument) starts with it count."""
    real: Callable[..., Any] = getattr(owner, name)
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        if prefix is not None and not str(args[1]).startswith(prefix):
            return real(*args, **kwargs)
        calls += 1
        if calls == n and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls == n and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, name, wrapped)


class _NoWorker:
    """Stands in for the drain worker (nothing drains unless the child drains)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stop(self) -> None:
        pass


def killed_drain(root: str, blobs: str, fast: str, endpoint: str, versions: int, point: str,
                 n: int) -> None:
    from casckpt.catalog import tiers
    from casckpt.engine.tiering import tier
    from casckpt.storage.local import LocalBlobStore
    from casckpt.storage.s3 import S3BlobStore

    tier.DrainWorker = _NoWorker  # type: ignore[assignment,misc]
    store = open_store(root, blobs, fast, endpoint)
    for i in range(versions):
        assert store.commit(state("r", i), run="r", step=i).durability == "fast"
    location = S3BlobStore if endpoint != "-" else LocalBlobStore
    owner, name, after, prefix = {  # a drain stores pack bytes read from the tier: put, not put_file
        "upload": (location, "put", False, "packs/"),  # N-1 pack objects up, the rest not
        "before-record": (tiers, "mark_drained", False, None),  # uploaded, not made live
        "after-record": (tiers, "mark_drained", True, None),  # live, its versions not finished
        "manifest-up": (location, "put", True, "manifests/"),  # a manifest on the locations, version fast
        "before-finish": (tiers, "finish", False, None),  # every manifest up, nothing finished
    }[point]
    _die_at(owner, name, n, after, prefix)
    store.tier.drain(wait=True)
    sys.exit(3)


def killed_commit(root: str, blobs: str, fast: str, endpoint: str) -> None:
    """Commit r@0 (left on the tier), then die publishing r@1: its packs are on the tier."""
    from casckpt.catalog.catalog import Catalog
    from casckpt.engine.tiering import tier

    tier.DrainWorker = _NoWorker  # type: ignore[assignment,misc]
    store = open_store(root, blobs, fast, endpoint)
    store.commit(state("r", 0), run="r", step=0)
    _die_at(Catalog, "add_version", 1, after=False)
    store.commit(state("r", 1), run="r", step=1)
    sys.exit(3)


def _log_uploads(path: str) -> None:
    """Append the id of every pack this process stores on the locations to ``path``."""
    from casckpt.engine.packlayer.packwrite import PackWriter

    def logged(real: Callable[..., Any]) -> Callable[..., Any]:
        def write(self: PackWriter, pack_id: str, *args: Any, **kwargs: Any) -> Any:
            layout = real(self, pack_id, *args, **kwargs)
            with open(path, "a") as f:
                f.write(f"{pack_id}\n")
            return layout
        return write

    PackWriter.write = logged(PackWriter.write)  # type: ignore[method-assign]  # a commit's pack
    PackWriter.write_bytes = logged(PackWriter.write_bytes)  # type: ignore[method-assign]  # a drained one


def committer(root: str, blobs: str, fast: str, endpoint: str, run: str, count: int,
              done: str) -> None:
    if os.environ.get("TIER_UPLOAD_LOG"):
        _log_uploads(os.environ["TIER_UPLOAD_LOG"])
    with open_store(root, blobs, fast, endpoint, create=False) as store:
        for i in range(count):
            store.commit(state(run, i), run=run, step=i)
            with open(done, "a") as f:
                f.write(f"{i}\n")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "killed-drain":
        root, blobs, fast, endpoint, versions, point, n = args
        killed_drain(root, blobs, fast, endpoint, int(versions), point, int(n))
    elif mode == "killed-commit":
        root, blobs, fast, endpoint = args
        killed_commit(root, blobs, fast, endpoint)
    elif mode == "committer":
        root, blobs, fast, endpoint, run, count, done = args
        committer(root, blobs, fast, endpoint, run, int(count), done)
    else:
        raise SystemExit(f"unknown mode {mode}")
