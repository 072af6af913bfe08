"""casckpt fuzz campaign: hostile inputs to every parser and reader (issue 13).

Targets (each seeded from valid inputs casckpt itself produced, see
``benchmarks/fuzzing/``): ``pack``, ``shard``, ``manifest`` (the byte formats),
``config`` (casckpt.toml), ``records`` (refs records, read by a catalog
rebuild), ``catalog`` (catalog rows changed through SQL), ``objects`` and
``ec-objects`` (pack, manifest and shard objects of real stores on disk).
Every case runs in a worker process under a per-case timeout and is counted
as accepted (and verified correct), rejected (a CasckptError), or a bug: an
error (any other exception), a hang, a crash, or wrong data.

Usage::

    python benchmarks/fuzz.py [--cases 10000] [--seed 1] [--targets pack,manifest,...]
                              [--kinds catalog:versions.step-swap,...] [--timeout 30] [--jobs 1]
                              [--out FILE] [--dir TMPDIR]
    python benchmarks/fuzz.py --replay catalog:17 [--seed 1]    # one case, in this process

Prints a table of outcomes per target and the bugs found (grouped by cause,
each with a case to replay), and writes every count and bug as JSON. Exits 1
when a bug outside the known-open list was found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # fuzz the casckpt of this checkout
    sys.path.insert(0, str(REPO_ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.fuzzing.harness import (  # noqa: E402
    BUGS,
    OUTCOMES,
    Campaign,
    Case,
    Result,
    plan_cases,
    run_case,
)
from benchmarks.fuzzing.known import known_open  # noqa: E402
from benchmarks.fuzzing.targets import TARGETS  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "fuzz.json"


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown target(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {','.join(TARGETS)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases in all, split over the targets")
    parser.add_argument("--seed", type=int, default=1, help="campaign seed (every case derives from it)")
    parser.add_argument("--targets", type=_names, default=list(TARGETS), help="comma-separated subset")
    parser.add_argument("--kinds", default="", help="force mutation kinds: target:kind,... (directed run)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take (a hang)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--dir", type=Path, default=None, help="where seeds and scratch stores go")
    parser.add_argument("--replay", default="", help="run one case target:index[:kind] in this process")
    return parser.parse_args(argv)


def summarize(results: list[Result]) -> dict[str, Any]:
    """Counts per target and outcome, and the bugs grouped by cause (known-open ones marked)."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    slowest: dict[str, float] = defaultdict(float)
    groups: dict[tuple[str, str, str], list[Result]] = defaultdict(list)
    for r in results:
        counts[r.target][r.outcome] += 1
        slowest[r.target] = max(slowest[r.target], r.seconds)
        if r.outcome in BUGS:
            groups[(r.target, r.kind, r.signature)].append(r)
    bugs = []
    for (target, kind, signature), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        first = min(rs, key=lambda r: r.index)
        bugs.append({
            "target": target, "kind": kind, "signature": signature, "cases": len(rs),
            "known_open": known_open(target, kind), "replay": f"{target}:{first.index}",
            "mutation": first.mutation, "error": first.error, "where": first.where, "trace": first.trace,
            "indices": sorted(r.index for r in rs)[:50],
        })
    return {
        "counts": {t: {o: c[o] for o in OUTCOMES} | {"cases": sum(c.values()), "max_s": round(slowest[t], 3)}
                   for t, c in counts.items()},
        "bugs": bugs,
    }


def print_report(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="fuzz campaign: outcomes per target")
    for col in ("target", "cases", *OUTCOMES, "known-open bugs", "slowest case"):
        table.add_column(col, justify="left" if col == "target" else "right")
    totals: Counter[str] = Counter()
    known = Counter(b["target"] for b in summary["bugs"] for _ in range(b["cases"]) if b["known_open"])
    for target, c in summary["counts"].items():
        totals.update({k: v for k, v in c.items() if k != "max_s"})
        table.add_row(target, str(c["cases"]), *(str(c[o]) for o in OUTCOMES), str(known[target]),
                      f"{c['max_s']:.2f} s")
    table.add_row("all", str(totals["cases"]), *(str(totals[o]) for o in OUTCOMES),
                  str(sum(known.values())), "", style="bold")
    console.print(table)
    for bug in summary["bugs"]:
        tag = f"[known open: {bug['known_open']}]" if bug["known_open"] else "[NEW]"
        console.print(f"{tag} {bug['cases']} x {bug['target']}/{bug['kind']}: {bug['signature']}",
                      markup=False, highlight=False)
        console.print(f"    replay {bug['replay']}: {bug['mutation'][:200]}", markup=False, highlight=False)
        console.print(f"    {bug['error'][:300]}", markup=False, highlight=False)


def _replay(args: argparse.Namespace, seeds: Path, console: Console) -> int:
    import logging

    from benchmarks.fuzzing.targets import load_targets

    target, index, *kind = args.replay.split(":")
    logging.basicConfig(level=logging.WARNING)
    result = run_case(load_targets(seeds), args.seed, Case(target, int(index), kind[0] if kind else None))
    console.print(json.dumps(result.to_dict(), indent=2), markup=False, highlight=False)
    return 1 if result.outcome in BUGS else 0


def _directed(kinds: str) -> dict[str, list[str]]:
    forced: dict[str, list[str]] = defaultdict(list)
    for item in filter(None, (k.strip() for k in kinds.split(","))):
        target, kind = item.split(":", 1)
        forced[target].append(kind)
    return forced


def main(argv: list[str] | None = None) -> int:
    from benchmarks.fuzzing.seeds import build_seeds

    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    base = Path(tempfile.mkdtemp(prefix=".casckpt-fuzz-", dir=args.dir))
    os.environ["XDG_CACHE_HOME"] = str(base / "cache")  # stores' per-host caches go with the scratch
    started = datetime.now(timezone.utc)
    try:
        build_seeds(base / "seeds", args.seed)
        if args.replay:
            return _replay(args, base / "seeds", console)
        forced = _directed(args.kinds)
        cases = plan_cases(forced or args.targets, args.cases)
        if forced:  # directed: cycle through the forced kinds of each target
            cases = [Case(c.target, c.index, forced[c.target][c.index % len(forced[c.target])])
                     for c in cases]
        done = [0]
        clock = time.monotonic()

        def progress(result: Result) -> None:
            done[0] += 1
            if result.outcome in BUGS or done[0] % 500 == 0:
                console.log(f"{done[0]}/{len(cases)} ({time.monotonic() - clock:.0f} s); {result.target}:"
                            f"{result.index} {result.kind} -> {result.outcome} {result.error[:80]}",
                            markup=False, highlight=False)

        campaign = Campaign(base / "seeds", args.seed, timeout=args.timeout, jobs=args.jobs,
                            on_result=progress)
        results = campaign.run(cases)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = summarize(results)
    print_report(console, summary)
    header = {"schema": 1, "started_at": started.isoformat(), "seed": args.seed, "cases": len(results),
              "timeout_s": args.timeout, "duration_s": (datetime.now(timezone.utc) - started).total_seconds()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(header | summary, indent=1, default=str))
    console.print(f"results written to {args.out}")
    return 1 if any(not b["known_open"] for b in summary["bugs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
