"""Retention rules, declared once: each is one field of :class:`RetentionPolicy`.

A field declares a rule whole: its name, its value's type (the annotation and a
:class:`Kind`), what it keeps (``meaning``), the reason ``retention plan`` shows for a
version it keeps, and the function that finds those versions. Everything else reads
:data:`RULES`: the policy's checks, ``store.retention.set``'s keywords, the options of
``casckpt retention set`` and their help, the catalog's JSON (``runs.retention``), the
one-line description, the planner (:mod:`casckpt.engine.maintenance.retention`) and the table in
docs/usage.md (:func:`markdown_table`). Adding a rule is one field plus its keep function.

A version is kept if ANY rule keeps it (restic ``forget`` semantics); each rule that
keeps it adds a reason. "Newest" means the highest step, except for the time rules,
which order by ``created_at`` (UTC), newest first, ties broken by the higher step.
Pure: no I/O.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from functools import partial
from typing import Any, Protocol

from casckpt.errors import CatalogError, InvalidArgumentError
from casckpt.jsonable import ToDict


class Candidate(Protocol):
    """What a rule reads of a version (:class:`casckpt.Version` is one)."""

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


Hits = Iterable[tuple[str, str]]  # (version id, reason)

# -- durations ------------------------------------------------------------------------------

_UNITS = (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_DIGITS = re.compile(r"[0-9]+")  # str.isdigit takes '³', which int() refuses
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([wdhms])\s*$")

MAX_DURATION_S = 1000 * 365.25 * 86400.0
"""The longest duration taken (a thousand years): longer ones overflow the date arithmetic
of the planner (a datetime minus them) and mean nothing a policy could want."""


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """``"90m"``, ``"36h"``, ``"7d"``, ``"2w"``, ``"45s"`` (or a bare number of seconds) -> seconds.

    Raises:
        InvalidArgumentError: not a positive (or, with ``allow_zero``, zero) duration.
    """
    match = _DURATION.match(text)
    try:
        seconds = float(text) if match is None else float(match[1]) * dict(_UNITS)[match[2]]
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_DURATION_S or (seconds == 0 and not allow_zero):  # NaN fails too
        raise InvalidArgumentError(
            f"{text!r} is not a duration; use a positive number with a unit: 90m, 36h, 7d, 2w"
            + (" (or 0s)" if allow_zero else "") + ", at most 1000 years"
        )
    return seconds


def format_duration(seconds: float) -> str:
    """Seconds in the largest unit up to days that divides them: 604800 -> ``"7d"``, 5400 ->
    ``"90m"``; else exact seconds in the decimal form :func:`parse_duration` reads back
    (1e-09 -> ``"0.000000001s"``, never an exponent)."""
    for unit, size in _UNITS[1:]:
        if seconds >= size and float(seconds) % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{Decimal(repr(float(seconds))):f}s"


# -- kinds of value -------------------------------------------------------------------------


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidArgumentError(
            f"{name} must be a timedelta, seconds or a string like '7d', got {value!r}")
    if not 0 < seconds <= MAX_DURATION_S:  # NaN fails too
        raise InvalidArgumentError(f"{name} must be a positive duration of at most 1000 years, got {value!r}")
    return seconds


def _best(name: str, value: object) -> tuple[str, int, str]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise InvalidArgumentError(
            f"{name} must be (metric, n, 'min' | 'max'), e.g. ('val_loss', 3, 'min'); got {value!r}")
    metric, n, mode = value
    if not isinstance(metric, str) or not metric:
        raise InvalidArgumentError(f"{name} metric must be a non-empty str, got {metric!r}")
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"{name} mode must be 'min' or 'max', got {mode!r}")
    return metric, _count(f"{name} n", n), mode


def _parse_best(flag: str, text: str) -> tuple[str, int, str]:
    """``"val_loss:3:min"`` -> ``("val_loss", 3, "min")`` (the metric may itself hold ':')."""
    metric, _, mode = text.rpartition(":")
    metric, _, count = metric.rpartition(":")
    if not metric or not _DIGITS.fullmatch(count) or mode not in ("min", "max"):
        raise InvalidArgumentError(f"{flag} {text!r}: use METRIC:N:min or METRIC:N:max, e.g. val_loss:3:min")
    return metric, int(count), mode


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Kind:
    """How a rule's value is checked, written on the command line and shown.

    Attributes:
        name: the type's name in the docs.
        check: ``(rule name, value) -> the value as the policy holds it``; raises
            InvalidArgumentError. Also reads the catalog's JSON back.
        cli_type: what the command line takes (``bool``: a ``--x/--no-x`` flag).
        parse: ``(flag, text) -> value`` for a ``str`` option (None: the text as is).
        show: the value as the command line writes it.
    """

    name: str
    check: Callable[[str, object], Any]
    cli_type: type = str
    parse: Callable[[str, str], Any] | None = None
    show: Callable[[Any], str] = str


COUNT = Kind("int > 0", _count, int)
DURATION = Kind("duration (timedelta, seconds or '7d')", _seconds,
                parse=lambda _flag, text: parse_duration(text), show=format_duration)
BEST = Kind("(metric, n, 'min' | 'max')", _best, parse=_parse_best, show=lambda v: "{}:{}:{}".format(*v))
FLAG = Kind("bool", _flag, bool)

# -- what each rule keeps -------------------------------------------------------------------


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _keep_last(versions: Sequence[Candidate], n: int) -> Hits:
    for v in sorted(versions, key=lambda v: v.step, reverse=True)[:n]:
        yield v.id, f"last {n}"


def _keep_every(versions: Sequence[Candidate], k: int) -> Hits:
    first: dict[int, Candidate] = {}
    for v in sorted(versions, key=lambda v: v.step):
        first.setdefault(v.step // k, v)
    for bucket, v in first.items():
        yield v.id, f"every {k} steps (bucket {bucket})"


def _hour(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d %H:00")


def _day(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d")


def _week(moment: datetime) -> str:
    year, week, _ = _utc(moment).isocalendar()
    return f"{year}-W{week:02d}"


def _keep_periods(versions: Sequence[Candidate], n: int, *, name: str,
                  bucket_of: Callable[[datetime], str]) -> Hits:
    """Walking newest to oldest, the newest version of each period, until ``n`` periods have one."""
    seen: set[str] = set()
    for v in sorted(versions, key=lambda v: (_utc(v.created_at), v.step), reverse=True):
        bucket = bucket_of(v.created_at)
        if bucket not in seen:
            if len(seen) == n:
                return
            seen.add(bucket)
            yield v.id, f"{name} {bucket}"


def _keep_within(versions: Sequence[Candidate], seconds: float) -> Hits:
    if not versions:
        return
    since = max(_utc(v.created_at) for v in versions) - timedelta(seconds=seconds)
    for v in versions:
        if _utc(v.created_at) >= since:
            yield v.id, f"within {format_duration(seconds)} of newest"


def _keep_best(versions: Sequence[Candidate], best: tuple[str, int, str]) -> Hits:
    metric, n, mode = best
    sign = 1.0 if mode == "min" else -1.0
    eligible = [v for v in versions if metric in v.metrics]
    for v in sorted(eligible, key=lambda v: (sign * v.metrics[metric], -v.step))[:n]:
        yield v.id, f"best {n} by {metric} ({mode})"


def _keep_tagged(versions: Sequence[Candidate], on: bool) -> Hits:
    return ((v.id, f"tagged: {', '.join(v.tags)}") for v in versions if on and v.tags)


# -- the rules ------------------------------------------------------------------------------


def _rule(kind: Kind, metavar: str, meaning: str, reason: str, keep: Callable[..., Hits],
          default: Any = None) -> Any:
    """A field of :class:`RetentionPolicy` that declares one rule (see :class:`Rule`)."""
    return field(default=default, metadata={"rule": {"kind": kind, "metavar": metavar, "meaning": meaning,
                                                     "reason": reason, "keep": keep}})


@dataclass(frozen=True, slots=True)
class RetentionPolicy(ToDict):
    """Which versions of a run to keep; combinable like restic's ``forget``.

    A version is kept if ANY rule keeps it; each field is one rule (the table in
    docs/usage.md, from :data:`RULES`). ``keep_within`` is held in seconds (a timedelta
    or ``"7d"`` is taken too), counted back from the run's newest version.
    ``keep_best`` is ``(metric, n, "min" | "max")``. Tagged versions are kept unless
    ``keep_tagged`` is False; fork points of runs with versions always are.

    Raises:
        InvalidArgumentError: a value is not positive or of the wrong type.
    """

    keep_last: int | None = _rule(
        COUNT, "N", "Keep the N versions with the highest steps.", "last 5", _keep_last)
    keep_every: int | None = _rule(
        COUNT, "K", "Keep the first version of every K steps (step // K).",
        "every 1000 steps (bucket 3)", _keep_every)
    keep_hourly: int | None = _rule(
        COUNT, "N", "Keep the newest version of each of the last N hours that have one (UTC).",
        "hourly 2026-11-29 13:00", partial(_keep_periods, name="hourly", bucket_of=_hour))
    keep_daily: int | None = _rule(
        COUNT, "N", "Keep the newest version of each of the last N days that have one (UTC).",
        "daily 2026-11-29", partial(_keep_periods, name="daily", bucket_of=_day))
    keep_weekly: int | None = _rule(
        COUNT, "N", "Keep the newest version of each of the last N ISO weeks that have one.",
        "weekly 2026-W48", partial(_keep_periods, name="weekly", bucket_of=_week))
    keep_within: float | None = _rule(
        DURATION, "AGE", "Keep versions made within this long of the run's newest one "
        "(not of now, so a stopped run is not wiped): 90m, 36h, 7d, 2w.", "within 7d of newest", _keep_within)
    keep_best: tuple[str, int, str] | None = _rule(
        BEST, "METRIC:N:min|max", "Keep the N best versions by a metric (lowest for min, highest "
        "for max; ties: the higher step); versions without it are not eligible.",
        "best 3 by val_loss (min)", _keep_best)
    keep_tagged: bool = _rule(
        FLAG, "", "Keep every tagged version (on by default; not a keep rule on its own).",
        "tagged: best, release", _keep_tagged, default=True)

    def __post_init__(self) -> None:
        for rule in RULES:
            value = getattr(self, rule.name)
            if value is not None or rule.default is not None:  # a flag is never None
                object.__setattr__(self, rule.name, rule.kind.check(rule.name, value))


@dataclass(frozen=True, slots=True)
class Rule:
    """One retention rule, as its :class:`RetentionPolicy` field declares it.

    Attributes:
        name: the field, the keyword and (dashed) the CLI option.
        kind: its value's :class:`Kind`.
        metavar: the value's name in the CLI help.
        meaning: what it keeps (the CLI help and the docs table).
        reason: an example of the reason ``retention plan`` shows for a version it keeps.
        keep: ``(versions of one run, value) -> (version id, reason)`` for each version it keeps.
        default: its value when not given (None: the rule is off).
    """

    name: str
    kind: Kind
    metavar: str
    meaning: str
    reason: str
    keep: Callable[[Sequence[Candidate], Any], Hits]
    default: Any

    @property
    def flag(self) -> str:
        """The CLI option: ``--keep-last``."""
        return "--" + self.name.replace("_", "-")

    @property
    def keeps_alone(self) -> bool:
        """Whether the rule keeps versions on its own (``keep_tagged`` alone would delete every
        untagged version, which is never what anyone meant)."""
        return self.kind is not FLAG


RULES: tuple[Rule, ...] = tuple(
    Rule(name=f.name, default=f.default, **f.metadata["rule"])
    for f in fields(RetentionPolicy))
"""Every retention rule, in the order the CLI, the docs and the reasons list them."""

_BY_NAME = {rule.name: rule for rule in RULES}


def make_policy(**rules: Any) -> RetentionPolicy:
    """A policy from rules by name (``keep_last=5, keep_within="7d"``), as a store stores it.

    Raises:
        InvalidArgumentError: an unknown rule, a value out of range or of the wrong type, or
            no rule that keeps versions on its own (``keep_tagged`` alone would delete every
            untagged version).
    """
    unknown = sorted(set(rules) - set(_BY_NAME))
    if unknown:
        raise InvalidArgumentError(
            f"retention has an unknown rule ({', '.join(unknown)}); the rules are {', '.join(_BY_NAME)}")
    policy = RetentionPolicy(**rules)
    if all(getattr(policy, rule.name) is None for rule in RULES if rule.keeps_alone):
        raise InvalidArgumentError(
            "a retention policy needs at least one keep rule ("
            + ", ".join(rule.name for rule in RULES if rule.keeps_alone)
            + "); without one every untagged version would be deleted. To keep everything, "
            "clear the policy instead")
    return policy


def policy_to_json(policy: RetentionPolicy) -> dict[str, Any]:
    """The catalog's JSON form of a policy: the rules that are set, by name."""
    return {k: v for k, v in policy.to_dict().items() if v is not None}


