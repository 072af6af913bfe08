"""Issue 13 in CI: the fuzz campaign of ``benchmarks/fuzz.py``, a few hundred cases at a fixed seed.

Every parser and reader (packs, shards, manifests, refs records, catalog rows, objects of real
stores) gets hostile inputs derived from valid ones; every case runs in a worker process under
a timeout. The campaign must find no hang, no exception other than a CasckptError, no crash
and no wrong data -- except in the classes ``benchmarks/fuzzing/known.py`` lists as being
fixed by their owners now. Each of those has a test below marked ``xfail(strict=True)`` that
replays cases reproducing it: when the fix merges the test passes, which fails the suite until
the entry is removed from the list (and the class joins the campaign like every other).

The full campaign (10,000 cases, counts per target): ``python benchmarks/fuzz.py``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the harness lives with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.fuzzing.harness import BUGS, Campaign, Case, Result  # noqa: E402
from benchmarks.fuzzing.known import KNOWN_OPEN  # noqa: E402
from benchmarks.fuzzing.seeds import build_seeds  # noqa: E402
from benchmarks.fuzzing.targets import FORMAT_TARGETS, STORE_TARGETS, load_targets  # noqa: E402

SEED = 1
PER_FORMAT_KIND = 12  # a few milliseconds each
PER_STORE_KIND = 1  # a store copied, opened, restored, checked: ~0.3 s each
PER_CONFIG_KIND = 6  # most config mutations are refused (every backend table is checked): some must pass
FIFO_TIMEOUT = 3.0  # a FIFO blocks its reader forever: no need to wait the full timeout


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Result]]:
    """Every case of the CI campaign and of the known-open reproducers, run once."""
    seeds = tmp_path_factory.mktemp("fuzz") / "seeds"
    build_seeds(seeds, SEED)
    targets = load_targets(seeds)
    cases = [Case(name, i, kind)
             for name in (*FORMAT_TARGETS, *STORE_TARGETS) for kind in targets[name].kinds
             if f"{name}/{kind}" not in KNOWN_OPEN
             for i in range(PER_FORMAT_KIND if name in FORMAT_TARGETS
                            else PER_CONFIG_KIND if name == "config" else PER_STORE_KIND)]
    known = [Case(key.split("/")[0], i, key.split("/")[1], FIFO_TIMEOUT if key.endswith("/fifo") else None)
             for key, entry in KNOWN_OPEN.items() for i in entry.cases]
    got = Campaign(seeds, SEED, timeout=30.0, heap_bytes=1 << 30).run(cases + known)
    replays = {(c.target, c.index, c.kind) for c in known}
    by_class: dict[str, list[Result]] = {"campaign": []}
    for r in got:
        key = f"{r.target}/{r.kind}" if (r.target, r.index, r.kind) in replays else "campaign"
        by_class.setdefault(key, []).append(r)
    return by_class


def _describe(bugs: list[Result]) -> str:
    return "\n".join(f"{r.target}:{r.index} ({r.kind}) {r.outcome}: {r.error[:200]} at {r.where}; "
                     f"mutation: {r.mutation[:200]}" for r in bugs)


def test_campaign_finds_no_bug(results: dict[str, list[Result]]) -> None:
    campaign = results["campaign"]
    bugs = [r for r in campaign if r.outcome in BUGS]
    assert not bugs, f"{len(bugs)} of {len(campaign)} cases found bugs:\n{_describe(bugs)}"


def test_campaign_reaches_both_verdicts(results: dict[str, list[Result]]) -> None:
    # a harness whose mutations were all trivially refused (or all no-ops) would prove nothing
    counts: dict[str, Counter[str]] = {}
    for r in results["campaign"]:
        counts.setdefault(r.target, Counter())[r.outcome] += 1
    fuzzed = {key.split("/")[0] for key in {f"{r.target}/{r.kind}" for r in results["campaign"]}}
    assert set(counts) == fuzzed and set(FORMAT_TARGETS) <= fuzzed
    for target in FORMAT_TARGETS:
        assert counts[target]["accepted"] and counts[target]["rejected"], (target, counts[target])
    for target in set(STORE_TARGETS) & set(counts):
        assert counts[target]["accepted"], (target, counts[target])


def test_every_known_open_reproducer_ran(results: dict[str, list[Result]]) -> None:
    # so that each xfail below fails for its bug, not for a missing result
    for key, entry in KNOWN_OPEN.items():
        assert sorted(r.index for r in results.get(key, [])) == sorted(entry.cases), key


@pytest.mark.parametrize("key", [pytest.param(key, marks=pytest.mark.xfail(
    strict=True, reason=f"known open, {entry.owner}: {entry.what}")) for key, entry in KNOWN_OPEN.items()])
def test_known_open_class_is_fixed(results: dict[str, list[Result]], key: str) -> None:
    replayed = results[key]
    bugs = [r for r in replayed if r.outcome in BUGS]
    assert not bugs, _describe(bugs)
