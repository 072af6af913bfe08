"""casckpt's log records as lines on stderr while a command runs.

The library logs through ``logging.getLogger("casckpt.…")`` and installs no
handler: the application decides. The command line is that application.
While a command runs, a warning prints as one line ``casckpt: warning: …``,
each distinct message once per command (a location that cannot be opened is
noticed by every part of a command that touches it, which would otherwise
repeat the same line many times); ``gc`` also prints its one INFO summary
(``casckpt: gc deleted …``). Records still propagate, so handlers a host
application or pytest installed see them as before.

Without this, Python's last-resort handler printed warnings bare (no
``casckpt:`` prefix, every repeat), and not at all once any root handler
existed, so what an operator saw depended on the environment.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from rich.text import Text

from casckpt.cli import render

_LOGGER = "casckpt"


class _StderrLines(logging.Handler):
    """One line per record on the current ``sys.stderr`` (resolved at each record, so a
    test runner swapping streams between commands gets each command's own lines)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "store_created", None) is not None:
            return  # only `casckpt init` creates a store, and it says so on stdout itself
        try:
            message = record.getMessage()
            if record.levelno >= logging.WARNING:
                if message in self._seen:
                    return
                self._seen.add(message)
                line = Text(f"casckpt: warning: {message}", style="yellow")
            else:
                line = Text(f"casckpt: {message}")
            render.stderr_console().print(line, soft_wrap=True)
        except Exception:
            self.handleError(record)


@contextmanager
def command_logging() -> Iterator[None]:
    """Print casckpt's warnings on stderr for the duration of one command; undo it after."""
    logger = logging.getLogger(_LOGGER)
    handler = _StderrLines()
    level = logger.level
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def show_info() -> None:
    """Also print INFO records for the rest of this command (gc's one-line summary)."""
    logger = logging.getLogger(_LOGGER)
    logger.setLevel(logging.INFO)
    for handler in logger.handlers:
        if isinstance(handler, _StderrLines):
            handler.setLevel(logging.INFO)
