"""The ``startup`` workload: what a user waits for before casckpt does anything (issue 17).

Measured in one run, each against a baseline of the same run:

* CLI commands in fresh processes (``python -m casckpt.cli.main``: ``--help``, ``runs``,
  ``log RUN -n 20``, ``log RUN`` (every version), ``show RUN@latest``) on a store whose
  run ``many`` holds ``VERSIONS x scale`` versions (10,000 at scale 1), against
  ``python -c "import sqlalchemy, typer, rich"`` (target: <= 2x);
* ``casckpt.open`` of that existing store, the first in a fresh process once casckpt is
  imported (target: <= 50 ms, seconds);
* a fresh process's ``casckpt.open`` + ``Store.restore`` of a dense fp32 state against a
  fresh process's ``torch.load`` of the same state (the libraries, torch and for casckpt
  SQLAlchemy, imported before the clock; casckpt's own modules load inside it; target:
  <= 1.0x);
* a process's first restore against its second: in a fresh process that opens the
  store and commits a new version of the state first, as a training job would
  (target: <= 1.3x).

The ``many`` run's versions are made fast: one real commit of a tiny state, then its
catalog row copied (SQLite, one transaction) under new ids and steps; ``log``, ``runs`` and
``show`` of the real run ``dense`` read real versions. Each command and each fresh-process
measure runs ``ROUNDS`` times, alternating with its baseline; medians are reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from rich.table import Table

import casckpt

Log = Callable[[str], None]
Kind = Literal["ratio", "fraction", "seconds", "mb_per_s"]

NAME = "startup"
MANY_RUN = "many"
DENSE_RUN = "dense"
VERSIONS = 10_000
MIN_VERSIONS = 200
STATE_BYTES = 1 << 30  # the dense state at scale 1
TENSORS = 16
ROUNDS = 3
REPO_ROOT = Path(__file__).resolve().parent.parent
CLI_TARGET = 2.0
OPEN_TARGET_S = 0.050
FRESH_RESTORE_TARGET = 1.0
FIRST_RESTORE_TARGET = 1.3

BASELINE_CODE = "import sqlalchemy, typer, rich"
COMMANDS = {  # key -> CLI arguments after --store
    "help": ["--help"],
    "runs": ["runs"],
    "log20": ["log", MANY_RUN, "-n", "20"],
    "log_all": ["log", MANY_RUN],
    "show": ["show", f"{DENSE_RUN}@latest"],
}

_OPEN_CODE = """
import sys, time, casckpt, casckpt.opening
started = time.perf_counter()
store = casckpt.open(sys.argv[1], create=False)
first = time.perf_counter() - started
store.close()
again = []
for _ in range(5):
    started = time.perf_counter()
    store = casckpt.open(sys.argv[1], create=False)
    again.append(time.perf_counter() - started)
    store.close()
print(first, sorted(again)[2])
"""

_LOAD_CODE = """
import sys, time, torch
started = time.perf_counter()
state = torch.load(sys.argv[1], weights_only=True)
print(time.perf_counter() - started)
"""

_RESTORE_CODE = """
import sys, time, torch, sqlalchemy, casckpt
started = time.perf_counter()
with casckpt.open(sys.argv[1], create=False) as store:
    state = store.restore(sys.argv[2])
print(time.perf_counter() - started)
"""

_FIRST_SECOND_CODE = """
import sys, time, torch, casckpt
state = torch.load(sys.argv[2], weights_only=True)
with casckpt.open(sys.argv[1], create=False) as store:
    step = store.log(sys.argv[3], limit=1)[0].step + 1
    for t in state.values():
        t.add_(1.0)
    version = store.commit(state, run=sys.argv[3], step=step)
    times = []
    for _ in range(2):
        started = time.perf_counter()
        back = store.restore(version)
        times.append(time.perf_counter() - started)
        del back
