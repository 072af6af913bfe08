"""The filters of ``Store.log``: time and step bounds, tag, order, and ``NAME OP VALUE``
predicates over metrics and metadata, checked into a :class:`~casckpt.catalog.history.LogFilter`
(the SQL that applies it lives in :mod:`casckpt.catalog.history`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import datetime

from casckpt.catalog.history import LogFilter, Predicate
from casckpt.engine.versions.validate import MAX_STEP
from casckpt.errors import InvalidArgumentError

GRAMMAR = (
    "a predicate is NAME OP VALUE with OP one of < <= > >= == != (e.g. 'loss<2.1', "
    "'metadata.optimizer==adamw'); NAME is a metric name, or metadata.KEY (also meta.KEY, "
    "KEY.SUBKEY for nested metadata) made of letters, digits and _ - : / @ +; VALUE is a "
    "number (compared numerically), true/false, or text (compared as a string; quote it "
    "to keep a number as text); versions without NAME never match"
)
_PREDICATE = re.compile(r"^\s*([^\s<>=!]+)\s*(<=|>=|==|!=|<|>)\s*(.*?)\s*$", re.DOTALL)
_METRIC = re.compile(r"^[A-Za-z0-9_.:/@+\-]+$")
_KEY = re.compile(r"^[A-Za-z0-9_:/@+\-]+$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_META_PREFIXES = ("metadata.", "meta.")


def _value(text: str) -> float | bool | str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    if _NUMBER.match(text) and math.isfinite(float(text)):
        return float(text)
    return text


def parse_predicate(text: object) -> Predicate:
    """Parse ``NAME OP VALUE`` (see :data:`GRAMMAR`).

    Raises:
        InvalidArgumentError: anything else, with the grammar in the message.
    """
    match = _PREDICATE.match(text) if isinstance(text, str) else None
    if match is None or not match.group(3):
        raise InvalidArgumentError(f"cannot read predicate {text!r}: {GRAMMAR}")
    name, op, raw = match.groups()
    value = _value(raw)
    prefix = next((p for p in _META_PREFIXES if name.startswith(p)), None)
    problem = None
    if prefix is not None:
        key, field = tuple(name[len(prefix):].split(".")), "meta"
        if not all(_KEY.match(k) for k in key):
            problem = f"bad metadata key {name[len(prefix):]!r}"
    else:
        key, field = (name,), "metrics"
        if not _METRIC.match(name):
            problem = f"bad name {name!r}"
        elif not isinstance(value, float):
            problem = f"metric {name!r} is a number, so VALUE must be one (metadata is metadata.KEY)"
    if problem is None and isinstance(value, bool) and op not in ("==", "!="):
        problem = "true/false compare only with == or !="
    if problem is not None:
        raise InvalidArgumentError(f"predicate {text!r}: {problem}; {GRAMMAR}")
    return Predicate(field, key, op, value)


def time_bound(value: object, what: str, *, upper: bool) -> float | None:
    """A ``since`` (lower) or ``until`` (upper) bound as epoch seconds, inclusive: a datetime
    (naive: local time) or epoch seconds, as ``Store.log`` takes them.

    Raises:
        InvalidArgumentError: neither.
    """
    if value is None:
        return None
    if isinstance(value, datetime):
        # a naive datetime is local time, as everywhere in Python; a datetime has
        # microseconds only, so a Version's own created_at must still match itself
        return value.timestamp() + (1e-6 if upper else -1e-6)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise InvalidArgumentError(f"{what} must be a datetime or epoch seconds, got {value!r}")


def _step(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return max(-MAX_STEP, min(value, MAX_STEP - 1))  # steps are 64-bit in the catalog
    raise InvalidArgumentError(f"{what} must be an int, got {value!r}")


def make_filter(
    run: str | None, *, limit: int | None, since: object, until: object, min_step: object,
    max_step: object, tag: str | None, where: str | Iterable[str] | None, order: str,
) -> LogFilter:
    """Validate ``Store.log``'s arguments into a :class:`LogFilter`.

    Raises:
        InvalidArgumentError: a bad time, step, order or predicate.
    """
    if order not in ("asc", "desc"):
        raise InvalidArgumentError(f"order must be 'asc' or 'desc', got {order!r}")
    if where is None or isinstance(where, str):
        where = [] if where is None else [where]
    elif not isinstance(where, Iterable):
        raise InvalidArgumentError(f"where must be a str or a list of str: {GRAMMAR}")
    return LogFilter(
        run=run, since=time_bound(since, "since", upper=False), until=time_bound(until, "until", upper=True),
        min_step=_step(min_step, "min_step"), max_step=_step(max_step, "max_step"), tag=tag,
        where=tuple(parse_predicate(p) for p in where), ascending=order == "asc",
        limit=limit,
    )
