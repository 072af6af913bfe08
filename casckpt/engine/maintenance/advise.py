"""The checkpoint-interval advisor: Young's and Daly's optimum from what a run measured.

Inputs: C, the checkpoint cost (the median training-visible stall of the run's recent commits,
``versions.stall_s``); R, the time to get going again after a failure (a restore, measured by
drills or on demand, plus the restart time the caller gives); M, the mean time between
failures (given). With failures arriving as a Poisson process (exponentially distributed
times between them) and C, R constant:

- Young (1974, "A first order approximation to the optimum checkpoint interval", CACM
  17(9)): tau = sqrt(2 C M).
- Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 22(3)): tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C for
  C < 2M, else tau = M. This is the interval advised.

At an interval tau (compute time between checkpoints), to first order, a fraction C / tau of
the wall time goes to checkpoints, and each failure (one per M seconds) loses on average
tau / 2 of work since the last checkpoint plus R: the expected overhead is
C / tau + (tau / 2 + R) / M, the expected lost work per failure tau / 2 + R. Both are
computed at the run's current interval (the median time between its commits) and at the
advised one. Everything here is pure arithmetic on values (no I/O).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from datetime import timedelta

from casckpt.catalog.drills import Commit
from casckpt.errors import InvalidArgumentError
from casckpt.retention_rules import parse_duration
from casckpt.types import Advice

HISTORY = 20
"""Recent commits (with a recorded stall) and drill results the advisor takes medians over."""


def young(cost: float, mtbf: float) -> float:
    """Young's first-order optimum interval: sqrt(2 C M) (as sqrt(2C) sqrt(M): no overflow)."""
    return math.sqrt(2 * cost) * math.sqrt(mtbf)


def daly(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval (M when C >= 2M: checkpointing cannot pay)."""
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return young(cost, mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


def overhead(interval: float, cost: float, restore: float, mtbf: float) -> float:
    """Fraction of wall time lost to checkpoints and failures, first order: C/tau + (tau/2 + R)/M."""
    return cost / interval + (interval / 2 + restore) / mtbf


def lost_work(interval: float, restore: float) -> float:
    """Expected seconds lost per failure: half an interval of work, plus the restore."""
    return interval / 2 + restore


MTBF_RANGE_S = (1.0, 100 * 365 * 86400.0)
"""The mean times between failures advised on: one second to a century. Outside it the advice
is a number of steps no job takes (10**154 steps for a 1e308 s MTBF, one step for 1e-300 s)."""

RESTART_RANGE_S = (0.0, MTBF_RANGE_S[1])
"""The restart times accepted: none, up to a century."""


def _as_seconds(value: object) -> float | None:
    """``value`` as seconds, or None where it is no duration at all (a bool, None, ``"soon"``).

    Text is a duration (``"8h"``, ``"45s"``) or a bare number of seconds, in any notation
    float() reads (``"1e308"``, ``"inf"``), so the CLI's text and the API's number meet one
    range check with one message.
    """
    if isinstance(value, str):
        try:
            return parse_duration(value, allow_zero=True)
        except InvalidArgumentError:
            pass
        try:
            return float(value)
        except ValueError:
            return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond any float: as out of range as inf
        return math.inf


def seconds(value: float | int | timedelta | str, what: str, *, allowed: tuple[float, float]) -> float:
    """A duration as seconds within ``allowed`` (inclusive): a number, a timedelta, or text such
    as ``"8h"``, ``"5m"``. The one validation of ``store.ops.advise`` and ``casckpt advise``: the same
    value refused the same way whichever way it came.

    Raises:
        InvalidArgumentError: not a duration, or one outside ``allowed`` (nan included).
    """
    number = _as_seconds(value)
    low, high = allowed
    if number is None:
        raise InvalidArgumentError(
            f"{what} {value!r} is not a duration; give seconds, a timedelta, or a number with a "
            "unit (45s, 90m, 8h, 7d)")
    if not low <= number <= high:  # also false for nan
        raise InvalidArgumentError(
            f"{what} {number:g} s is out of range: give a duration from {low:g} s to "
            f"{high / (365 * 86400):g} years (45s, 90m, 8h, 7d)")
    return number


def check_history(run: str, commits: Sequence[Commit]) -> None:
    """Refuse a history too short to advise on.

    Raises:
        InvalidArgumentError: fewer than two commits with a recorded stall.
    """
    if len(commits) < 2:
        raise InvalidArgumentError(
            f"run {run!r} has {len(commits)} commit(s) with a recorded stall; the advisor needs "
            "at least 2 to measure the checkpoint cost and interval. Versions committed before "
            "casckpt recorded stalls (schema 0011) have none: commit a few more, then ask again")


def advise(run: str, commits: Sequence[Commit], *, restore_s: float, restore_source: str,
           restart_s: float, mtbf_s: float) -> Advice:
    """The advice for ``run`` from its recent ``commits`` (oldest first, each with a stall).

    Raises:
        InvalidArgumentError: see :func:`check_history`; or commits that measure no interval
            or no cost (the message says what to do).
    """
    check_history(run, commits)
    cost = statistics.median(c.stall_s for c in commits)
    pairs = list(itertools.pairwise(commits))
    interval = statistics.median(b.created_at - a.created_at for a, b in pairs)
    interval_steps = statistics.median(b.step - a.step for a, b in pairs)
    span = commits[-1].created_at - commits[0].created_at
    if cost <= 0 or interval <= 0 or span <= 0:
        raise InvalidArgumentError(
            f"run {run!r}'s recent commits measure no checkpoint cost or interval (stall "
            f"{cost:g} s, interval {interval:g} s); commit a few more at your usual interval")
    rate = (commits[-1].step - commits[0].step) / span
    restore = restore_s + restart_s
    tau = daly(cost, mtbf_s)
    overheads = {"current": overhead(interval, cost, restore, mtbf_s),
                 "advised": overhead(tau, cost, restore, mtbf_s)}
    lost = {"current": lost_work(interval, restore), "advised": lost_work(tau, restore)}
    if not all(math.isfinite(x) for x in (tau, young(cost, mtbf_s), tau * rate, *overheads.values(),
                                          *lost.values())):
        raise InvalidArgumentError(
            f"mtbf {mtbf_s:g} s (restart {restart_s:g} s) is out of range for run {run!r}'s "
            f"checkpoint cost {cost:g} s: the advice overflows; give the job's real mean time "
            "between failures and restart time (e.g. 8h, 5m)")
    return Advice(
        run=run, checkpoint_cost_s=cost, restore_s=restore_s, restore_source=restore_source,
        restart_s=restart_s, mtbf_s=mtbf_s, advised_interval_s=tau,
        young_interval_s=young(cost, mtbf_s), advised_interval_steps=max(1, round(tau * rate)),
        current_interval_s=interval, current_interval_steps=float(interval_steps), step_rate=rate,
        expected_overhead=overheads,
        expected_lost_work_s=lost,
        commits=len(commits))
