"""The ``redundancy`` workload: what erasure coding (and replication) costs on one disk.

The state is the ``dense`` one (GPT-style decoder + AdamW at ``--scale``).
Everything runs in one work directory on one disk, so the "locations" of a
store are plain directories beside each other: the figures measure the CPU
and I/O the redundancy engine adds, not what separate failure domains would
give. In this order:

1. baseline: ``torch.save`` (fsync'd) and ``torch.load`` of the state;
2. one store per scheme -- ``none`` (1 location), ``ec:4+2`` (6 locations),
   ``replicate:2`` (2 locations) -- each: first commit of the state and the
   pack bytes on disk summed over its locations. First commits are repeated
   ``COMMIT_ROUNDS`` times, each into fresh stores of every scheme in turn
   (so drift hits all alike), median kept, with the CPU seconds of the
   committing process and of the erasure-coding worker processes (whose
   start-up is part of a store's first erasure-coded commit); the last
   round's stores go on. Each round first measures the floor of the ``ec:4+2``
   commit (``benchmarks/ecfloor.py``: the state's bytes, cut into packs of the
   store's pack size, erasure-coded on all cores while the shards are written,
   fsync'd, to six directories), median kept, so the commit's ratio to its floor
   comes from the same run. Then ``RESTORE_ROUNDS`` rounds of a full restore
   (checked) of every store in turn, median kept;
3. degraded restore: the data shards 0 and 1 of every ``ec:4+2`` pack are
   deleted from disk, then a full restore (checked) has to rebuild every pack
   from the 2 data + 2 parity shards left and writes the 2 lost shards back
   (heal on read);
4. scrub: ``store.ops.check(read_data=True)`` of the ``ec:4+2`` store (every shard
   read in full and verified, every pack rebuilt, every chunk decoded) and of
   the ``none`` store, as its baseline;
5. repair: one location's directory is deleted and the location declared
   failed (``store.locations.fail``), then ``store.ops.repair()`` re-creates its
   shards on the 5 locations left (one failure domain then holds two shards
   of a pack; casckpt warns and proceeds); a full restore afterwards checks
   the result;
6. codec: raw ``ErasureCode(4, 2)`` encode and decode (from parity, two data
   fragments lost) of a 64 MiB random buffer, next to one plain copy of it
   (``bytearray``) as the memory-bandwidth baseline; medians of a few rounds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import casckpt
from benchmarks import measure
from benchmarks.ecfloor import Floor, ec_floor
from benchmarks.suite import Baseline
from benchmarks.suite import _baseline as torch_baseline  # the same fsync'd torch.save / torch.load
from benchmarks.workloads import build
from casckpt.config import DEFAULT_PACK_SIZE
from casckpt.storage.erasure import ErasureCode
from casckpt.testing.internals import internals

Log = Callable[[str], None]

NAME = "redundancy"
MiB = 1 << 20
MB = 1_000_000  # throughputs are in MB/s (10^6 bytes per second)
EC_K, EC_M = 4, 2
EC = f"ec:{EC_K}+{EC_M}"
SCHEMES = (("none", 1), (EC, EC_K + EC_M), ("replicate:2", 2))  # (spec, locations)
LOST_SHARDS = (0, 1)  # data shards: a reader of a healthy pack needs them, so each pack is decoded
FAILED_LOCATION = 0  # index of the location whose directory the repair round deletes
CODEC_BUFFER = 64 * MiB
CODEC_ROUNDS = 3
RESTORE_ROUNDS = 3  # healthy restores are repeated (median reported): single runs vary by ~20%
COMMIT_ROUNDS = 3  # so are first commits, each into fresh stores
PACK_PREFIX = "packs"


@dataclass(frozen=True)
class SchemeRun:
    """One store with one redundancy scheme: its first commit and a full restore."""

    redundancy: str
    locations: int
    commit_s: float  # median of commit_rounds_s
    commit_rounds_s: list[float]
    commit_cpu_s: float  # the committing process, user + system (median over the rounds)
    commit_worker_cpu_s: float | None  # the encoding workers (median; None: not measurable here)
    commit_peak_extra_rss: int
    version: dict[str, Any]
    packs: int
    pack_files: int
    pack_bytes_on_disk: int
    stats: dict[str, Any]  # store.ops.stats() after the commit (pack_bytes, location_bytes, ...)
    restore_s: float  # median of restore_rounds_s
    restore_rounds_s: list[float]
    restore_verified: bool


@dataclass(frozen=True)
class Degraded:
    """Full restore of the ``ec`` store after deleting ``lost_shards`` of every pack."""

    lost_shards: list[int]
    files_deleted: int
    bytes_deleted: int
    restore_s: float
    verified: bool
    files_healed: int  # deleted shard files found back on disk after the restore
    warnings: int  # casckpt warnings logged during the restore (one per shard damage found)


@dataclass(frozen=True)
class Scrub:
    """``store.ops.check(read_data=True)`` of the ``ec`` store and of the ``none`` store."""

    ec_s: float
    ec_pack_bytes: int  # CheckReport.bytes_read: the packs' bytes, rebuilt and verified
    ec_shard_bytes: int  # shard files on disk, all read
    ec_problems: int
    none_s: float
    none_pack_bytes: int
    none_problems: int


@dataclass(frozen=True)
class Repair:
    """``store.ops.repair()`` after one location's directory vanished and it was declared failed."""

    failed_location: str
    files_deleted: int
    bytes_deleted: int
    repair_s: float
    report: dict[str, Any]
    restore_s: float  # full restore after the repair, on the 5 locations left
    verified: bool  # the restore is bit-exact and repair left no pack short of shards


