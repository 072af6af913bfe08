"""What every public value type of casckpt has: ``to_dict``, a plain JSON form (the CLI's ``--json``)."""

from __future__ import annotations

import dataclasses
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
