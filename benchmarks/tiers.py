"""The ``tiers`` workload: commits to a fast local tier that drains to a throttled S3 (issue 20).

Targets: "With S3 throttled to ~50 MB/s by a loopback proxy: commit wall time <= 1.2x a
commit to a local-only store of the same state, and <= 0.25x the same commit without a
fast tier; drain throughput >= 0.8x raw boto3 through the same proxy; restore on the
committing host <= 1.0x torch.load; restore on a host with an empty fast tier >= 0.8x raw
boto3 download."

The S3 side is a moto server behind a bandwidth-throttling TCP proxy (``RATE`` bytes/s
each way, one token bucket per direction shared by all connections), both in a child
process (``benchmarks/throttle.py``), so this process holds only the client side, as
against a remote bucket. The state is the ``dense`` workload's at half ``--scale`` (467 MiB
at 1.0: five transfers of it at <= 50 MB/s already take about two minutes); every store has
the pack size of the ``s3`` workload (64 MiB at scale 1.0). One round, in this order (each
timed step gets ``measure.release_memory`` first):

1. ``torch.save`` + fsync of the state to local disk (the file is kept for step 4);
2. raw boto3 upload of the state's tensor bytes, cut into objects of the pack size, one
   after the other with ``upload_fileobj`` (casckpt's TransferConfig), through the proxy;
3. a first commit to a **local-only** store (packs in its directory, no S3); timed again,
   in a fresh store, right after step 4's commit: the figure is the mean of the two, so
   drift over the fast-tier commit cancels;
4. a first commit to an S3 store **with a fast tier** (``fast_tier=DIR``): the commit
   returns once its packs are on the fast tier (``durability == "fast"``); then
   ``wait_durable()``: the **drain** (from the commit's return to ``wait_durable``'s);
   then the store is closed and opened again with the same fast tier and index cache (the
   job restarted on the committing host): ``RESTORES`` times ``torch.load`` of the file of
   step 1, then ``restore`` (the fast tier holds every pack); medians of each;
5. a first commit to an S3 store **without** a fast tier (the same S3, its own prefix);
6. raw boto3 download of the objects of step 2 with ``download_fileobj``;
7. the store of step 4 opened again as **another host**: an empty fast tier directory and
   an empty index cache, then ``restore``: every pack comes from S3.

Drain throughput is the commit's stored bytes over the drain time; raw throughputs and
restore throughputs are logical bytes over time (as in the ``s3`` workload). Every
restore is compared with the state bit for bit, the raw download with what went up. The
proxy counts the bytes each step sent and received through it (``s3_traffic``): a restore
on the committing host should read nothing from S3, a fast-tier commit write nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.s3 import BUCKET, object_size_for, remove_prefix, split_objects
from benchmarks.s3link import S3Link, clock, s3_link
from benchmarks.workloads import build

Log = Callable[[str], None]

NAME = "tiers"
MB = 1_000_000
RATE = 50 * MB  # bytes per second through the proxy, each way
FAST_TIER_BYTES = "8GiB"
RESTORES = 5  # restores on the committing host, alternating with torch.load; medians
STATE_SCALE = 0.5  # of --scale: the dense state at 1.0 is 1.01 GiB, 467 MiB here


@dataclass(frozen=True)
class TiersResult:
    """Raw numbers of the ``tiers`` workload (seconds, one round; ``torch_load_s`` and
    ``restore_fast_s`` are medians of their ``*_samples``, ``commit_local_s`` the mean of its).

    ``durability``: ``Version.durability`` as the fast-tier commit returned it, and as
    the catalog says after ``wait_durable``. ``fast_tier_bytes``: the committing host's
    fast-tier directory after the drain, and the other host's after its restore.
    ``s3_traffic``: bytes through the proxy ``[up, down]`` (HTTP headers included) during
    each step: ``commit_fast``, ``drain``, ``restore_fast``, ``commit_s3``, ``restore_empty``.
    ``verified``: both restores bit-exact and the raw download equal to the upload.
    """

    name: str
    rate_mb_per_s: float
    logical_bytes: int
    stored_bytes: int
    object_size: int
    raw_objects: int
    torch_save_s: float
    torch_load_s: float
    torch_load_samples: list[float]
    raw_upload_s: float
    raw_download_s: float
    commit_local_s: float
    commit_local_samples: list[float]
    commit_fast_s: float
    drain_s: float
    commit_s3_s: float
    restore_fast_s: float
    restore_fast_samples: list[float]
    restore_empty_s: float
    durability: dict[str, str | None]
    fast_tier_bytes: dict[str, int]
    s3_traffic: dict[str, list[int]]
    verified: bool
    versions: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)

    def mb_per_s(self, nbytes: int, seconds: float) -> float | None:
        """``nbytes`` over ``seconds`` in MB/s (None for a zero time)."""
        return nbytes / MB / seconds if seconds > 0 else None


@dataclass(frozen=True)
class _S3:
    """What the S3 steps share: the throttled link, the raw objects, the pack size."""

    link: S3Link
    objects: list[bytes]
    object_size: int

    def open(self, root: Path, prefix: str, **options: Any) -> casckpt.Store:
        """A store at ``root`` whose packs live under ``s3://BUCKET/prefix`` through the proxy."""
        return casckpt.open(root, blobs=f"s3://{BUCKET}/{prefix}", pack_size=self.object_size,
                            s3={"endpoint_url": self.link.server.endpoint}, **options)


