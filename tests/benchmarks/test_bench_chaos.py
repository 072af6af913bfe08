"""The chaos soak of benchmarks/chaos.py in its CI-tier length (2 minutes).

Faults drawn from every kind the soak knows are injected while writers, a
reader and cron-style gc run on an ec:4+2 store over PostgreSQL and S3; the run
must end with nothing acknowledged lost, nothing restored wrong, nothing visible
that was never acknowledged (but the step of a writer killed mid-commit), no
untyped error, no hang, and a clean repair and ``check --read-data``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the soak lives with the benchmarks
    sys.path.insert(0, str(REPO_ROOT))

pytest.importorskip("pgserver")
pytest.importorskip("moto.server")

from benchmarks.chaos import KINDS, render, run_chaos  # noqa: E402


@pytest.mark.slow
def test_chaos_soak_two_minutes_loses_nothing(tmp_path: Path) -> None:
    result = run_chaos(2.0, seed=35, work=tmp_path / "chaos", log=lambda line: None)
    print("\n" + render(result))  # the counts, in the test log (-s or -rA shows them)
    assert result.problems == []
    assert result.lost == 0 and result.wrong == 0 and result.wrong_reads == 0
    assert result.unacknowledged_visible == 0
    assert result.untyped_errors == 0 and result.hangs == 0
    assert result.final_repair_ok and result.final_check_ok
    assert result.acknowledged > 0 and result.restored_exactly > 0 and result.reads > 0
    # on 2 busy cores a 2-minute run fits 8-20 faults (a lost location's repair takes tens of
    # seconds): the kinds are drawn from a shuffled deck, so every run meets a different mix
    assert sum(t.injected for t in result.faults.values()) >= 5
    assert all(t.survived == t.injected for t in result.faults.values())
    assert set(result.faults) == set(KINDS)
