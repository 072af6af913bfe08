"""The ``copy`` workload: ``Store.copy`` between stores (issue 34).

Targets (issue 34): "Copying the 10th version of a fine-tune whose first 9 the destination
already holds sends <= 1.1x the new bytes of that version (measured at the destination's
locations), and a full copy of a run sends <= 1.05x its stored bytes. Copy throughput
local -> S3 (moto behind the throttling proxy) >= 0.9x raw boto3 upload of the same bytes;
S3 -> local >= 0.9x raw download."

(``copy_bench.py``, not ``copy.py``: run as a script, the benchmarks directory comes first on
``sys.path`` and would shadow the standard library's ``copy``.)

**Source**: the ``frozen`` workload (the decoder with only its head, final norm and last
blocks training, AdamW on those: ~34% of the bytes change per interval) at
``STATE_SCALE`` x ``--scale`` (51.8 MB at 1.0), committed ``VERSIONS`` times as run ``ft``
(one real AdamW step between two commits) to a local store. Every store has the pack size of
the ``s3`` workload at ``--scale`` (64 MiB at 1.0). The tensor digests and plain values of each
committed state are kept: **every copy is verified** by restoring every version it brought from
the destination (opened alone) and comparing it with them; a mismatch fails the workload.

**Bytes** (local -> local): "sent" is measured at the destination's locations: the bytes of the
objects (packs, manifests, records) that appeared there during the copy, listed through
``casckpt.testing.internals`` before and after.

* incremental: a fresh store receives ``ft@9`` (versions 1-9, as ancestors); then ``ft@10`` is
  copied: its new objects' bytes over ``new_bytes`` of version 10 in the source;
* full: ``ft`` (every version) into an empty store: its objects' bytes over the sum of the
  run's ``stored_bytes`` in the source.

**Throughput** (local <-> S3): moto behind the loopback proxy of ``benchmarks/throttle.py``
(``RATE`` bytes/s each way, in a child process), set up by ``benchmarks/s3link.py`` as for the
``tiers`` workload. An untimed
warm-up copy of ``ft`` to S3 gives the **raw objects**: every object that copy stored, read
back unthrottled, so boto3 moves exactly the objects and sizes a copy moves. Then ``REPEATS``
rounds, each with its own keys, prefix and stores: raw boto3 upload of the objects one after
the other (``upload_fileobj``, casckpt's TransferConfig, as the ``s3`` workload), copy of ``ft``
from the local source to a fresh S3 store, raw ``download_fileobj`` of the objects, copy of
``ft`` from that S3 store (opened again with an empty index cache: every chunk comes from S3)
to a fresh local store. Odd rounds run each copy before its raw twin, even rounds after, so
drift hits both alike. Only ``Store.copy`` is timed (stores are opened before the clock).
Throughput is bytes over the median time: the raw objects' bytes, and for a copy the bytes of
the objects on the S3 side (stored up, read down).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.s3 import BUCKET, object_size_for, remove_prefix
from benchmarks.s3link import S3Link, clock, s3_link
from benchmarks.workloads import build
from casckpt.format.state import iter_leaves
from casckpt.testing.internals import internals

Log = Callable[[str], None]

NAME = "copy"
RUN = "ft"
VERSIONS = 10
STATE_SCALE = 0.1  # of --scale: the frozen state is 51.8 MB at 0.1
MB = 1_000_000
RATE = 50 * MB  # bytes per second through the proxy, each way
REPEATS = 3


class CopyFailedError(RuntimeError):
    """A copy's destination did not restore every version bit-exact: the figures are void."""


@dataclass(frozen=True)
class Round:
    """One throughput round (seconds; bytes of the objects on the S3 side of each copy).

    ``traffic``: bytes through the proxy ``[up, down]`` during each timed step.
    """

    index: int
    copy_first: bool
    raw_upload_s: float
    copy_up_s: float
    raw_download_s: float
    copy_down_s: float
    copy_up_bytes: int
    copy_down_bytes: int
    traffic: dict[str, list[int]]


