"""What every public value type of casckpt has: ``to_dict``, a plain JSON form (the CLI's ``--json``)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: datetimes as ISO 8601, dataclasses and mappings as dicts."""
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class ToDict:
    """Base of the public value types (frozen, slotted dataclasses): adds :meth:`to_dict`."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict of this value."""
        result: dict[str, Any] = jsonable(self)
        return result


def to_json_value(value: object) -> Any:
    """Make ``value`` strict JSON: bytes become base64, NaN/±inf the strings "NaN"/"Infinity"."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    return value


def dumps(value: object, *, indent: int | None = None) -> str:
    """Serialise ``value`` (after :func:`to_json_value`) as strict JSON."""
    return json.dumps(to_json_value(value), indent=indent, allow_nan=False, ensure_ascii=False)
