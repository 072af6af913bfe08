"""Chaos soak: a shared store under every fault at once, then proof that nothing acknowledged is lost.

    python -m benchmarks.chaos --minutes 25 --out chaos.json    # the benchmark
    python -m benchmarks.chaos --minutes 2      # CI's slow tier (tests/benchmarks/test_bench_chaos.py)

The store: a PostgreSQL catalog (:class:`casckpt.testing.postgres.CrashablePostgres`) and
``ec:4+2`` over 6 locations (3 buckets x 2 prefixes, one failure domain each) on a moto
S3 server reached through one :class:`casckpt.testing.faultproxy.FaultProxy`.

Processes (``python -m benchmarks.chaos worker ROLE ...``), each restarted when it dies:

* ``writer`` x2: commits run ``wN`` step after step; ``bg``: the same with ``block=False``
  and ``handle.wait()``; ``fast``: with a local fast tier, journaled only after
  ``wait_durable`` (a version on the fast tier alone is not yet acknowledged as durable);
* ``reader``: restores random journaled versions and compares their digest;
* ``gc``: ``casckpt gc --grace 0s --json`` every few seconds (retention ``keep_last=5,
  keep_every=20`` on every run), a new process each time, cron-style.

Each writer appends ``begin STEP`` to its journal before a commit and ``ack STEP DIGEST``
only after the commit returned: a version is *acknowledged* when its ack line exists.
A version visible at the end without an ack is *in flight* (allowed) only when its
writer was killed between begin and ack of that step, or when it is the fast writer's
(``committed STEP`` journaled: on the fast tier, not yet drained, so not acknowledged as
durable; if the tier was wiped before its drain it cannot be read, and is counted as
``undrained_unreadable``); any other is *unacknowledged visible* (a failure). State
contents are a pure function of (run, step), so every visible version is checked
bit-exact, acknowledged or not.

Faults, one every 20-60 s of a 25-minute run (scaled by ``minutes / 25``), drawn at random
from a shuffled deck of every kind so each kind comes up as often:
kill -9 of a writer, of a running gc, of the fast writer while its drain runs, and of a
running repair; a PostgreSQL immediate shutdown (restarted after 1-3 s); S3 windows
(6-10 s, scaled down to no less than 30 %) of dropped responses, delays, blackholes,
bodies cut mid-way and 503 SlowDown;
a location emptied; the fast tier wiped; one bucket losing every object (an S3 server
restart without persistence: two locations lost at once). After a loss, ``repair`` runs
(and is retried) before the next fault, since ec:4+2 survives two lost shards, not three.

At the end: workers stopped, a final ``gc`` (``--force`` when it refuses because killed
commits left over 10 % of a location orphaned; reported), then ``repair`` and
``check --read-data`` must be clean; every acknowledged version that retention keeps must be visible and
restore exactly; every visible version must restore exactly. An untyped exception in
any worker (anything not a :class:`casckpt.errors.CasckptError`), or a worker silent for
over 60 s (the watchdog), fails the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NAME = "chaos"
BUCKETS = ("chaos-a", "chaos-b", "chaos-c")
PREFIXES = ("p0", "p1")
WRITERS = ("w0", "w1", "bg", "fast")
KEEP_LAST, KEEP_EVERY = 5, 20
HANG_S = 60.0
GC_REFUSED_EXIT = 7  # GCRefusedError: deleting is not proven safe
WRITE_PAUSE_S = 0.5  # between a writer's commits: what an emptied location has to repair stays small
FULL_MINUTES = 25.0
KINDS = (
    "kill_writer", "kill_gc", "kill_drain", "kill_repair", "pg_immediate_shutdown",
    "s3_drop", "s3_delay", "s3_blackhole", "s3_cut_body", "s3_slowdown",
    "location_emptied", "fast_tier_wiped", "bucket_lost",
)
# what a worker's environment adds: outages of up to 10 s are ridden out, not raised
WORKER_ENV = {"CASCKPT_STORAGE_RETRY_S": "30", "CASCKPT_CATALOG_RETRY_S": "30"}


# -- the state of a version: a pure function of (run, step) --------------------------------

def state_of(run: str, step: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{run}@{step}".encode()))
    shared = torch.Generator().manual_seed(step // 7)  # some chunks repeat across versions
    return {"own": torch.randn(3000, generator=gen), "shared": torch.randn(3000, generator=shared)}


def digest_of(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().numpy().tobytes())
    return h.hexdigest()


# -- workers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where everything of one soak lives; passed to workers as JSON."""

    root: str
    catalog: str
    endpoint: str
    work: str

    @property
    def blobs(self) -> list[str]:
        return [f"s3://{b}/{p}" for b in BUCKETS for p in PREFIXES]

    def journal(self, role: str) -> Path:
        return Path(self.work) / f"journal-{role}.txt"

    def events(self, role: str) -> Path:
        return Path(self.work) / f"events-{role}.txt"

    def heartbeat(self, role: str) -> Path:
        return Path(self.work) / f"alive-{role}"

    @property
    def fast_tier(self) -> str:
        return str(Path(self.work) / "fast")

    def open(self, **kwargs: Any) -> Any:
        import casckpt

        return casckpt.open(self.root, blobs=self.blobs, catalog=self.catalog,
                            s3={"endpoint_url": self.endpoint}, chunk_size=4096,
                            pack_size=64 << 10, **kwargs)