@dataclass(frozen=True)
class CopyResult:
    """Raw numbers of the ``copy`` workload.

    ``versions``: the source's versions as committed. ``incremental`` / ``full``: the copy's
    ``CopyReport`` and the bytes of the objects new at the destination (``dest_new_bytes``).
    ``raw_objects`` / ``raw_bytes``: the objects the warm-up copy stored on S3, moved by boto3.
    ``verified``: every copy restored bit-exact from its destination (the workload raises
    otherwise), and every raw download equal to the upload.
    """

    name: str
    state_scale: float
    rate_mb_per_s: float
    logical_bytes: int
    object_size: int
    versions: list[dict[str, Any]]
    source_object_bytes: int
    incremental: dict[str, Any]
    full: dict[str, Any]
    raw_objects: int
    raw_bytes: int
    rounds: list[Round]
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)

    @property
    def run_stored_bytes(self) -> int:
        """The run's stored bytes in the source: ``stored_bytes`` summed over its versions."""
        return sum(int(v["stored_bytes"]) for v in self.versions)

    def median(self, field: str) -> float:
        """The median of a round field over the rounds."""
        return statistics.median(float(getattr(r, field)) for r in self.rounds)

    def mb_per_s(self, nbytes: float, field: str) -> float | None:
        """``nbytes`` over the median of ``field``, in MB/s."""
        seconds = self.median(field)
        return nbytes / MB / seconds if seconds > 0 else None


class _Expected:
    """Each committed version's content, to check what a destination restores."""

    def __init__(self) -> None:
        self.digests: dict[int, dict[str, tuple[int, bytes]]] = {}
        self.plain: dict[int, list[tuple[str, Any]]] = {}

    def record(self, step: int, state: Any) -> None:
        self.digests[step] = measure.tensor_digests(state)
        self.plain[step] = [(p, copy.deepcopy(v)) for p, v in iter_leaves(state) if not _is_tensor(v)]

    def verify(self, store: casckpt.Store, what: str, steps: list[int] | None = None) -> None:
        """Restore every version (or ``steps``) of the run from ``store``; raise on a mismatch."""
        for step in steps or sorted(self.digests):
            restored = store.restore(f"{RUN}@{step}")
            plain = [(p, v) for p, v in iter_leaves(restored) if not _is_tensor(v)]
            if measure.tensor_digests(restored) != self.digests[step] or plain != self.plain[step]:
                raise CopyFailedError(f"{what}: {RUN}@{step} restored from the destination differs "
                                      "from the version committed to the source")
            del restored


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def objects(store: casckpt.Store) -> dict[tuple[int, str], int]:
    """Every object on the store's locations: ``{(location id, key): size}``."""
    return {(loc.id, info.key): info.size for loc, info in internals(store).locations.list_all("")}


def new_object_bytes(before: Mapping[tuple[int, str], int], after: Mapping[tuple[int, str], int]) -> int:
    """Bytes of the objects in ``after`` that ``before`` did not hold."""
    return sum(size for key, size in after.items() if key not in before)


def _commit_source(root: Path, scale: float, size: int,
                   expected: _Expected) -> tuple[list[dict[str, Any]], int]:
    """The fine-tune run: ``VERSIONS`` commits, one AdamW step apart."""
    workload = build("frozen", scale)
    versions = []
    with casckpt.open(root, pack_size=size) as store:
        for step in range(1, VERSIONS + 1):
            if step > 1:
                workload.advance()
            state = workload.state()
            versions.append(store.commit(state, run=RUN, step=step).to_dict())
            expected.record(step, state)
    return versions, measure.logical_bytes(state)


def _copy_measured(source: casckpt.Store, dest: casckpt.Store, ref: str) -> dict[str, Any]:
    """``source.copy(ref, to=dest)`` with the bytes of the objects it added at the destination."""
    before = objects(dest)
    plan = source.copy(ref, to=dest, dry_run=True)
    report = source.copy(ref, to=dest)
    again = source.copy(ref, to=dest)
    return {"report": report.to_dict(), "dry_run_bytes": plan.bytes, "dest_new_bytes":
            new_object_bytes(before, objects(dest)), "again_nothing_sent": again.nothing_sent}


