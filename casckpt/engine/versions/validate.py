"""Checks on commit arguments, done before anything is written."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from casckpt.errors import InvalidArgumentError, InvalidNameError
from casckpt.format.state import MAX_DEPTH, too_deep

MAX_STEP = 1 << 63
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: object, what: str) -> str:
    """Validate a run or tag name: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric.

    Such names can never form a path (no '/', no '..' component), so no name
    can escape a directory wherever it is used.
    """
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidNameError(
            f"invalid {what} name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')"
        )
    return name


def check_step(step: object) -> int:
    """Validate a step: a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise InvalidArgumentError(
            f"step must be a non-negative int below 2**63 (the catalog stores 64-bit steps), "
            f"got {step!r}"
        )
    return int(step)


MAX_LIMIT = (1 << 63) - 1
"""The largest ``limit`` a query takes: SQL LIMIT is a signed 64-bit int in every catalog."""


def check_limit(limit: object, what: str = "limit", *, minimum: int = 0) -> int | None:
    """Validate a query's ``limit``: None (no limit) or an int from ``minimum`` to 2**63 - 1.

    Raises:
        InvalidArgumentError: a bool, a non-int, or an int out of that range.
    """
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not minimum <= limit <= MAX_LIMIT:
        raise InvalidArgumentError(
            f"{what} must be an int from {minimum} to 2**63 - 1 (or None: no limit), got {limit!r}")
    return int(limit)


def check_timeout(timeout: object, what: str, *, maximum: float) -> float:
    """Validate a timeout: a real number of seconds from 0 to ``maximum``.

    Raises:
        InvalidArgumentError: a bool, a non-number, NaN, or a number out of that range.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= maximum:
        raise InvalidArgumentError(f"{what} must be from 0 to {maximum:g} seconds, got {timeout!r}")
    return float(timeout)


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate metadata: a JSON-serialisable dict with str keys, at most ``MAX_DEPTH`` deep."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError("metadata must be a dict with str keys")
    deep = too_deep(metadata)
    if deep is not None:
        raise InvalidArgumentError(
            f"metadata nests deeper than {MAX_DEPTH} dicts and lists at {deep!r} (the limit "
            "states have); flatten it, or store that part as a JSON string"
        )
    try:
        text = json.dumps(dict(metadata), allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
        out: dict[str, Any] = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"metadata must be JSON-serialisable (str, finite numbers, bool, None, lists, dicts): {exc}"
        ) from exc
    return out


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """Validate metrics: str keys, finite real numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError("metrics must be a dict of name -> number")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"metric name {key!r} must be a non-empty str")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgumentError(
                f"metric {key!r} must be a number that fits a float, got {value!r}"
            ) from None
        if isinstance(value, bool) or not math.isfinite(number):
            raise InvalidArgumentError(
                f"metric {key!r} is {value!r}; metrics must be finite numbers "
                "(record a diverged value in metadata instead)"
            )
        out[key] = number
    return out


def check_message(message: object) -> str | None:
    """Validate a commit message: None or a UTF-8 encodable str."""
    if message is None:
        return None
    if not isinstance(message, str):
        raise InvalidArgumentError(f"message must be a str, got {type(message).__name__}")
    try:
        message.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"message is not valid text: {exc}") from None
    return message


def check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """Validate tag names."""
    if isinstance(tags, str):
        tags = (tags,)
    return tuple(check_name(t, "tag") for t in tags)
