"""Command-line values converted without pydantic.

typer (0.2x) converts each parameter of the command it runs through a pydantic
``TypeAdapter``, built on first use: importing pydantic and building the adapters
cost a catalog command about as much CPU as opening the store and querying it
(docs/perf/startup2.md). The parameters casckpt's commands declare (``str``, ``int``,
``float``, ``bool``, ``Path``, ``list[str]``) are
converted here instead, as typer's adapters convert them: paths checked by typer's
own ``coerce_cli_path`` (the parameter's path options), numbers with a
usage error naming the value (and the bound it misses). A parameter with anything
more (a custom parser, clamping, another type) keeps typer's conversion, and a typer without adapters is
left as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer import BadParameter

Convert = Callable[[Any, Any, Any], Any]  # (value, param, ctx) -> the converted value

try:  # typer's conversion layer (typer 0.2x); older releases convert with click types only
    from typer._coercion import RuntimeParam
    from typer._param_types import coerce_cli_path
except ImportError:  # pragma: no cover - depends on the installed typer
    RuntimeParam = None  # type: ignore[assignment,misc]


def _text(value: Any, param: Any, ctx: Any) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else str(value)


def _number(kind: type[int] | type[float], name: str, info: Any) -> Convert:
    low, high = info.min, info.max

    def convert(value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, kind) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = kind(value)
            except (TypeError, ValueError):
                raise BadParameter(f"{value!r} is not a valid {name}.", ctx=ctx, param=param) from None
        if low is not None and number < low:
            raise BadParameter(f"{value} is below the least value allowed, {low}.", ctx=ctx, param=param)
        if high is not None and number > high:
            raise BadParameter(f"{value} is above the greatest value allowed, {high}.", ctx=ctx, param=param)
        return number
    return convert


_TRUE = {"1", "on", "t", "true", "y", "yes"}  # what typer's adapter accepts, case-insensitively
_FALSE = {"", "0", "off", "f", "false", "n", "no"}


def _flag(value: Any, param: Any, ctx: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value, param, ctx).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise BadParameter(f"{value!r} is not a valid boolean.", ctx=ctx, param=param)


def _texts(value: Any, param: Any, ctx: Any) -> list[str]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_text(item, param, ctx) for item in items]


def _path(info: Any) -> Convert:
    def convert(value: Any, param: Any, ctx: Any) -> Path:
        if isinstance(value, Path):
            checked: Any = value
        else:  # typer's checks on the text (its str -> Path step is a pydantic adapter)
            checked = coerce_cli_path(value, info, path_type=str, param=param, ctx=ctx)
        return Path(os.fsdecode(checked))
    return convert


def _converter(annotation: Any, info: Any) -> Convert | None:
    """How a value of ``annotation`` is converted here; None: typer converts it."""
    if info.parser is not None or info.clamp:
        return None
    if annotation is str:
        return _text
    if annotation is bool:
        return _flag
    if annotation is int:
        return _number(int, "integer", info)
    if annotation is float:
        return _number(float, "number", info)
    if annotation == list[str]:
        return _texts
    if annotation is Path and info.path_type is None:
        return _path(info)
    return None


if RuntimeParam is not None:

    @dataclass(frozen=True)
    class _Converted(RuntimeParam):
        convert: Convert

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            return self.convert(value, param, ctx)


def convert_here(command: Any) -> None:
    """Give the parameters of ``command`` and of every command under it the conversion of
    this module (see :func:`convert_param`; idempotent; call before parsing)."""
    for param in command.params:
        convert_param(param)
    for sub in getattr(command, "commands", {}).values():
        convert_here(sub)


def convert_param(param: Any) -> None:
    """Convert the values of typer parameter ``param`` here where its type is one this module
    converts (one typer has already set a conversion for, or not typer's, is left as it is)."""
    descriptor = getattr(param, "type_descriptor", None)
    if RuntimeParam is None or descriptor is None or getattr(param, "_runtime_param", True) is not None:
        return
    convert = _converter(descriptor.annotation, descriptor.parameter_info)
    if convert is not None:
        param._runtime_param = _Converted(descriptor.parameter_info, descriptor.annotation, convert)


def converted_here(param: Any) -> bool:
    """Whether this module converts the values of ``param``."""
    return RuntimeParam is not None and isinstance(getattr(param, "_runtime_param", None), _Converted)