def policy_from_json(data: object, run: str) -> RetentionPolicy:
    """Read a policy back from the catalog.

    Raises:
        CatalogError: the stored policy is malformed or has rules this casckpt does not know
            (ignoring them could delete versions they keep).
    """
    if not isinstance(data, Mapping):
        raise CatalogError(f"retention policy of run {run!r} is not a JSON object: {data!r}")
    unknown = sorted(set(data) - set(_BY_NAME))
    if unknown:
        raise CatalogError(
            f"retention policy of run {run!r} has rules this casckpt does not know ({', '.join(unknown)}); "
            "upgrade casckpt, or set the policy again")
    try:
        return make_policy(**data)
    except InvalidArgumentError as exc:
        raise CatalogError(f"retention policy of run {run!r} is invalid: {exc}") from exc


def describe(policy: RetentionPolicy) -> str:
    """One line naming the rules of a policy, in CLI option form (values quoted as a shell
    needs them: the line pasted after ``casckpt retention set RUN`` sets the same policy)."""
    parts = []
    for rule in RULES:
        value = getattr(policy, rule.name)
        if value != rule.default:
            flag = rule.flag.replace("--", "--no-", 1) if value is False else rule.flag
            parts.append(flag if rule.kind is FLAG else f"{flag} {shlex.quote(rule.kind.show(value))}")
    return " ".join(parts)


def hits(versions: Sequence[Candidate], policy: RetentionPolicy) -> Hits:
    """``(version id, reason)`` for every version a rule of ``policy`` keeps, rule by rule."""
    for rule in RULES:
        value = getattr(policy, rule.name)
        if value is not None:
            yield from rule.keep(versions, value)


def markdown_table() -> str:
    """The rules as the Markdown table in docs/usage.md (a test keeps the two the same)."""
    rows = ["| Rule (keyword, CLI option) | Value | Keeps | Reason shown |", "| --- | --- | --- | --- |"]
    for r in RULES:
        option = f"{r.flag}/{r.flag.replace('--', '--no-', 1)}" if r.kind is FLAG else f"{r.flag} {r.metavar}"
        # the option outside a code span: there an escaped "|" would show its backslash
        cells = (f"`{r.name}`, {option}", r.kind.name, r.meaning, f"`{r.reason}`")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"