class _Check:
    """Bit-exact comparison of restores with the state."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.digests = measure.tensor_digests(state)
        self.ok = True

    def restore(self, store: casckpt.Store, ref: str) -> float:
        """Seconds to restore ``ref`` as a new tree; records whether it matched."""
        restored, seconds = clock(lambda: store.restore(ref))
        self.ok = (self.ok and measure.tensor_digests(restored) == self.digests
                   and measure.trees_equal(self.state, restored))
        return seconds


def _torch_load(path: Path) -> float:
    loaded, seconds = clock(lambda: measure.torch_load(path))
    del loaded
    return seconds


def _local_commit(state: Any, workdir: Path, pack_size: int) -> tuple[float, dict[str, Any]]:
    root = workdir / "local"
    with casckpt.open(root, pack_size=pack_size) as store:
        version, seconds = clock(lambda: store.commit(state, run=NAME, step=1))
    measure.remove(root)
    return seconds, version.to_dict()


def _durability(version: Any) -> str | None:
    return getattr(version, "durability", None)


def _fast_commit(s3: _S3, state: Any, workdir: Path, check: _Check, saved: Path) -> dict[str, Any]:
    """Commit to the fast tier and drain; then, after opening the store again on this host,
    ``RESTORES`` restores alternating with ``torch.load`` of the file ``saved``."""
    host = {"cache": workdir / "cache-a", "fast_tier": str(workdir / "tier-a"),
            "fast_tier_bytes": FAST_TIER_BYTES}
    with s3.open(workdir / "fast", "fast", **host) as store:
        (version, commit_s), commit_bytes = s3.link.traffic(
            lambda: clock(lambda: store.commit(state, run=NAME, step=1)))
        start = time.perf_counter()
        _, drain_bytes = s3.link.traffic(store.tier.wait_durable)
        drain_s = time.perf_counter() - start
        drained = store.resolve(version.id)
    restores: list[float] = []
    loads: list[float] = []
    with s3.open(workdir / "fast", "fast", **host) as store:  # the training job restarted
        def alternate() -> None:
            for _ in range(RESTORES):
                loads.append(_torch_load(saved))
                restores.append(check.restore(store, version.id))

        _, restore_bytes = s3.link.traffic(alternate)
    return {"commit_s": commit_s, "drain_s": drain_s, "restores": restores, "loads": loads,
            "version": version,
            "durability": {"commit": _durability(version), "drained": _durability(drained)},
            "tier_bytes": measure.path_bytes(workdir / "tier-a"),
            "traffic": {"commit_fast": commit_bytes, "drain": drain_bytes, "restore_fast": restore_bytes}}


def _s3_commit(s3: _S3, state: Any, workdir: Path) -> tuple[float, dict[str, Any], list[int]]:
    root = workdir / "s3-only"
    with s3.open(root, "s3-only", cache=workdir / "cache-s3") as store:
        (version, seconds), traffic = s3.link.traffic(
            lambda: clock(lambda: store.commit(state, run=NAME, step=1)))
    remove_prefix(s3.link.client, "s3-only/")
    measure.remove(root)
    return seconds, version.to_dict(), traffic


def _other_host(s3: _S3, workdir: Path, ref: str, check: _Check) -> tuple[float, int, list[int]]:
    """Restore from the committing host's store as a host with an empty fast tier and cache."""
    tier = workdir / "tier-b"
    with s3.open(workdir / "fast", "fast", cache=workdir / "cache-b", fast_tier=str(tier),
                 fast_tier_bytes=FAST_TIER_BYTES) as store:
        seconds, traffic = s3.link.traffic(lambda: check.restore(store, ref))
    return seconds, measure.path_bytes(tier), traffic


