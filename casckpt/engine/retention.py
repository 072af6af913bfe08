"""Retention planning: which versions of a run a policy keeps, and why. Pure: no I/O.

A version is kept if ANY rule keeps it (restic ``forget`` semantics); each rule
that keeps it adds a human-readable reason. "Newest" means the highest step,
except for the time rules, which order by ``created_at`` (UTC), newest first,
ties broken by the higher step.

- ``keep_last N``: the N highest steps. Reason ``"last N"``.
- ``keep_every K``: for each step bucket ``step // K``, the version with the
  smallest step in it. Reason ``"every K steps (bucket B)"``.
- ``keep_hourly / keep_daily / keep_weekly N``: versions fall into buckets by
  UTC hour / UTC day / ISO week of ``created_at``. Walking newest to oldest,
  the newest version of each bucket is kept, until N buckets have been kept.
  Reasons ``"hourly 2026-11-29 13:00"``, ``"daily 2026-11-29"``, ``"weekly 2026-W48"``.
- ``keep_within D`` (seconds): versions created at most D before the run's
  newest version (the highest ``created_at``), not before now, so a stopped
  run is not wiped. Reason ``"within 7d of newest"``.
- ``keep_best (metric, n, mode)``: the n versions with the lowest (``min``) or
  highest (``max``) value of ``metric``, ties broken by the higher step;
  versions without the metric are not eligible. Reason ``"best n by metric (mode)"``.
- ``keep_tagged`` (default True): versions with any tag. Reason ``"tagged: a, b"``.
- The newest durable version is kept while a newer version of the run is not durable (on
  a fast tier, or lost with one). Reason ``"newest durable (...)"``.
- Fork points: versions another run was forked from are always kept while
  that run has visible versions, or has none yet (a fresh fork is about to
  restore its fork point); once all its versions are deleted the fork point
  is released. Reason ``"fork point of run NAME"``.

A run without a policy keeps every version (reason ``"no retention policy"``).
A policy must have at least one keep rule besides ``keep_tagged``: on its own
it would delete every untagged version, which is never what anyone meant.

Call order for GC (see ``casckpt.catalog.retention``): inside one catalog write
transaction, ``load_histories`` -> :func:`plan` per history -> ``soft_delete``
the ``deleted`` versions of each plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from casckpt.catalog.retention import RunHistory
from casckpt.config import MAX_DURATION_S, format_duration, parse_duration
from casckpt.errors import CatalogError, InvalidArgumentError
from casckpt.types import RetentionDecision, RetentionPlan, RetentionPolicy, Version

NO_POLICY = "no retention policy"
NEWEST_DURABLE = "newest durable (newer versions are not drained from a fast tier)"

_COUNT_RULES = ("keep_last", "keep_every", "keep_hourly", "keep_daily", "keep_weekly")
_RULES = (*_COUNT_RULES, "keep_within", "keep_best", "keep_tagged")


class Candidate(Protocol):
    """What the planner reads of a version (:class:`casckpt.Version` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def tags(self) -> tuple[str, ...]: ...


# -- policies -----------------------------------------------------------------


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def _positive_int(name: str, value: object) -> int | None:
    return None if value is None else _positive(name, value)


def _within(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidArgumentError(
            f"keep_within must be a timedelta, seconds or a string like '7d', got {value!r}"
        )
    if not 0 < seconds <= MAX_DURATION_S:  # NaN fails too
        raise InvalidArgumentError(
            f"keep_within must be a positive duration of at most 1000 years, got {value!r}")
    return seconds


def _best(value: object) -> tuple[str, int, str] | None:
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise InvalidArgumentError(
            f"keep_best must be (metric, n, 'min' | 'max'), e.g. ('val_loss', 3, 'min'); got {value!r}"
        )
    metric, n, mode = value
    if not isinstance(metric, str) or not metric:
        raise InvalidArgumentError(f"keep_best metric must be a non-empty str, got {metric!r}")
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"keep_best mode must be 'min' or 'max', got {mode!r}")
    return metric, _positive("keep_best n", n), mode


def make_policy(
    *, keep_last: int | None = None, keep_every: int | None = None, keep_hourly: int | None = None,
    keep_daily: int | None = None, keep_weekly: int | None = None,
    keep_within: timedelta | float | str | None = None,
    keep_best: tuple[str, int, str] | None = None, keep_tagged: bool = True,
) -> RetentionPolicy:
    """Validate keep rules and build a :class:`RetentionPolicy`.

    Raises:
        InvalidArgumentError: a value is not positive / of the right type, or no
            keep rule is given (``keep_tagged`` alone would delete every
            untagged version).
    """
    if not isinstance(keep_tagged, bool):
        raise InvalidArgumentError(f"keep_tagged must be a bool, got {keep_tagged!r}")
    policy = RetentionPolicy(
        keep_last=_positive_int("keep_last", keep_last),
        keep_every=_positive_int("keep_every", keep_every),
        keep_hourly=_positive_int("keep_hourly", keep_hourly),
        keep_daily=_positive_int("keep_daily", keep_daily),
        keep_weekly=_positive_int("keep_weekly", keep_weekly),
        keep_within=_within(keep_within), keep_best=_best(keep_best), keep_tagged=keep_tagged,
    )
    if all(getattr(policy, name) is None for name in _RULES[:-1]):
        raise InvalidArgumentError(
            "a retention policy needs at least one keep rule (keep_last, keep_every, keep_hourly, "
            "keep_daily, keep_weekly, keep_within or keep_best); without one every untagged "
            "version would be deleted. To keep everything, clear the policy instead"
        )
    return policy


def policy_to_json(policy: RetentionPolicy) -> dict[str, Any]:
    """The catalog's JSON form of a policy: the rules that are set, and ``keep_tagged``."""
    return {k: v for k, v in policy.to_dict().items() if v is not None}


def policy_from_json(data: object, run: str) -> RetentionPolicy:
    """Read a policy back from the catalog.

    Raises:
        CatalogError: the stored policy is malformed or has rules this casckpt
            does not know (ignoring them could delete versions they keep).
    """
    if not isinstance(data, Mapping):
        raise CatalogError(f"retention policy of run {run!r} is not a JSON object: {data!r}")
    unknown = sorted(set(data) - set(_RULES))
    if unknown:
        raise CatalogError(
            f"retention policy of run {run!r} has rules this casckpt does not know ({', '.join(unknown)}); "
            "upgrade casckpt, or set the policy again"
        )
    try:
        best = data.get("keep_best")
        return make_policy(**{**data, "keep_best": tuple(best) if isinstance(best, list) else best})
    except InvalidArgumentError as exc:
        raise CatalogError(f"retention policy of run {run!r} is invalid: {exc}") from exc


# -- rules ----------------------------------------------------------------------

Reasons = dict[str, list[str]]


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _hour(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d %H:00")


def _day(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d")


def _week(moment: datetime) -> str:
    year, week, _ = _utc(moment).isocalendar()
    return f"{year}-W{week:02d}"


def _keep_last(versions: Sequence[Candidate], n: int) -> Iterable[tuple[str, str]]:
    for v in sorted(versions, key=lambda v: v.step, reverse=True)[:n]:
        yield v.id, f"last {n}"


def _keep_every(versions: Sequence[Candidate], k: int) -> Iterable[tuple[str, str]]:
    first: dict[int, Candidate] = {}
    for v in sorted(versions, key=lambda v: v.step):
        first.setdefault(v.step // k, v)
    for bucket, v in first.items():
        yield v.id, f"every {k} steps (bucket {bucket})"


def _keep_periods(versions: Sequence[Candidate], n: int, name: str,
                  bucket_of: Callable[[datetime], str]) -> Iterable[tuple[str, str]]:
    seen: set[str] = set()
    for v in sorted(versions, key=lambda v: (_utc(v.created_at), v.step), reverse=True):
        bucket = bucket_of(v.created_at)
        if bucket not in seen:
            if len(seen) == n:
                return
            seen.add(bucket)
            yield v.id, f"{name} {bucket}"


def _keep_within(versions: Sequence[Candidate], seconds: float) -> Iterable[tuple[str, str]]:
    if not versions:
        return
    since = max(_utc(v.created_at) for v in versions) - timedelta(seconds=seconds)
    for v in versions:
        if _utc(v.created_at) >= since:
            yield v.id, f"within {format_duration(seconds)} of newest"


def _keep_best(versions: Sequence[Candidate], best: tuple[str, int, str]) -> Iterable[tuple[str, str]]:
    metric, n, mode = best
    sign = 1.0 if mode == "min" else -1.0
    eligible = [v for v in versions if metric in v.metrics]
    for v in sorted(eligible, key=lambda v: (sign * v.metrics[metric], -v.step))[:n]:
        yield v.id, f"best {n} by {metric} ({mode})"


def _rule_hits(versions: Sequence[Candidate], policy: RetentionPolicy) -> Iterable[tuple[str, str]]:
    if policy.keep_last is not None:
        yield from _keep_last(versions, policy.keep_last)
    if policy.keep_every is not None:
        yield from _keep_every(versions, policy.keep_every)
    for count, name, bucket_of in ((policy.keep_hourly, "hourly", _hour),
                                   (policy.keep_daily, "daily", _day),
                                   (policy.keep_weekly, "weekly", _week)):
        if count is not None:
            yield from _keep_periods(versions, count, name, bucket_of)
    if policy.keep_within is not None:
        yield from _keep_within(versions, policy.keep_within)
    if policy.keep_best is not None:
        yield from _keep_best(versions, policy.keep_best)
    if policy.keep_tagged:
        yield from ((v.id, f"tagged: {', '.join(v.tags)}") for v in versions if v.tags)


# -- planning -------------------------------------------------------------------


def keep_reasons(versions: Sequence[Candidate], policy: RetentionPolicy | None,
                 forks: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Why each version is kept: version id -> reasons, an empty tuple for a version to delete.

    Args:
        versions: the visible versions of ONE run (any order; ids and steps unique).
        policy: the run's policy; None keeps everything.
        forks: version id -> names of the live runs forked from it.

    Deterministic: the same input gives the same output, whatever its order.
    """
    if policy is None:
        return {v.id: (NO_POLICY,) for v in versions}
    reasons: Reasons = {v.id: [] for v in versions}
    for version_id, reason in _rule_hits(versions, policy):
        reasons[version_id].append(reason)
    for version_id, found in reasons.items():
        found.extend(f"fork point of run {child}" for child in sorted(forks.get(version_id, ())))
    guard = _newest_durable(versions)
    if guard is not None:
        reasons[guard].append(NEWEST_DURABLE)
    return {k: tuple(v) for k, v in reasons.items()}


def _newest_durable(versions: Sequence[Candidate]) -> str | None:
    """The newest durable version, when a newer one is not durable yet (still on a fast tier,
    or lost with one): a policy keeping only the newest versions would otherwise leave the run
    nothing that survives the loss of that tier."""
    ordered = sorted(versions, key=lambda v: v.step, reverse=True)
    for v in ordered:
        if getattr(v, "durability", "durable") == "durable":
            return v.id if v is not ordered[0] else None
    return None


def decide(versions: Sequence[Version], policy: RetentionPolicy | None,
           forks: Mapping[str, Sequence[str]]) -> tuple[RetentionDecision, ...]:
    """A :class:`RetentionDecision` per version, newest (highest step) first; see :func:`keep_reasons`."""
    reasons = keep_reasons(versions, policy, forks)
    ordered = sorted(versions, key=lambda v: v.step, reverse=True)
    return tuple(RetentionDecision(v, bool(reasons[v.id]), reasons[v.id]) for v in ordered)


def plan(history: RunHistory) -> RetentionPlan:
    """Apply a run's stored policy to its visible versions (dry: nothing is written).

    Raises:
        CatalogError: the stored policy is malformed (see :func:`policy_from_json`).
    """
    policy = None if history.policy is None else policy_from_json(history.policy, history.run)
    return RetentionPlan(history.run, policy, decide(history.versions, policy, history.forks))