def _bytes_copies(src_root: Path, workdir: Path, size: int, expected: _Expected,
                  log: Log) -> tuple[dict[str, Any], dict[str, Any]]:
    """The incremental copy of version 10 and the full copy of the run, local to local."""
    with casckpt.open(src_root, create=False) as source:
        log(f"{NAME}: incremental: {RUN}@9 (with its ancestors) to a new store, then {RUN}@10")
        with casckpt.open(workdir / "inc", pack_size=size) as dest:
            first = _copy_measured(source, dest, f"{RUN}@{VERSIONS - 1}")
            incremental = _copy_measured(source, dest, f"{RUN}@{VERSIONS}")
            incremental["first"] = first
        with casckpt.open(workdir / "inc", create=False) as dest:  # the destination alone
            expected.verify(dest, "incremental copy")
        log(f"{NAME}: full copy of {RUN} into an empty store")
        with casckpt.open(workdir / "full", pack_size=size) as dest:
            full = _copy_measured(source, dest, RUN)
        with casckpt.open(workdir / "full", create=False) as dest:
            expected.verify(dest, "full copy")
    measure.remove(workdir / "inc")
    measure.remove(workdir / "full")
    return incremental, full


@dataclass(frozen=True)
class _S3:
    """What the throughput rounds share: the throttled link, the raw objects."""

    link: S3Link
    workdir: Path
    source: Path
    size: int
    raw: list[bytes]

    def open(self, name: str, *, direct: bool = False, **options: Any) -> casckpt.Store:
        """The store ``name`` whose packs live under ``s3://BUCKET/name``, with its catalog and
        index cache in the work directory (a fresh cache each time it is opened)."""
        cache = self.workdir / f"cache-{name}-{time.monotonic_ns()}"
        endpoint = self.link.server.direct if direct else self.link.server.endpoint
        return casckpt.open(self.workdir / name, blobs=f"s3://{BUCKET}/{name}", pack_size=self.size,
                            cache=cache, s3={"endpoint_url": endpoint}, **options)


def _raw_objects(s3: _S3, expected: _Expected) -> list[bytes]:
    """The objects of an untimed (verified) warm-up copy of the run to S3, read back directly."""
    with casckpt.open(s3.source, create=False) as source, s3.open("warm") as dest:
        source.copy(RUN, to=dest)
        keys = sorted(objects(dest))
    with s3.open("warm", direct=True, create=False) as dest:
        expected.verify(dest, "warm-up copy to S3")
    raw = [s3.link.direct.get_object(Bucket=BUCKET, Key=f"warm/{key}")["Body"].read() for _, key in keys]
    remove_prefix(s3.link.direct, "warm/")
    shutil.rmtree(s3.workdir / "warm")
    return raw


def _raw_upload(s3: _S3, keys: list[str]) -> float:
    return float(s3.link.upload(keys, s3.raw))


def _raw_download(s3: _S3, keys: list[str]) -> float:
    seconds, same = s3.link.download(keys, s3.raw)
    if not same:
        raise CopyFailedError("raw boto3 download: the objects differ from those uploaded")
    return float(seconds)


def _copy_up(s3: _S3, prefix: str) -> tuple[float, int, list[int]]:
    """Copy the run from the local source to a fresh S3 store: seconds, bytes stored there, traffic."""
    with casckpt.open(s3.source, create=False) as source, s3.open(prefix) as dest:
        before = objects(dest)
        (_, seconds), traffic = s3.link.traffic(lambda: clock(lambda: source.copy(RUN, to=dest)))
        stored = new_object_bytes(before, objects(dest))
    return seconds, stored, traffic


def _copy_down(s3: _S3, prefix: str) -> tuple[float, int, list[int]]:
    """Copy the run from the S3 store ``prefix`` (an empty index cache) to a fresh local store."""
    with s3.open(prefix, create=False) as source, casckpt.open(s3.workdir / f"{prefix}-down",
                                                                pack_size=s3.size) as dest:
        held = sum(objects(source).values())
        (_, seconds), traffic = s3.link.traffic(lambda: clock(lambda: source.copy(RUN, to=dest)))
    return seconds, held, traffic