@dataclass(frozen=True)
class Codec:
    """Raw ``ErasureCode(k, m)`` on a random buffer (medians over ``rounds``)."""

    k: int
    m: int
    algorithm: str
    buffer_bytes: int
    rounds: int
    encode_s: float
    decode_s: float  # from fragments 2..k+m-1: two data fragments lost
    copy_s: float  # bytearray(buffer): one copy into fresh memory, the same-run baseline
    encode_mb_per_s: float
    decode_mb_per_s: float
    copy_mb_per_s: float
    verified: bool


@dataclass(frozen=True)
class RedundancyResult:
    """Every raw number of the ``redundancy`` workload."""

    name: str
    model: dict[str, int]
    tensors: int
    logical_bytes: int
    baseline: Baseline
    schemes: dict[str, SchemeRun]
    ec_floor: Floor  # the round of median seconds
    ec_floor_rounds_s: list[float]
    degraded: Degraded
    scrub: Scrub
    repair: Repair
    codec: Codec

    def scheme(self, spec: str) -> SchemeRun | None:
        """The run of scheme ``spec``, if it was measured."""
        return self.schemes.get(spec)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


class _Counter(logging.Handler):
    """Counts casckpt log records at WARNING and above (they are not printed meanwhile)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@contextmanager
def _quiet_casckpt() -> Iterator[_Counter]:
    """Keep casckpt's per-pack warnings (damaged shards, doubled-up domains) off the console.

    They are expected here and would otherwise flood the table; they are
    counted instead.
    """
    logger = logging.getLogger("casckpt")
    counter = _Counter()
    saved = logger.propagate
    logger.addHandler(counter)
    logger.propagate = False
    try:
        yield counter
    finally:
        logger.removeHandler(counter)
        logger.propagate = saved


def _files(roots: list[Path]) -> list[Path]:
    """Every pack object (whole pack, copy or shard) under the given location directories."""
    return [p for root in roots for p in sorted((root / PACK_PREFIX).rglob("*")) if p.is_file()]


def _bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def _restore(store: casckpt.Store, ref: str, state: Any) -> tuple[float, bool]:
    restored, seconds = measure.timed(lambda: store.restore(ref))
    ok = measure.trees_equal(state, restored)
    del restored
    return seconds, ok


def _locations(workdir: Path, spec: str, count: int) -> list[Path]:
    tag = spec.replace(":", "-").replace("+", "-")
    return [workdir / f"{tag}-loc{i}" for i in range(count)]


@dataclass(frozen=True)
class _Committed:
    """A scheme's store right after its first commit (restores come later, interleaved)."""

    store: casckpt.Store
    roots: list[Path]
    commit_s: float
    commit_cpu_s: float
    commit_worker_cpu_s: float | None
    commit_peak_extra_rss: int
    version: dict[str, Any]
    pack_files: int
    pack_bytes: int
    stats: dict[str, Any]


def _worker_cpu_s(store: casckpt.Store) -> float | None:
    """CPU seconds (user + system) the store's erasure-coding workers used so far (Linux)."""
    total = 0.0
    for pid in internals(store).packs.coder.worker_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _commit(store: casckpt.Store, roots: list[Path], state: Any) -> _Committed:
    cpu = time.process_time()
    version, commit_s, rss = measure.timed_with_rss(lambda: store.commit(state, run=NAME, step=1))
    cpu = time.process_time() - cpu
    files = _files(roots)
    return _Committed(store, roots, commit_s, cpu, _worker_cpu_s(store), rss, version.to_dict(),
                      len(files), _bytes(files), store.ops.stats().to_dict())