def run_tiers(scale: float, workdir: Path, log: Log) -> TiersResult:
    """Measure the ``tiers`` workload at ``scale`` in the empty directory ``workdir``."""
    state = build("dense", scale * STATE_SCALE).state()
    logical = measure.logical_bytes(state)
    check = _Check(state)
    size = object_size_for(scale)
    log(f"{NAME}: dense ({measure.fmt_bytes(logical)}): torch.save + fsync / torch.load")
    saved = workdir / "baseline.pt"
    _, save_s = clock(lambda: measure.torch_save_fsync(state, saved))
    objects = split_objects((measure.raw_bytes(t) for _, t in measure.tensor_leaves(state)), size)
    with s3_link(workdir, RATE, NAME, log) as link:
        s3 = _S3(link, objects, size)
        keys = [f"raw/{i:06d}" for i in range(len(objects))]
        log(f"{NAME}: raw boto3 upload ({len(objects)} objects)")
        up_s = s3.link.upload(keys, objects)
        log(f"{NAME}: commit to a local-only store, then to S3 with a fast tier, drain, reopen, restore")
        local_before, local_version = _local_commit(state, workdir, size)
        fast = _fast_commit(s3, state, workdir, check, saved)
        measure.remove(saved)
        local_after, _ = _local_commit(state, workdir, size)
        local_samples = [local_before, local_after]
        log(f"{NAME}: commit to S3 without a fast tier")
        s3_s, s3_version, s3_traffic = _s3_commit(s3, state, workdir)
        log(f"{NAME}: raw boto3 download, then restore on a host with an empty fast tier")
        down_s, raw_ok = s3.link.download(keys, objects)
        remove_prefix(link.client, "raw/")
        empty_s, empty_tier, empty_traffic = _other_host(s3, workdir, fast["version"].id, check)
    return TiersResult(
        name=NAME, rate_mb_per_s=RATE / MB, logical_bytes=logical,
        stored_bytes=fast["version"].stored_bytes, object_size=size, raw_objects=len(objects),
        torch_save_s=save_s, torch_load_s=statistics.median(fast["loads"]),
        torch_load_samples=fast["loads"], raw_upload_s=up_s, raw_download_s=down_s,
        commit_local_s=sum(local_samples) / len(local_samples), commit_local_samples=local_samples,
        commit_fast_s=fast["commit_s"], drain_s=fast["drain_s"], commit_s3_s=s3_s,
        restore_fast_s=statistics.median(fast["restores"]), restore_fast_samples=fast["restores"],
        restore_empty_s=empty_s, durability=fast["durability"],
        fast_tier_bytes={"committing_host": fast["tier_bytes"], "other_host": empty_tier},
        s3_traffic={**fast["traffic"], "commit_s3": s3_traffic, "restore_empty": empty_traffic},
        verified=check.ok and raw_ok,
        versions={"local": local_version, "fast": fast["version"].to_dict(), "s3_only": s3_version},
    )


def _rate(num: Callable[[TiersResult], float | None],
          den: Callable[[TiersResult], float | None]) -> Callable[[TiersResult], float | None]:
    def compute(r: TiersResult) -> float | None:
        a, b = num(r), den(r)
        return a / b if a is not None and b else None
    return compute


def _raw_up(r: TiersResult) -> float | None:
    return r.mb_per_s(r.logical_bytes, r.raw_upload_s)


def _raw_down(r: TiersResult) -> float | None:
    return r.mb_per_s(r.logical_bytes, r.raw_download_s)