def _event(layout: Layout, role: str, what: str) -> None:
    with open(layout.events(role), "a") as f:
        f.write(what + "\n")
    layout.heartbeat(role).touch()


def _typed(layout: Layout, role: str, exc: BaseException) -> None:
    from casckpt.errors import CasckptError

    if not isinstance(exc, CasckptError):
        _event(layout, role, "untyped " + "".join(traceback.format_exception_only(exc)).strip()
               .replace("\n", " "))
        raise exc
    _event(layout, role, f"typed {type(exc).__name__}")


def _acked(layout: Layout, role: str) -> dict[int, str]:
    acked: dict[int, str] = {}
    if layout.journal(role).exists():
        for line in layout.journal(role).read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ack":
                acked[int(parts[1])] = parts[2]
    return acked


def _committed(layout: Layout, role: str) -> set[int]:
    """Steps the fast writer's commit returned for (on the fast tier) before they were durable."""
    path = layout.journal(role)
    lines = path.read_text().splitlines() if path.exists() else []
    return {int(line.split()[1]) for line in lines if line.startswith("committed ")}


def _next_step(layout: Layout, role: str) -> int:
    begun = [int(line.split()[1]) for line in layout.journal(role).read_text().splitlines()
             if line.startswith("begin ")] if layout.journal(role).exists() else []
    return max(begun, default=-1) + 1  # never reuse a step that may have been published


def writer(layout: Layout, role: str) -> None:
    kwargs: dict[str, Any] = {"fast_tier": layout.fast_tier} if role == "fast" else {}
    with layout.open(**kwargs) as store:
        step = _next_step(layout, role)
        while True:
            state = state_of(role, step)
            with open(layout.journal(role), "a") as f:
                f.write(f"begin {step}\n")
            try:
                if role == "bg":
                    version = store.commit(state, run=role, step=step, block=False).wait()
                else:
                    version = store.commit(state, run=role, step=step)
                if role == "fast":
                    with open(layout.journal(role), "a") as f:
                        f.write(f"committed {step}\n")
                    store.tier.wait_durable(version.id)
            except Exception as exc:  # noqa: BLE001 - sorted into typed and untyped
                _typed(layout, role, exc)
                step += 1
                time.sleep(0.2)
                continue
            with open(layout.journal(role), "a") as f:
                f.write(f"ack {step} {digest_of(state)}\n")
            _event(layout, role, "commit")
            step += 1
            time.sleep(WRITE_PAUSE_S)