def _round(s3: _S3, index: int, expected: _Expected) -> Round:
    """Raw upload and copy up, raw download and copy down; copies first in odd rounds."""
    keys = [f"raw-{index}/{i:06d}" for i in range(len(s3.raw))]
    prefix = f"copy-{index}"
    copy_first = index % 2 == 1
    traffic: dict[str, list[int]] = {}
    if copy_first:
        up_s, up_bytes, traffic["copy_up"] = _copy_up(s3, prefix)
        raw_up_s, traffic["raw_upload"] = s3.link.traffic(lambda: _raw_upload(s3, keys))
        down_s, down_bytes, traffic["copy_down"] = _copy_down(s3, prefix)
        raw_down_s, traffic["raw_download"] = s3.link.traffic(lambda: _raw_download(s3, keys))
    else:
        raw_up_s, traffic["raw_upload"] = s3.link.traffic(lambda: _raw_upload(s3, keys))
        up_s, up_bytes, traffic["copy_up"] = _copy_up(s3, prefix)
        raw_down_s, traffic["raw_download"] = s3.link.traffic(lambda: _raw_download(s3, keys))
        down_s, down_bytes, traffic["copy_down"] = _copy_down(s3, prefix)
    with s3.open(prefix, direct=True, create=False) as dest:
        expected.verify(dest, f"round {index + 1}: copy to S3")
    with casckpt.open(s3.workdir / f"{prefix}-down", create=False) as dest:
        expected.verify(dest, f"round {index + 1}: copy from S3")
    remove_prefix(s3.link.direct, f"raw-{index}/")
    remove_prefix(s3.link.direct, prefix + "/")
    for path in (s3.workdir / prefix, s3.workdir / f"{prefix}-down"):
        shutil.rmtree(path, ignore_errors=True)
    return Round(index, copy_first, raw_up_s, up_s, raw_down_s, down_s, up_bytes, down_bytes, traffic)


def _throughput(workdir: Path, source: Path, size: int, expected: _Expected, repeats: int,
                log: Log) -> tuple[list[bytes], list[Round]]:
    with s3_link(workdir, RATE, NAME, log) as link:
        s3 = _S3(link, workdir, source, size, [])
        log(f"{NAME}: warm-up copy of {RUN} to S3 (untimed): the raw objects")
        s3 = dataclasses.replace(s3, raw=_raw_objects(s3, expected))
        rounds = []
        for index in range(repeats):
            log(f"{NAME}: round {index + 1}/{repeats}: raw upload / copy to S3, raw download / copy "
                f"from S3 ({len(s3.raw)} objects, {measure.fmt_bytes(sum(map(len, s3.raw)))})")
            rounds.append(_round(s3, index, expected))
    return s3.raw, rounds


def run_copy(scale: float, workdir: Path, log: Log, repeats: int = REPEATS) -> CopyResult:
    """Measure the ``copy`` workload at ``scale`` in the empty directory ``workdir``."""
    size = object_size_for(scale)
    expected = _Expected()
    src_root = workdir / "source"
    log(f"{NAME}: the frozen fine-tune at {scale * STATE_SCALE:g}: {VERSIONS} commits of run {RUN}")
    versions, logical = _commit_source(src_root, scale * STATE_SCALE, size, expected)
    with casckpt.open(src_root, create=False) as source:
        source_bytes = sum(objects(source).values())
    incremental, full = _bytes_copies(src_root, workdir, size, expected, log)
    raw, rounds = _throughput(workdir, src_root, size, expected, repeats, log)
    return CopyResult(
        name=NAME, state_scale=scale * STATE_SCALE, rate_mb_per_s=RATE / MB, logical_bytes=logical,
        object_size=size, versions=versions, source_object_bytes=source_bytes,
        incremental=incremental, full=full, raw_objects=len(raw), raw_bytes=sum(map(len, raw)),
        rounds=rounds, verified=True)


def _up(r: CopyResult) -> float | None:
    moved = r.mb_per_s(statistics.median(x.copy_up_bytes for x in r.rounds), "copy_up_s")
    raw = r.mb_per_s(r.raw_bytes, "raw_upload_s")
    return moved / raw if moved is not None and raw else None


def _down(r: CopyResult) -> float | None:
    moved = r.mb_per_s(statistics.median(x.copy_down_bytes for x in r.rounds), "copy_down_s")
    raw = r.mb_per_s(r.raw_bytes, "raw_download_s")
    return moved / raw if moved is not None and raw else None


