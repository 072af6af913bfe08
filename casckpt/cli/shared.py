"""What the command modules of the CLI share: exit codes, option types, opening the store.

The exit codes are documented once, in :data:`EXIT_CODES`; the store is the one ``--store``
(or ``CASCKPT_STORE``) names on the root command, recorded by its callback as
:class:`StoreChoice`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

import casckpt
from casckpt.cli import render
from casckpt.errors import (
    AccessDeniedError,
    AmbiguousRefError,
    CasckptError,
    GCRefusedError,
    GCRunningError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    ReadOnlyStoreWarning,
    RefNotFoundError,
    RestoreTargetError,
    StoreKeyError,
    StoreUnavailableError,
    TensorNotFoundError,
    UnsupportedStateError,
)

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INTEGRITY = 4
EXIT_OTHER = 5
EXIT_BUSY = 6
EXIT_GC_REFUSED = 7
EXIT_DENIED = 8
EXIT_UNAVAILABLE = 9
EXIT_INTERNAL = 70  # EX_SOFTWARE in sysexits.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

_NOT_FOUND = (NotAStoreError, RefNotFoundError, AmbiguousRefError, TensorNotFoundError)
_BAD_INPUT = (InvalidNameError, InvalidArgumentError, UnsupportedStateError, RestoreTargetError)


@dataclass(frozen=True, slots=True)
class ExitCode:
    """One documented exit code: what it means, and the errors that exit with it."""

    code: int
    meaning: str
    errors: tuple[type[CasckptError], ...] = ()


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "ok"),
    ExitCode(EXIT_PROBLEMS, "check found problems, or repair, catalog rebuild, migrate-trees or "
             "drain left some, or mirror run left a version unsent or a tag it could not carry (a tag "
             "changed here onto a version gone at the destination: see the mirror guide)"),
    ExitCode(EXIT_USAGE, "usage error or bad input: a bad option or argument, an invalid name, "
             "unsupported state, a restore target that cannot be written, an unreadable or "
             "invalid casckpt.toml", _BAD_INPUT),
    ExitCode(EXIT_NOT_FOUND, "not found: no store at the path, unknown ref, ambiguous id "
             "prefix, unknown tensor", _NOT_FOUND),
    ExitCode(EXIT_INTEGRITY, "integrity: stored bytes are corrupt or missing, or not the "
             "version asked for (a failed drill too)", (IntegrityError,)),
    ExitCode(EXIT_OTHER, "any other casckpt error: storage (a full disk), catalog (unreachable, "
             "or from a newer casckpt), a catalog and locations of different stores",
             (CasckptError,)),
    ExitCode(EXIT_BUSY, "another casckpt gc is running on this store (try again later)",
             (GCRunningError,)),
    ExitCode(EXIT_GC_REFUSED, "gc refused: the catalog does not prove deletion is safe (see "
             "the message)", (GCRefusedError,)),
    ExitCode(EXIT_DENIED, "denied: the store is read-only (--read-only, or it cannot be "
             "written), the credentials lack a right (the message names it), or an encrypted "
             "store's key is missing or wrong", (AccessDeniedError, StoreKeyError)),
    ExitCode(EXIT_UNAVAILABLE, "storage unavailable: too few locations could be reached within the "
             "storage retry budget (CASCKPT_STORAGE_RETRY_S); nothing was found missing, try again "
             "once it is back", (StoreUnavailableError,)),
    ExitCode(EXIT_INTERNAL, "internal error: a bug in casckpt; the traceback is printed, please "
             "report it"),
    ExitCode(EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
    ExitCode(EXIT_BROKEN_PIPE, "stdout was closed early (e.g. piped into `head`)"),
)
"""Every exit code of the CLI: ``casckpt --help`` and docs/guides/troubleshooting.md are made
from this table (tests/cli/test_cli.py compares the guide), so they cannot drift from the code."""

# the order errors are matched in: the first whose classes match wins, the catch-all last
_PRECEDENCE = (EXIT_INTEGRITY, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_BUSY, EXIT_GC_REFUSED, EXIT_DENIED,
               EXIT_UNAVAILABLE, EXIT_OTHER)


def exit_code_for(error: CasckptError) -> int:
    """The documented exit code for ``error`` (see :data:`EXIT_CODES`)."""
    by_code = {entry.code: entry for entry in EXIT_CODES}
    return next(code for code in _PRECEDENCE if isinstance(error, by_code[code].errors))


def exit_codes_help() -> str:
    """The exit code table as one paragraph, for ``casckpt --help``."""
    return "Exit codes: " + "; ".join(f"{e.code} {e.meaning}" for e in EXIT_CODES) + "."


def exit_codes_markdown() -> str:
    """The exit code table in Markdown, with the errors of each code (the troubleshooting guide's)."""
    lines = ["| exit | meaning | errors |", "| --- | --- | --- |"]
    for e in EXIT_CODES:
        names = ", ".join(f"`{cls.__name__}`" for cls in e.errors)
        lines.append(f"| {e.code} | {e.meaning} | {names} |")
    return "\n".join(lines)


FLAG = ""
"""The metavar of a flag: it takes no value, so help shows no type (typer would show <bool>)."""

StoreOption = Annotated[Path | None, typer.Option(
    "--store", "-s", metavar="DIR", envvar="CASCKPT_STORE", show_envvar=True,
    help="Store directory.", file_okay=False)]
JsonOption = Annotated[
    bool, typer.Option("--json", metavar=FLAG, help="Print machine-readable JSON on stdout, nothing else.")
]
RefArgument = Annotated[
    str, typer.Argument(help="A version: run@step, run@latest, run@~N, tag:NAME or an id prefix.")
]
FastTierOption = Annotated[Path | None, typer.Option(
    "--fast-tier", metavar="DIR", envvar="CASCKPT_FAST_TIER", show_envvar=True, file_okay=False,
    help="This host's fast tier directory, instead of the one casckpt.toml records (see "
         "docs/guides/fast-tier.md): `drain` drains it, `tier status` reports it.")]
KeyFileOption = Annotated[Path | None, typer.Option(
    "--key-file", metavar="FILE", envvar="CASCKPT_KEY_FILE", show_envvar=True, dir_okay=False,
    help="Master key file of an encrypted store (`casckpt key generate FILE`).")]


@dataclass(frozen=True, slots=True)
class StoreChoice:
    """What the root command was told: the store every command opens, and its key."""

    store: Path | None
    key_file: Path | None = None
    read_only: bool = False
    fast_tier: Path | None = None


def store_path(ctx: typer.Context) -> Path:
    """The store the command line names.

    Raises:
        typer.BadParameter: neither ``--store`` nor ``CASCKPT_STORE`` gave one.
    """
    options: StoreChoice = ctx.find_root().obj
    if options.store is None:
        raise typer.BadParameter(
            "no store given: pass --store PATH (before the command) or set CASCKPT_STORE",
            param_hint="--store",
        )
    return options.store


def read_only_asked(ctx: typer.Context) -> bool:
    """Whether the command line says ``casckpt --read-only``."""
    options: StoreChoice = ctx.find_root().obj
    return options.read_only


def open_path(ctx: typer.Context, path: Path, *, drain: bool = False, **kwargs: Any) -> casckpt.Store:
    """``casckpt.open(path, **kwargs)``, read-only under ``--read-only``, with the root's
    ``--fast-tier``; a store opened read-only because it cannot be written says so once on
    stderr (the :class:`~casckpt.errors.ReadOnlyStoreWarning`), as a line, not a Python warning.

    ``drain``: whether the store drains its fast tier in the background and at close (for
    commands that commit); otherwise a command leaves the tier to ``casckpt drain`` and the
    processes that commit, so that looking at a store never uploads as a side effect.
    """
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ReadOnlyStoreWarning)
        kwargs.setdefault("key_file", ctx.find_root().obj.key_file)
        kwargs.setdefault("fast_tier", ctx.find_root().obj.fast_tier)
        kwargs.setdefault("options", casckpt.Options(background_drain=drain))
        opened = casckpt.open(path, read_only=True if read_only_asked(ctx) else None, **kwargs)
    for warning in seen:
        if issubclass(warning.category, ReadOnlyStoreWarning):
            render.note(f"casckpt: warning: {warning.message}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return opened


@contextmanager
def open_store(ctx: typer.Context, *, recover: bool = False,
               drain: bool = False) -> Iterator[casckpt.Store]:
    """Open the existing store the command line names (see :func:`store_path` and
    :func:`open_path`); close it after."""
    with open_path(ctx, store_path(ctx), create=False, recover=recover, drain=drain) as store:
        yield store
