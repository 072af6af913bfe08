"""Runs fuzz cases in worker processes under a watchdog and classifies each one.

A case is ``(target, index)``, optionally with the mutation ``kind`` forced;
everything random in it comes from ``random.Random(f"{seed}/{target}/{index}")``
so any case can be replayed alone (``benchmarks/fuzz.py --replay target:index``).

Workers are fresh interpreters (``spawn``: no torch thread state inherited
across ``fork``) with a cap on their heap. The parent hands them one case at
a time and waits at most ``timeout`` seconds for each: a case that overruns
is a hang, its worker is killed and replaced, and the campaign goes on; a
worker that dies mid-case (a segfault, the kernel's OOM killer) is a crash.

Outcomes: ``accepted`` (the parser returned and what it returned was checked
correct), ``rejected`` (a CasckptError), and the bugs: ``error`` (any other
exception), ``hang``, ``crash`` and ``wrong`` (data returned that is not what
was stored, or not what was asked for).
"""

from __future__ import annotations

import multiprocessing
import random
import resource
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

OUTCOMES = ("accepted", "rejected", "error", "hang", "crash", "wrong")
BUGS = ("error", "hang", "crash", "wrong")
STARTUP_S = 180.0  # a fresh worker imports torch and loads the seeds before its first case


class WrongData(Exception):
    """Raised by a target when a parser accepted input and returned something it must not."""


class Target(Protocol):
    """A parser or reader under fuzz, with the valid inputs it starts from."""

    name: str
    kinds: tuple[str, ...]  # the mutation classes it draws from (equally, unless ``weights`` says)

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        """Mutate a seed (calling ``note`` with a description of the mutation before
        parsing), parse or read it, and verify what came back (raising WrongData)."""


@dataclass(frozen=True, slots=True)
class Case:
    target: str
    index: int
    kind: str | None = None  # None: drawn from the case's random stream
    timeout: float | None = None  # None: the campaign's


@dataclass(slots=True)
class Result:
    target: str
    index: int
    kind: str = ""
    outcome: str = ""
    mutation: str = ""
    error: str = ""  # exception type and message, for bugs and rejections
    where: str = ""  # the innermost casckpt frame of an exception
    trace: str = ""  # the traceback's tail, bugs only
    seconds: float = 0.0

    @property
    def signature(self) -> str:
        """What groups bugs of one cause together in the report."""
        head = self.error.split(":", 1)[0] if self.outcome != "wrong" else self.error[:80]
        return f"{self.outcome}: {head} at {self.where}" if self.where else f"{self.outcome}: {head}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def case_rng(seed: int, target: str, index: int) -> random.Random:
    """The random stream of one case (deterministic across runs and machines)."""
    return random.Random(f"{seed}/{target}/{index}")


def _innermost_frame(exc: BaseException) -> str:
    """The innermost frame of casckpt or of this harness (``harness: ...``: a bug of the harness)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/casckpt/" in f.filename or "/benchmarks/fuzzing/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    if "/benchmarks/fuzzing/" in f.filename:
        return f"harness: {f.filename.rsplit('/', 1)[1]}:{f.lineno} {f.name}"
    return f"casckpt/{f.filename.rsplit('/casckpt/', 1)[1]}:{f.lineno} {f.name}"


def run_case(targets: Mapping[str, Target], seed: int, case: Case,
             note: Callable[[str], None] = lambda _: None,
             begin: Callable[[str], None] = lambda _: None) -> Result:
    """Run one case in this process and classify it (``begin`` hears its mutation kind first)."""
    from casckpt.errors import CasckptError

    rng = case_rng(seed, case.target, case.index)
    target = targets[case.target]
    weights: dict[str, float] = getattr(target, "weights", {})
    drawn = rng.choices(target.kinds, [weights.get(k, 1.0) for k in target.kinds])[0]
    kind = case.kind or drawn  # drawn either way: a forced case i is case i of a random run of that kind
    result = Result(case.target, case.index, kind)
    begin(kind)

    def noted(text: str) -> None:
        result.mutation = text
        note(text)

    started = time.perf_counter()
    try:
        target.run(rng, kind, noted)
        result.outcome = "accepted"
    except WrongData as exc:
        result.outcome, result.error = "wrong", str(exc)
    except CasckptError as exc:
        result.outcome, result.error = "rejected", f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception as exc:  # the bug class the campaign exists to find
        result.outcome, result.error = "error", f"{type(exc).__name__}: {str(exc)[:300]}"
        result.where = _innermost_frame(exc)
        result.trace = "".join(traceback.format_exception(exc)[-6:])[-3000:]
    result.seconds = time.perf_counter() - started
    return result


def _limit_memory(heap_bytes: int) -> None:
    """Cap the worker's heap, so a forged length makes an allocation fail instead of
    exhausting the machine (file mappings such as LMDB's are not counted)."""
    if heap_bytes > 0:
        resource.setrlimit(resource.RLIMIT_DATA, (heap_bytes, heap_bytes))


def worker_main(conn: Connection, seeds_dir: str, seed: int, heap_bytes: int) -> None:
    """A worker process: load the targets, then run cases as they arrive until told to stop."""
    import logging

    import torch

    from benchmarks.fuzzing.targets import load_targets

    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)  # casckpt logs skipped records and the like: noise here
    targets = load_targets(Path(seeds_dir))
    _limit_memory(heap_bytes)
    while True:
        message = conn.recv()
        if message is None:
            return
        case = Case(*message[:3])
        result = run_case(targets, seed, case, lambda text: conn.send(("note", text)),
                          lambda kind: conn.send(("begin", kind)))
        conn.send(("end", result.to_dict()))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    case: Case | None = None
    deadline: float = 0.0
    mutation: str = ""
    kind: str = ""