def reader(layout: Layout, role: str) -> None:
    rng = random.Random(os.getpid())
    with layout.open() as store:
        while True:
            run = rng.choice(WRITERS)
            acked = _acked(layout, run)
            if not acked:
                time.sleep(0.5)
                continue
            step = rng.choice(sorted(acked)[-10:] if rng.random() < 0.7 else sorted(acked))
            try:
                got = store.restore(f"{run}@{step}")
            except Exception as exc:  # noqa: BLE001 - sorted into typed and untyped
                _typed(layout, role, exc)
                continue
            _event(layout, role, "restore" if digest_of(got) == acked[step] else f"wrong {run}@{step}")


def worker_main(argv: list[str]) -> int:
    role, layout_json = argv
    layout = Layout(**json.loads(layout_json))
    layout.heartbeat(role).touch()
    (reader if role == "reader" else writer)(layout, role)
    return 0


# -- the driver ------------------------------------------------------------------------

@dataclass
class FaultTally:
    injected: int = 0
    survived: int = 0


@dataclass
class Result:
    minutes: float
    seed: int
    faults: dict[str, FaultTally] = field(default_factory=dict)
    acknowledged: int = 0
    kept_by_retention: int = 0
    restored_exactly: int = 0
    lost: int = 0
    wrong: int = 0
    in_flight_visible: int = 0
    undrained_unreadable: int = 0
    unacknowledged_visible: int = 0
    typed_errors: int = 0
    untyped_errors: int = 0
    reads: int = 0
    wrong_reads: int = 0
    gc_runs: int = 0
    hangs: int = 0
    gc_refused: bool = False
    final_repair_ok: bool = False
    final_check_ok: bool = False
    missing_kinds: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.problems and self.lost == 0 and self.wrong == 0 and self.wrong_reads == 0
                and self.unacknowledged_visible == 0 and self.untyped_errors == 0 and self.hangs == 0
                and self.final_repair_ok and self.final_check_ok)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class Soak:
    """Runs the processes, injects faults, and verifies at the end."""

    def __init__(self, work: Path, minutes: float, seed: int, log: Callable[[str], None]) -> None:
        self.work, self.minutes, self.log = work, minutes, log
        self.rng = random.Random(seed)
        self.result = Result(minutes=minutes, seed=seed,
                             faults={k: FaultTally() for k in KINDS})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.gc_proc: subprocess.Popen[bytes] | None = None
        self.next_gc = 0.0
        self.killed_in: dict[str, list[int]] = {}  # role -> steps begun when it was killed

    # processes
    def env(self) -> dict[str, str]:
        return {**os.environ, **WORKER_ENV, "CASCKPT_STORE": self.layout.root,
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                               os.environ.get("PYTHONPATH", "")])}

    def spawn(self, role: str) -> None:
        layout = json.dumps(asdict(self.layout))
        log = open(self.work / f"stderr-{role}.txt", "ab")  # noqa: SIM115 - the child owns it
        self.procs[role] = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos", "worker", role, layout],
            env=self.env(), stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "casckpt.cli.main", *args], env=self.env(),
                              cwd=self.layout.root, capture_output=True, text=True, timeout=timeout)

    def cli_popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "casckpt.cli.main", *args], env=self.env(),
                                cwd=self.layout.root, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def kill(self, role: str) -> None:
        proc = self.procs[role]
        begun = _next_step(self.layout, role) - 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        acked = _acked(self.layout, role)
        if begun >= 0 and begun not in acked:
            self.killed_in.setdefault(role, []).append(begun)
        self.spawn(role)

    def tend(self) -> None:
        """Restart dead workers (an exit is a failure: workers run until killed), run cron gc,
        and watch for hangs."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                self.result.problems.append(f"worker {role} exited with {proc.returncode}")
                self.spawn(role)
        now = time.monotonic()
        if self.gc_proc is not None and self.gc_proc.poll() is not None:
            self.result.gc_runs += 1
            self.gc_proc = None
        if self.gc_proc is None and now >= self.next_gc:
            self.gc_proc = self.cli_popen("gc", "--grace", "0s", "--json")
            self.next_gc = now + self.gc_every
        for role in self.procs:
            beat = self.layout.heartbeat(role)
            if beat.exists() and time.time() - beat.stat().st_mtime > HANG_S:
                self.result.hangs += 1
                self.result.problems.append(f"{role} silent for over {HANG_S:.0f} s")
                beat.touch()

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tend()
            time.sleep(min(0.25, max(0.0, end - time.monotonic())))

    # faults
    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; True once the store is whole again."""
        window = self.rng.uniform(6, 10) * max(self.minutes / FULL_MINUTES, 0.3)
        if kind == "kill_writer":
            self.sleep(self.rng.uniform(0, 1))
            self.kill(self.rng.choice(["w0", "w1", "bg"]))
        elif kind == "kill_drain":
            self.sleep(self.rng.uniform(0, 1))
            self.kill("fast")
        elif kind == "kill_gc":
            if self.gc_proc is None or self.gc_proc.poll() is not None:
                self.gc_proc = self.cli_popen("gc", "--grace", "0s", "--json")
            self.sleep(self.rng.uniform(0.3, 2.0))
            self.gc_proc.send_signal(signal.SIGKILL)
            self.gc_proc.wait()
            self.gc_proc = None
        elif kind == "kill_repair":
            proc = self.cli_popen("repair")
            self.sleep(self.rng.uniform(0.3, 2.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        elif kind == "pg_immediate_shutdown":
            self.pg.crash()
            self.sleep(self.rng.uniform(1, 3))
            self.pg.start()
        elif kind.startswith("s3_"):
            bucket = self.rng.choice([None, *BUCKETS])  # all of S3, or one bucket
            where = None if bucket is None else f"/{bucket}/"
            many = 2**62
            if kind == "s3_drop":
                self.proxy.drop_next_response(many, path_contains=where)
            elif kind == "s3_delay":
                self.proxy.stall_next(many, seconds=self.rng.uniform(0.3, 2.0), path_contains=where)
            elif kind == "s3_blackhole":
                self.proxy.blackhole_next(many, seconds=window, path_contains=where)
            elif kind == "s3_cut_body":
                self.proxy.cut_next_download(many, path_contains=where)
            else:
                self.proxy.fail_next(many, status=503, code="SlowDown", path_contains=where)
            self.sleep(window)
            self.proxy.clear_faults()
        elif kind == "location_emptied":
            self.empty(self.rng.choice(BUCKETS), self.rng.choice(PREFIXES))
            return self.repair()
        elif kind == "bucket_lost":
            self.empty(self.rng.choice(BUCKETS), None)
            return self.repair()
        elif kind == "fast_tier_wiped":
            for child in Path(self.layout.fast_tier).glob("*"):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(
                    missing_ok=True)
        return True

    def empty(self, bucket: str, prefix: str | None) -> None:
        """Delete every object of a bucket (or of one prefix) behind casckpt's back."""
        kwargs = {} if prefix is None else {"Prefix": prefix + "/"}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, **kwargs):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})

    def repair(self, attempts: int = 5) -> bool:
        for _ in range(attempts):
            try:
                done = self.cli("repair", "--json", timeout=HANG_S * 3)
            except subprocess.TimeoutExpired:
                self.result.problems.append(f"repair ran over {HANG_S * 3:.0f} s")
                return False
            self.tend()
            if done.returncode == 0:
                return True
            self.log(f"  repair exit {done.returncode}: {(done.stdout + done.stderr)[-300:]}")
            self.sleep(1)
        return False

    # the soak
    def run(self) -> Result:
        from casckpt.testing.faultproxy import FaultProxy
        from casckpt.testing.postgres import CrashablePostgres
        from casckpt.testing.s3 import REGION, fake_aws_environment, moto_server

        with ExitStack() as stack:
            stack.enter_context(fake_aws_environment(self.work))
            endpoint = stack.enter_context(moto_server())
            self.proxy = stack.enter_context(FaultProxy(endpoint, timeout=30.0))
            self.pg = CrashablePostgres(self.work / "pg")
            stack.callback(self.pg.stop)
            import boto3

            self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
            for bucket in BUCKETS:
                self.s3.create_bucket(Bucket=bucket)
            (self.work / "store").mkdir()
            self.layout = Layout(str(self.work / "store"), self.pg.new_database(),
                                 self.proxy.endpoint_url, str(self.work))
            with self.layout.open(redundancy="ec:4+2", create=True) as store:
                for role in WRITERS:
                    store.retention.set(role, keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
            stack.callback(self.stop_all)
            self.soak()
            self.stop_all()
            self.verify()
        return self.result

    def soak(self) -> None:
        scale = self.minutes / FULL_MINUTES
        self.gc_every = max(3.0, 20.0 * scale)
        for role in (*WRITERS, "reader"):
            self.spawn(role)
        end = time.monotonic() + self.minutes * 60
        deck: list[str] = []
        self.sleep(min(10.0, 60 * scale))
        while time.monotonic() < end:
            if not deck:
                deck = list(KINDS)
                self.rng.shuffle(deck)
            kind = deck.pop()
            tally = self.result.faults[kind]
            tally.injected += 1
            self.log(f"{time.monotonic() - end + self.minutes * 60:7.1f}s  {kind}")
            if self.inject(kind):
                tally.survived += 1
            self.sleep(self.rng.uniform(20, 60) * scale)

    def stop_all(self) -> None:
        self.proxy.clear_faults()
        for proc in [*self.procs.values(), *([self.gc_proc] if self.gc_proc else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        for role, proc in self.procs.items():
            if proc.returncode == -signal.SIGKILL:
                begun = _next_step(self.layout, role) - 1
                if begun >= 0 and begun not in _acked(self.layout, role):
                    self.killed_in.setdefault(role, []).append(begun)
        self.procs.clear()
        self.gc_proc = None

    def verify(self) -> None:
        result = self.result
        for role in (*WRITERS, "reader"):
            path = self.layout.events(role)
            events = Counter(line.split()[0] for line in path.read_text().splitlines()) \
                if path.exists() else Counter()
            result.typed_errors += events["typed"]
            result.untyped_errors += events["untyped"]
            result.reads += events["restore"] if role == "reader" else 0
            result.wrong_reads += events["wrong"]
            if events["untyped"]:
                result.problems += [line for line in path.read_text().splitlines()
                                    if line.startswith("untyped")][:3]
        final_gc = self.cli("gc", "--grace", "0s", "--json")
        if final_gc.returncode == GC_REFUSED_EXIT:
            # commits killed or failed after their uploads leave packs the catalog never knew;
            # past 10 % of a location gc refuses until told (--force). The soak says so, forces,
            # and the check --read-data below proves the forced gc deleted nothing needed.
            result.gc_refused = True
            final_gc = self.cli("gc", "--grace", "0s", "--force", "--json")
        if final_gc.returncode != 0:
            result.problems.append(f"final gc exit {final_gc.returncode}: {final_gc.stderr[-300:]}")
        result.final_repair_ok = self.repair(attempts=3)
        check = self.cli("check", "--read-data", timeout=600)
        result.final_check_ok = check.returncode == 0
        if not result.final_check_ok:
            result.problems.append(f"check --read-data exit {check.returncode}: "
                                   f"{(check.stdout + check.stderr)[-500:]}")
        with self.layout.open() as store:
            for run in WRITERS:
                self.verify_run(store, run)

    def verify_run(self, store: Any, run: str) -> None:
        from casckpt.errors import VersionLostError, VersionNotDurableError

        result = self.result
        acked = _acked(self.layout, run)
        result.acknowledged += len(acked)
        visible = {v.step for v in store.log(run, limit=None)} if self.layout.journal(run).exists() else set()
        in_flight = set(self.killed_in.get(run, [])) | _committed(self.layout, run)
        candidates = sorted(set(acked) | visible)
        kept = set(candidates[-KEEP_LAST:])
        buckets: dict[int, int] = {}
        for step in candidates:
            buckets.setdefault(step // KEEP_EVERY, step)
        kept |= set(buckets.values())
        for step in sorted(visible):
            if step not in acked:
                if step in in_flight:
                    result.in_flight_visible += 1
                else:
                    result.unacknowledged_visible += 1
                    result.problems.append(f"{run}@{step} visible, never acknowledged")
            try:
                got = digest_of(store.restore(f"{run}@{step}"))
            except (VersionNotDurableError, VersionLostError):  # not drained here, or its tier wiped
                if step in acked:
                    result.lost += 1
                    result.problems.append(f"{run}@{step} acknowledged durable, not durable")
                else:  # committed to the fast tier, never drained: its bytes went with the tier
                    result.undrained_unreadable += 1
                continue
            if got != digest_of(state_of(run, step)):
                result.wrong += 1
                result.problems.append(f"{run}@{step} restores other bytes")
            elif step in acked:
                result.restored_exactly += 1
        for step in sorted(kept & set(acked)):
            result.kept_by_retention += 1
            if step not in visible:
                result.lost += 1
                result.problems.append(f"{run}@{step} acknowledged, kept by retention, gone")


def render(result: Result) -> str:
    lines = [f"chaos soak, {result.minutes:g} min, seed {result.seed}",
             f"{'fault':<24}{'injected':>9}{'survived':>9}"]
    for kind, tally in result.faults.items():
        lines.append(f"{kind:<24}{tally.injected:>9}{tally.survived:>9}")
    total_i = sum(t.injected for t in result.faults.values())
    total_s = sum(t.survived for t in result.faults.values())
    lines.append(f"{'total':<24}{total_i:>9}{total_s:>9}")
    lines += [
        f"acknowledged versions {result.acknowledged}, kept by retention {result.kept_by_retention}, "
        f"restored exactly {result.restored_exactly}",
        f"lost {result.lost}, wrong {result.wrong}, unacknowledged visible "
        f"{result.unacknowledged_visible}, in flight when killed and visible {result.in_flight_visible} "
        f"(of which on a wiped fast tier, never drained: {result.undrained_unreadable})",
        f"reader restores {result.reads} (wrong {result.wrong_reads}), gc runs {result.gc_runs}",
        f"typed errors {result.typed_errors}, untyped {result.untyped_errors}, hangs over "
        f"{HANG_S:.0f} s {result.hangs}",
        f"final gc {'refused (orphans over 10 %), then forced' if result.gc_refused else 'ok'}, "
        f"final repair {'ok' if result.final_repair_ok else 'FAILED'}, check --read-data "
        f"{'clean' if result.final_check_ok else 'NOT CLEAN'}",
        f"result: {'PASS' if result.ok else 'FAIL'}",
        *[f"problem: {p}" for p in result.problems[:20]],
    ]
    return "\n".join(lines)


@contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="casckpt-chaos-") as tmp:
        yield Path(tmp)


def run_chaos(minutes: float, seed: int, work: Path | None = None,
              log: Callable[[str], None] = print) -> Result:
    with _workdir(work) as where:
        return Soak(where, minutes, seed, log).run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=FULL_MINUTES,
                        help="soak length; fault intervals scale with it (default 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--work", type=Path, help="keep the store, journals and logs here")
    args = parser.parse_args(argv)
    result = run_chaos(args.minutes, args.seed, args.work)
    print(render(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