def _commit_rounds(workdir: Path, state: Any, log: Log) -> tuple[dict[str, _Committed],
                                                                 dict[str, list[_Committed]], list[Floor]]:
    """``COMMIT_ROUNDS`` rounds of the ``ec`` floor and a first commit per scheme into fresh
    stores, round-robin; the last round's stores stay open (returned first), the others are
    closed and removed."""
    rounds: dict[str, list[_Committed]] = {spec: [] for spec, _ in SCHEMES}
    kept: dict[str, _Committed] = {}
    floors: list[Floor] = []
    try:
        _commit_each_round(workdir, state, log, rounds, kept, floors)
    except BaseException:
        for c in kept.values():
            c.store.close()
        raise
    return kept, rounds, floors


def _floor(workdir: Path, state: Any) -> Floor:
    """The floor of an ``ec:4+2`` first commit of ``state`` (``benchmarks/ecfloor.py``)."""
    where = workdir / "ec-floor"
    try:
        return ec_floor([measure.raw_bytes(t) for _, t in measure.tensor_leaves(state)],
                        DEFAULT_PACK_SIZE, EC_K, EC_M, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _commit_each_round(workdir: Path, state: Any, log: Log, rounds: dict[str, list[_Committed]],
                       kept: dict[str, _Committed], floors: list[Floor]) -> None:
    for i in range(COMMIT_ROUNDS):
        last = i == COMMIT_ROUNDS - 1
        log(f"{NAME}: {EC} floor: encode on all cores + write the shards ({i + 1}/{COMMIT_ROUNDS})")
        floors.append(_floor(workdir, state))
        for spec, count in SCHEMES:
            base = workdir if last else workdir / f"round{i}"
            roots = _locations(base, spec, count)
            log(f"{NAME}: {spec} on {count} location(s): first commit ({i + 1}/{COMMIT_ROUNDS})")
            store = _open(base, spec, roots)
            try:
                committed = _commit(store, roots, state)
            except BaseException:
                store.close()
                raise
            rounds[spec].append(committed)
            if last:
                kept[spec] = committed
            else:
                store.close()
                shutil.rmtree(base / spec.replace(":", "-").replace("+", "-"))
                for root in roots:
                    shutil.rmtree(root, ignore_errors=True)


def _restore_rounds(committed: dict[str, _Committed], state: Any) -> dict[str, list[tuple[float, bool]]]:
    """``RESTORE_ROUNDS`` full restores of every store, round-robin, so drift hits all alike."""
    rounds: dict[str, list[tuple[float, bool]]] = {spec: [] for spec in committed}
    for _ in range(RESTORE_ROUNDS):
        for spec, c in committed.items():
            rounds[spec].append(_restore(c.store, c.version["id"], state))
    return rounds


def _scheme_run(spec: str, c: _Committed, commits: list[_Committed],
                rounds: list[tuple[float, bool]]) -> SchemeRun:
    seconds = [s for s, _ in rounds]
    workers = [r.commit_worker_cpu_s for r in commits]
    return SchemeRun(spec, len(c.roots), statistics.median(r.commit_s for r in commits),
                     [r.commit_s for r in commits], statistics.median(r.commit_cpu_s for r in commits),
                     None if None in workers else statistics.median(w or 0.0 for w in workers),
                     c.commit_peak_extra_rss, c.version, c.stats["packs"], c.pack_files, c.pack_bytes,
                     c.stats, statistics.median(seconds), seconds, all(ok for _, ok in rounds))


def _open(workdir: Path, spec: str, roots: list[Path]) -> casckpt.Store:
    return casckpt.open(workdir / spec.replace(":", "-").replace("+", "-"),
                        blobs=[str(r) for r in roots], redundancy=spec)


def _lose_shards(roots: list[Path], lost: tuple[int, ...]) -> tuple[int, int, list[Path]]:
    """Delete shard files ``.s<i>`` (i in ``lost``) of every pack; returns count, bytes, paths."""
    suffixes = tuple(f".s{i}" for i in lost)
    doomed = [p for p in _files(roots) if p.name.endswith(suffixes)]
    size = _bytes(doomed)
    for path in doomed:
        path.unlink()
    return len(doomed), size, doomed


def _degraded(store: casckpt.Store, ref: str, roots: list[Path], state: Any) -> Degraded:
    count, size, doomed = _lose_shards(roots, LOST_SHARDS)
    with _quiet_casckpt() as warnings:
        restore_s, ok = _restore(store, ref, state)
    healed = sum(1 for p in doomed if p.exists())
    return Degraded(list(LOST_SHARDS), count, size, restore_s, ok, healed, warnings.count)


def _scrub(ec_store: casckpt.Store, ec_roots: list[Path], none_store: casckpt.Store) -> Scrub:
    ec_report, ec_s = measure.timed(lambda: ec_store.ops.check(read_data=True))
    none_report, none_s = measure.timed(lambda: none_store.ops.check(read_data=True))
    return Scrub(ec_s, ec_report.bytes_read, _bytes(_files(ec_roots)), len(ec_report.problems),
                 none_s, none_report.bytes_read, len(none_report.problems))


def _repair(store: casckpt.Store, ref: str, roots: list[Path], state: Any) -> Repair:
    victim = roots[FAILED_LOCATION]
    files = _files([victim])
    count, size = len(files), _bytes(files)
    name = next(loc.name for loc in store.locations.list() if loc.url == victim.resolve().as_uri())
    shutil.rmtree(victim)
    with _quiet_casckpt():
        store.locations.fail(name)
        report, repair_s = measure.timed(store.ops.repair)
        restore_s, ok = _restore(store, ref, state)
    # with 5 locations for 6 shards, one domain holds two shards of some packs: repair reports
    # those packs degraded (report.ok is False) by design; what it must not leave is a pack short
    # of shards
    return Repair(name, count, size, repair_s, report.to_dict(), restore_s, ok and not report.unrepaired)


def _codec_round(code: ErasureCode, data: bytes) -> tuple[float, float, float, bool]:
    """One round: seconds to copy, encode, decode (two data fragments lost); decoded == data."""
    copied, copy_s = measure.timed(lambda: bytearray(data))
    del copied
    (fragments, _stripe, _offset), encode_s = measure.timed(lambda: code.encode(data))
    survivors = fragments[2:]  # two data fragments lost: decoding has to use parity
    del fragments
    decoded, decode_s = measure.timed(lambda: code.decode(survivors, len(data), "benchmark buffer"))
    return copy_s, encode_s, decode_s, decoded == data


def _codec(k: int, m: int, size: int, rounds: int) -> Codec:
    code = ErasureCode(k, m)
    data = os.urandom(size)
    results = [_codec_round(code, data) for _ in range(rounds)]
    cpy, enc, dec = (statistics.median(r[i] for r in results) for i in range(3))
    return Codec(k, m, code.algorithm, size, rounds, enc, dec, cpy, size / MB / enc,
                 size / MB / dec, size / MB / cpy, all(r[3] for r in results))


def run_redundancy(scale: float, workdir: Path, log: Log) -> RedundancyResult:
    """Measure the ``redundancy`` workload at ``scale``; ``workdir`` must be an empty directory."""
    log(f"{NAME}: building the dense state")
    wl = build("dense", scale)
    state = wl.state()
    log(f"{NAME}: torch.save + fsync, torch.load")
    baseline = torch_baseline(state, workdir)
    committed: dict[str, _Committed] = {}
    try:
        committed, commits, floors = _commit_rounds(workdir, state, log)
        log(f"{NAME}: full restores, {RESTORE_ROUNDS} rounds over {', '.join(committed)}")
        rounds = _restore_rounds(committed, state)
        schemes = {spec: _scheme_run(spec, c, commits[spec], rounds[spec]) for spec, c in committed.items()}
        ref = schemes[EC].version["id"]
        log(f"{NAME}: {EC}: delete shards {list(LOST_SHARDS)} of every pack, restore (decode + heal)")
        degraded = _degraded(committed[EC].store, ref, committed[EC].roots, state)
        log(f"{NAME}: check(read_data=True) of the {EC} and none stores")
        scrub = _scrub(committed[EC].store, committed[EC].roots, committed["none"].store)
        log(f"{NAME}: {EC}: delete one location, fail_location, repair, restore")
        repair = _repair(committed[EC].store, ref, committed[EC].roots, state)
    finally:
        for c in committed.values():
            c.store.close()
    log(f"{NAME}: ErasureCode({EC_K}, {EC_M}) encode/decode of {CODEC_BUFFER // MiB} MiB "
        f"x {CODEC_ROUNDS}")
    codec = _codec(EC_K, EC_M, CODEC_BUFFER, CODEC_ROUNDS)
    return RedundancyResult(
        name=NAME,
        model=dataclasses.asdict(wl.cfg),
        tensors=sum(1 for _ in measure.tensor_leaves(state)),
        logical_bytes=measure.logical_bytes(state),
        baseline=baseline,
        schemes=schemes,
        ec_floor=sorted(floors, key=lambda f: f.seconds)[len(floors) // 2],
        ec_floor_rounds_s=[f.seconds for f in floors],
        degraded=degraded,
        scrub=scrub,
        repair=repair,
        codec=codec,
    )