@dataclass
class Campaign:
    """Runs cases on ``jobs`` workers; ``on_result`` sees each result as it lands."""

    seeds_dir: Path
    seed: int
    timeout: float = 30.0
    jobs: int = 1
    heap_bytes: int = 2 << 30
    on_result: Callable[[Result], None] = lambda _: None
    results: list[Result] = field(default_factory=list)
    _standby: _Worker | None = None  # started ahead, so a hang or crash costs no start-up

    def _replacement(self) -> _Worker:
        worker, self._standby = self._standby or self._start(), self._start()
        return worker

    def _start(self) -> _Worker:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=worker_main, args=(child, str(self.seeds_dir), self.seed,
                                                        self.heap_bytes), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    def _assign(self, worker: _Worker, pending: deque[Case]) -> None:
        worker.case, worker.mutation, worker.kind = None, "", ""
        if pending:
            worker.case = pending.popleft()
            worker.deadline = time.monotonic() + STARTUP_S + self.timeout
            try:
                worker.conn.send((worker.case.target, worker.case.index, worker.case.kind))
            except OSError:  # it died starting up: the loop sees its pipe closed, a crash
                pass

    def _finish(self, worker: _Worker, result: Result) -> None:
        self.results.append(result)
        self.on_result(result)

    def _lost(self, worker: _Worker, outcome: str, why: str) -> _Worker:
        """Record the worker's case as a hang or crash, and replace the worker."""
        case = worker.case
        assert case is not None
        worker.process.kill()
        worker.process.join()
        self._finish(worker, Result(case.target, case.index, worker.kind or (case.kind or ""), outcome,
                                    worker.mutation, why, seconds=case.timeout or self.timeout))
        return self._replacement()

    def run(self, cases: Iterable[Case]) -> list[Result]:
        """Run every case; returns the results (also kept in ``results``)."""
        pending = deque(cases)
        workers = [self._start() for _ in range(max(1, min(self.jobs, len(pending))))]
        for worker in workers:
            self._assign(worker, pending)
        try:
            while any(w.case is not None for w in workers):
                busy = [w for w in workers if w.case is not None]
                now = time.monotonic()
                ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - now))
                for i, worker in enumerate(workers):
                    if worker.case is None:
                        continue
                    if worker.conn in ready:
                        workers[i] = self._receive(worker, pending)
                    elif time.monotonic() > worker.deadline:
                        limit = worker.case.timeout or self.timeout
                        workers[i] = self._lost(worker, "hang", f"no result within {limit:.0f} s")
                        self._assign(workers[i], pending)
        finally:
            for worker in workers + ([self._standby] if self._standby else []):
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
                worker.process.join(timeout=10)
                if worker.process.is_alive():
                    worker.process.kill()
        return self.results

    def _receive(self, worker: _Worker, pending: deque[Case]) -> _Worker:
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "begin":
                    assert worker.case is not None
                    worker.deadline = time.monotonic() + (worker.case.timeout or self.timeout)
                    worker.kind = message[1]
                elif message[0] == "note":
                    worker.mutation = message[1]
                elif message[0] == "end":
                    self._finish(worker, Result(**message[1]))
                    self._assign(worker, pending)
                    return worker
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            code = worker.process.exitcode
            replacement = self._lost(worker, "crash", f"worker died (exit code {code}; -11 is a segfault)")
            self._assign(replacement, pending)
            return replacement
        return worker


def plan_cases(targets: Iterable[str], total: int, weights: Mapping[str, float] | None = None) -> list[Case]:
    """``total`` cases split over ``targets`` (by ``weights``, default equal), interleaved so a
    partial run covers every target."""
    names = list(targets)
    weight = {n: (weights or {}).get(n, 1.0) for n in names}
    scale = total / sum(weight.values())
    counts = {n: int(weight[n] * scale) for n in names}
    for n in names[: total - sum(counts.values())]:
        counts[n] += 1
    cases: list[Case] = []
    for i in range(max(counts.values(), default=0)):
        cases.extend(Case(n, i) for n in names if i < counts[n])
    return cases
