"""Progress bars for long commands, driven by the API's ``progress=callback`` hook.

Bars go to stderr and only when stderr is a terminal, so pipes, logs and
``--json`` consumers never see them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from casckpt.cli.render import human_bytes
from casckpt.types import ProgressCallback

_BYTE_PHASES = frozenset({"hash", "write", "read", "scan", "drain", "copy"})
"""Phases whose ``done``/``total`` count bytes (see :data:`casckpt.types.ProgressCallback`)."""


def _amount(phase: str, done: int, total: int) -> str:
    if phase == "wait":  # a read waiting for unreachable storage, of its retry budget
        return f"waiting for storage: {done} s of {total} s"
    if phase in _BYTE_PHASES:
        return f"{human_bytes(done)} / {human_bytes(total)}" if total else human_bytes(done)
    return f"{done} / {total}"


@contextmanager
def progress_bars(console: Console | None = None) -> Iterator[ProgressCallback | None]:
    """Yield a progress callback drawing one bar per phase, or None when stderr is no terminal.

    Args:
        console: where to draw; defaults to stderr, and then only if it is a terminal.
    """
    if console is None:
        if not sys.stderr.isatty():
            yield None
            return
        console = Console(stderr=True)
    columns = (TextColumn("{task.description:<8}"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[amount]}"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        tasks: dict[str, TaskID] = {}

        def update(phase: str, done: int, total: int) -> None:
            amount = _amount(phase, done, total)
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total or None, amount=amount)
            progress.update(tasks[phase], completed=done, total=total or None, amount=amount)

        yield update