def _last_new(r: CopyResult) -> int:
    return int(r.versions[-1]["new_bytes"])


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[CopyResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("incremental_sent_vs_new", f"copy of version {VERSIONS} (1-{VERSIONS - 1} held): bytes new at "
            "the destination / its new_bytes", "ratio",
            lambda r: r.incremental["dest_new_bytes"] / _last_new(r)),
    Measure("full_sent_vs_stored", "full copy of the run: bytes at the destination / the run's stored bytes",
            "ratio", lambda r: r.full["dest_new_bytes"] / r.run_stored_bytes),
    Measure("up_vs_raw_upload", "copy local -> S3 MB/s / raw boto3 upload MB/s (medians)", "ratio", _up),
    Measure("down_vs_raw_download", "copy S3 -> local MB/s / raw boto3 download MB/s (medians)", "ratio",
            _down),
    Measure("incremental_report_vs_new", f"copy of version {VERSIONS}: CopyReport.bytes / its new_bytes",
            "ratio", lambda r: r.incremental["report"]["bytes"] / _last_new(r)),
    Measure("full_sent_vs_source_objects", "full copy: bytes at the destination / the source's objects",
            "ratio", lambda r: r.full["dest_new_bytes"] / r.source_object_bytes),
    Measure("copy_up_mb_per_s", "copy local -> S3 (median)", "mb_per_s",
            lambda r: r.mb_per_s(statistics.median(x.copy_up_bytes for x in r.rounds), "copy_up_s")),
    Measure("raw_upload_mb_per_s", "raw boto3 upload (median)", "mb_per_s",
            lambda r: r.mb_per_s(r.raw_bytes, "raw_upload_s")),
    Measure("copy_down_mb_per_s", "copy S3 -> local (median)", "mb_per_s",
            lambda r: r.mb_per_s(statistics.median(x.copy_down_bytes for x in r.rounds), "copy_down_s")),
    Measure("raw_download_mb_per_s", "raw boto3 download (median)", "mb_per_s",
            lambda r: r.mb_per_s(r.raw_bytes, "raw_download_s")),
)

TARGETS: dict[str, float] = {  # issue 34, upper limits
    "incremental_sent_vs_new": 1.1,
    "full_sent_vs_stored": 1.05,
}

FLOORS: dict[str, float] = {  # issue 34, lower limits
    "up_vs_raw_upload": 0.9,
    "down_vs_raw_download": 0.9,
}

NOTES = (f"see benchmarks/copy_bench.py; the frozen fine-tune at {STATE_SCALE:g}x --scale, {VERSIONS} "
         "versions; bytes sent = bytes of the objects new at the destination's locations; S3 is moto "
         f"behind a {RATE / MB:g} MB/s-each-way TCP proxy in a child process; raw objects = the objects a "
         f"warm-up copy stored on S3; {REPEATS} interleaved rounds, throughputs over median times; every "
         "copy restored from its destination and checked bit for bit")


def raw_table(outcomes: Mapping[str, CopyResult]) -> Table:
    """The copy workload's bytes and times, one row per copy."""
    table = Table(title=f"copy: Store.copy between stores (S3 throttled to {RATE / MB:g} MB/s)")
    for column in ("copy", "bytes at dest", "against", "wall (median)", "MB/s", "rounds"):
        table.add_column(column, justify="left" if column == "copy" else "right")
    for r in outcomes.values():
        inc, full = r.incremental, r.full
        table.add_row(f"{RUN}@{VERSIONS}, 1-{VERSIONS - 1} held", measure.fmt_bytes(inc["dest_new_bytes"]),
                      f"new {measure.fmt_bytes(_last_new(r))}", "", "", "")
        table.add_row(f"{RUN} into an empty store", measure.fmt_bytes(full["dest_new_bytes"]),
                      f"stored {measure.fmt_bytes(r.run_stored_bytes)}", "", "", "")
        for label, field, nbytes in (
                ("raw boto3 upload", "raw_upload_s", r.raw_bytes),
                ("copy local -> S3", "copy_up_s", statistics.median(x.copy_up_bytes for x in r.rounds)),
                ("raw boto3 download", "raw_download_s", r.raw_bytes),
                ("copy S3 -> local", "copy_down_s", statistics.median(x.copy_down_bytes for x in r.rounds))):
            samples = ", ".join(f"{getattr(x, field):.2f}" for x in r.rounds)
            rate = r.mb_per_s(nbytes, field)
            table.add_row(label, measure.fmt_bytes(nbytes), "", f"{r.median(field):.2f} s",
                          "" if rate is None else f"{rate:.1f}", samples)
        table.add_row("bit-exact", "yes" if r.verified else "[red]NO[/]", "", "", "",
                      f"{VERSIONS} versions x {measure.fmt_bytes(r.logical_bytes)}")
    return table