def _drain(r: TiersResult) -> float | None:
    return r.mb_per_s(r.stored_bytes, r.drain_s)


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[TiersResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("commit_fast_vs_local", "commit with a fast tier / commit to a local-only store", "ratio",
            lambda r: r.commit_fast_s / r.commit_local_s),
    Measure("commit_fast_vs_s3", "commit with a fast tier / commit to S3 without one", "ratio",
            lambda r: r.commit_fast_s / r.commit_s3_s),
    Measure("drain_vs_raw_upload", "drain MB/s (stored bytes) / raw boto3 upload MB/s", "ratio",
            _rate(_drain, _raw_up)),
    Measure("restore_fast_vs_load", "restore on the committing host / torch.load", "ratio",
            lambda r: r.restore_fast_s / r.torch_load_s),
    Measure("restore_empty_vs_raw_download", "restore, empty fast tier, MB/s / raw boto3 download MB/s",
            "ratio", lambda r: r.raw_download_s / r.restore_empty_s),
    Measure("drain_vs_link", "drain MB/s (stored bytes) / the proxy's rate", "ratio",
            lambda r: (_drain(r) or 0) / r.rate_mb_per_s),
    Measure("commit_and_drain_vs_s3", "commit + drain / commit to S3 without a fast tier", "ratio",
            lambda r: (r.commit_fast_s + r.drain_s) / r.commit_s3_s),
    Measure("commit_s3_vs_raw_upload", "commit to S3 without a fast tier MB/s / raw upload MB/s", "ratio",
            lambda r: r.raw_upload_s / r.commit_s3_s),
    Measure("commit_fast_vs_save", "commit with a fast tier / torch.save", "ratio",
            lambda r: r.commit_fast_s / r.torch_save_s),
    Measure("restore_fast_s3_of_logical", "S3 bytes read by the restore on the committing host / logical",
            "fraction", lambda r: r.s3_traffic["restore_fast"][1] / r.logical_bytes),
    Measure("commit_fast_s3_of_logical", "S3 bytes sent during the fast-tier commit / logical",
            "fraction", lambda r: r.s3_traffic["commit_fast"][0] / r.logical_bytes),
    Measure("raw_upload_mb_per_s", "raw boto3 upload through the proxy", "mb_per_s", _raw_up),
    Measure("raw_download_mb_per_s", "raw boto3 download through the proxy", "mb_per_s", _raw_down),
)

TARGETS: dict[str, float] = {  # issue 20, upper limits
    "commit_fast_vs_local": 1.2,
    "commit_fast_vs_s3": 0.25,
    "restore_fast_vs_load": 1.0,
}

FLOORS: dict[str, float] = {  # issue 20, lower limits
    "drain_vs_raw_upload": 0.8,
    "restore_empty_vs_raw_download": 0.8,
}

NOTES = (f"see benchmarks/tiers.py; the dense state at {STATE_SCALE:g}x --scale, one round (the local-only "
         "commit: mean of one before and one after the fast-tier commit); S3 is moto behind a "
         f"{RATE / MB:g} MB/s-each-way TCP proxy in a child process; drain = stored bytes over the time "
         "from the fast-tier commit's return to wait_durable's; other throughputs logical bytes over "
         "time; the 'empty fast tier' restore opens the same store with a new fast tier and index cache")


def raw_table(outcomes: Mapping[str, TiersResult]) -> Table:
    """The tiers workload's raw times, one row per step, with MB/s where bytes crossed the proxy."""
    table = Table(title=f"tiers: fast local tier draining to S3 throttled to {RATE / MB:g} MB/s (one round)")
    for column in ("step", "wall", "MB/s", "bytes"):
        table.add_column(column, justify="left" if column == "step" else "right")

    def row(r: TiersResult, label: str, seconds: float, nbytes: int | None) -> None:
        rate = r.mb_per_s(nbytes, seconds) if nbytes is not None else None
        table.add_row(label, f"{seconds:.2f} s", "" if rate is None else f"{rate:.1f}",
                      "" if nbytes is None else measure.fmt_bytes(nbytes))

    for r in outcomes.values():
        row(r, "torch.save + fsync (local disk)", r.torch_save_s, None)
        row(r, f"torch.load (median of {len(r.torch_load_samples)})", r.torch_load_s, None)
        row(r, "raw boto3 upload", r.raw_upload_s, r.logical_bytes)
        row(r, "raw boto3 download", r.raw_download_s, r.logical_bytes)
        row(r, "commit, local-only store (mean of 2)", r.commit_local_s, None)
        row(r, f"commit, fast tier (durability {r.durability['commit']})", r.commit_fast_s, None)
        row(r, f"drain to S3 (then {r.durability['drained']})", r.drain_s, r.stored_bytes)
        row(r, "commit, S3 without a fast tier", r.commit_s3_s, r.logical_bytes)
        row(r, f"restore, committing host (median of {len(r.restore_fast_samples)})", r.restore_fast_s,
            None)
        row(r, "restore, empty fast tier", r.restore_empty_s, r.logical_bytes)
        table.add_row("bit-exact", "yes" if r.verified else "[red]NO[/]", "",
                      measure.fmt_bytes(r.logical_bytes) + " logical")
    return table