print(times[0], times[1])
"""


@dataclass(frozen=True)
class StartupResult:
    """Every raw number of the ``startup`` workload (seconds; each list: every round)."""

    name: str
    versions: int
    state_bytes: int
    baseline_rounds_s: list[float]
    command_rounds_s: dict[str, list[float]]
    baseline_cpu_s: list[float]
    command_cpu_s: dict[str, list[float]]
    open_first_s: list[float]
    open_again_s: list[float]
    load_rounds_s: list[float]
    fresh_restore_rounds_s: list[float]
    first_restore_s: list[float]
    second_restore_s: list[float]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)

    @property
    def baseline_s(self) -> float:
        """Median wall of ``python -c "import sqlalchemy, typer, rich"``."""
        return statistics.median(self.baseline_rounds_s)

    def command_s(self, key: str) -> float:
        """Median wall of one CLI command."""
        return statistics.median(self.command_rounds_s[key])


_PYCACHE: list[Path] = []  # where the children keep compiled modules (set by run_startup)


def _env() -> dict[str, str]:
    """The children's environment: this checkout first on the path, and bytecode cached (under
    the work directory, as an installed package has it) even where PYTHONDONTWRITEBYTECODE
    is set, so no start-up measured here is compiling casckpt's sources."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if _PYCACHE:
        env["PYTHONPYCACHEPREFIX"] = str(_PYCACHE[0])
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wall(argv: Sequence[str], cpu: list[float] | None = None) -> float:
    """Wall seconds of the process ``argv``; its CPU seconds (user + system) appended to ``cpu``."""
    cpu_before, started = _children_cpu_s(), time.perf_counter()
    subprocess.run(argv, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    if cpu is not None:
        cpu.append(_children_cpu_s() - cpu_before)
    return wall


def _output(argv: Sequence[str]) -> list[float]:
    done = subprocess.run(argv, check=True, env=_env(), capture_output=True, text=True)
    return [float(x) for x in done.stdout.split()[-2:] if x]


def _dense_state(scale: float) -> dict[str, torch.Tensor]:
    elements = max(1 << 16, int(STATE_BYTES * scale) // 4 // TENSORS)
    generator = torch.Generator().manual_seed(17)
    return {f"layer{i}.weight": torch.randn(elements, generator=generator) for i in range(TENSORS)}


def _clone_versions(catalog_db: Path, run: str, count: int) -> None:
    """Copy the run's one version row ``count - 1`` times as steps 1.., chained by parent."""
    con = sqlite3.connect(catalog_db)
    try:
        con.row_factory = sqlite3.Row
        row = dict(con.execute(
            "SELECT v.* FROM versions v JOIN runs r ON r.id = v.run_id WHERE r.name = ?", (run,)).fetchone())
        columns = list(row)
        rows, parent = [], row["id"]
        for step in range(1, count):
            vid = hashlib.blake2b(f"{run}@{step}".encode(), digest_size=32).hexdigest()
            clone = {**row, "id": vid, "step": step, "parent_id": parent,
                     "created_at": row["created_at"] + step, "committed_at": row["committed_at"] + step,
                     "metrics": json.dumps({"loss": 1.0 / (step + 1)})}
            rows.append(tuple(clone[c] for c in columns))
            parent = vid
        with con:
            con.executemany(f"INSERT INTO versions ({', '.join(columns)}) "
                            f"VALUES ({', '.join('?' * len(columns))})", rows)
    finally:
        con.close()


def _build(root: Path, state_file: Path, scale: float, versions: int, log: Log) -> int:
    state = _dense_state(scale)
    torch.save(state, state_file)
    with casckpt.open(root) as store:
        store.commit({"x": torch.zeros(4), "step": 0}, run=MANY_RUN, step=0, metrics={"loss": 1.0})
        store.commit(state, run=DENSE_RUN, step=0)
    log(f"{NAME}: copying one version row into {versions} versions of run {MANY_RUN!r}")
    _clone_versions(root / "catalog.db", MANY_RUN, versions)
    return sum(t.numel() * t.element_size() for t in state.values())


def run_startup(scale: float, workdir: Path, log: Log) -> StartupResult:
    """Build the store in ``workdir`` and time start-up, open and cold restores."""
    versions = max(MIN_VERSIONS, int(VERSIONS * min(scale, 1.0)))
    root, state_file = workdir / "store", workdir / "state.pt"
    state_bytes = _build(root, state_file, scale, versions, log)
    python = sys.executable
    cli = [python, "-m", "casckpt.cli.main", "--store", str(root)]
    _PYCACHE[:] = [workdir / "pycache"]
    for args in COMMANDS.values():  # untimed: compiles every module the children import
        _wall([*cli, *args])
    _output([python, "-c", _RESTORE_CODE, str(root), f"{DENSE_RUN}@0"])
    baseline: list[float] = []
    commands: dict[str, list[float]] = {key: [] for key in COMMANDS}
    baseline_cpu: list[float] = []
    commands_cpu: dict[str, list[float]] = {key: [] for key in COMMANDS}
    opens: list[list[float]] = []
    loads: list[float] = []
    restores: list[float] = []
    log(f"{NAME}: {ROUNDS} rounds of CLI commands, open, fresh-process restore vs torch.load")
    for _ in range(ROUNDS):
        baseline.append(_wall([python, "-c", BASELINE_CODE], baseline_cpu))
        for key, args in COMMANDS.items():
            commands[key].append(_wall([*cli, *args], commands_cpu[key]))
        opens.append(_output([python, "-c", _OPEN_CODE, str(root)]))
        loads.append(_output([python, "-c", _LOAD_CODE, str(state_file)])[-1])
        restores.append(_output([python, "-c", _RESTORE_CODE, str(root), f"{DENSE_RUN}@0"])[-1])
    log(f"{NAME}: first vs second restore after a commit, in fresh processes")
    pairs = [_output([python, "-c", _FIRST_SECOND_CODE, str(root), str(state_file), DENSE_RUN])
             for _ in range(ROUNDS)]
    return StartupResult(
        NAME, versions, state_bytes, baseline, commands, baseline_cpu, commands_cpu,
        [o[0] for o in opens], [o[1] for o in opens], loads, restores,
        [p[0] for p in pairs], [p[1] for p in pairs])


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Kind
    compute: Callable[[StartupResult], float | None]


def _cli(key: str) -> Callable[[StartupResult], float | None]:
    return lambda r: r.command_s(key) / r.baseline_s


def _cli_cpu(key: str) -> Callable[[StartupResult], float | None]:
    return lambda r: statistics.median(r.command_cpu_s[key]) / statistics.median(r.baseline_cpu_s)


MEASURES: tuple[Measure, ...] = (
    *(Measure(f"cli_{key}_vs_imports", f"casckpt {' '.join(args)} / python -c '{BASELINE_CODE}'",
              "ratio", _cli(key)) for key, args in COMMANDS.items()),
    *(Measure(f"cli_{key}_cpu_vs_imports", f"CPU time of casckpt {' '.join(args)} / of the imports",
              "ratio", _cli_cpu(key)) for key, args in COMMANDS.items()),
    Measure("open_first_s", "casckpt.open of an existing store, first in a process", "seconds",
            lambda r: statistics.median(r.open_first_s)),
    Measure("open_again_s", "casckpt.open of an existing store, again in the process", "seconds",
            lambda r: statistics.median(r.open_again_s)),
    Measure("fresh_restore_vs_load", "fresh process: open + restore / torch.load", "ratio",
            lambda r: statistics.median(r.fresh_restore_rounds_s) / statistics.median(r.load_rounds_s)),
    Measure("first_vs_second_restore", "after a commit: first restore / second restore", "ratio",
            lambda r: statistics.median(r.first_restore_s) / statistics.median(r.second_restore_s)),
)

TARGETS: dict[str, float] = {
    **{f"cli_{key}_vs_imports": CLI_TARGET for key in COMMANDS},
    "open_first_s": OPEN_TARGET_S,
    "fresh_restore_vs_load": FRESH_RESTORE_TARGET,
    "first_vs_second_restore": FIRST_RESTORE_TARGET,
}

NOTES = {
    "store": "SQLite catalog; run 'many': one tiny real commit, its catalog row copied into "
    "VERSIONS x scale versions (at least 200, 10,000 at scale 1); run 'dense': a dense fp32 "
    "state of 16 tensors (1 GiB x scale)",
    "cli": "python -m casckpt.cli.main --store DIR ARGS, stdout to /dev/null, wall of the whole "
    "process; the baseline is python -c 'import sqlalchemy, typer, rich' in the same rounds; "
    "the CPU measures (user + system seconds of the child, no target) are what a loaded "
    "machine distorts least",
    "open": "in a fresh process after import casckpt, casckpt.opening: the first casckpt.open "
    "(create=False), then the median of 5 more",
    "fresh_restore": "in a fresh process after import torch, sqlalchemy, casckpt (libraries; "
    "casckpt's own modules load on open and restore, inside the clock): open + restore("
    "'dense@0') + close, vs torch.load(weights_only=True) of the same state's file in another "
    "fresh process after import torch; page cache warm for both",
    "bytecode": "children run with PYTHONPYCACHEPREFIX under the work directory (and without "
    "PYTHONDONTWRITEBYTECODE), after one untimed run of each command, as an installed casckpt "
    "runs from compiled modules",
    "first_second": "in a fresh process: open, commit the state + 1 as a new version, then "
    "restore it twice; medians over the rounds",
}


def table(outcomes: Mapping[str, StartupResult | str]) -> Table | None:
    """The startup workload's raw figures (None when it did not run)."""
    results = {n: r for n, r in outcomes.items() if not isinstance(r, str)}
    if not results:
        return None
    out = Table(title="startup raw measurements (medians; fresh processes)")
    for column in ("workload", "measure", "median", "each round"):
        out.add_column(column, justify="left" if column in ("workload", "measure") else "right")
    for name, r in results.items():
        rows = [("python -c 'import sqlalchemy, typer, rich'", r.baseline_rounds_s)]
        rows += [(f"casckpt {' '.join(args)} ({r.versions} versions)", r.command_rounds_s[key])
                 for key, args in COMMANDS.items()]
        rows += [("casckpt.open, first", r.open_first_s), ("casckpt.open, again", r.open_again_s),
                 ("torch.load (fresh process)", r.load_rounds_s),
                 ("open + restore (fresh process)", r.fresh_restore_rounds_s),
                 ("first restore after a commit", r.first_restore_s),
                 ("second restore", r.second_restore_s)]
        for label, rounds in rows:
            out.add_row(name, label, f"{statistics.median(rounds):.3f} s",
                        " ".join(f"{s:.3f}" for s in rounds))
            name = ""
    return out
