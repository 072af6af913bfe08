"""Master keys of an encrypted store: ``key generate``, ``key list``, ``key add``,
``key remove``, ``key rotate`` (see docs/SECURITY.md).

An encrypted store opens with one of its master keys: ``casckpt --key-file FILE ...``
or ``CASCKPT_KEY_FILE``. Adding, removing or rotating a key rewrites the store's key
record only (every version stays readable; no data is rewritten).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

import casckpt
from casckpt.cli import render
from casckpt.cli.shared import JsonOption, open_store
from casckpt.types import KeyInfo

key_app = typer.Typer(
    help="Master keys of an encrypted store (open it with --key-file FILE or CASCKPT_KEY_FILE).",
    no_args_is_help=True,
)

FileArgument = Annotated[Path, typer.Argument(help="A key file (`casckpt key generate FILE` makes one).")]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _print_key(info: KeyInfo, as_json: bool, what: str) -> None:
    render.emit(as_json, info.to_dict(), f"{what} key {info.id}")


@key_app.command("generate")
def generate(path: FileArgument, as_json: JsonOption = False) -> None:
    """Write a new random master key to FILE (mode 0600; never overwrites a file).

    Keep it safe and backed up: a store whose every key is lost cannot be read by anyone.
    """
    kid = casckpt.generate_key_file(path)
    render.emit(as_json, {"id": kid, "path": str(path)},
                f"Wrote master key {kid} to {path} (mode 0600): keep it safe, keep a copy")


@key_app.command("list")
def list_keys(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """List the store's master keys: public ids, when and by whom each was added."""
    with open_store(ctx) as store:
        found = store.keys.list()
    table = Table(title="Master keys")
    for column in ("id", "added", "by", "in use"):
        table.add_column(column)
    for k in found:
        table.add_row(k.id, _when(k.created_at), k.created_by, "yes" if k.in_use else "")
    render.emit(as_json, [k.to_dict() for k in found], table)


@key_app.command("add")
def add(ctx: typer.Context, path: FileArgument, as_json: JsonOption = False) -> None:
    """Let the key in FILE open the store too (the store is opened with --key-file)."""
    with open_store(ctx) as store:
        info = store.keys.add(path)
    _print_key(info, as_json, "Added")


@key_app.command("remove")
def remove(ctx: typer.Context,
           key_id: Annotated[str, typer.Argument(help="The key's id (`casckpt key list`).")]) -> None:
    """Remove a master key: it no longer opens the store (the last key is never removed)."""
    with open_store(ctx) as store:
        store.keys.remove(key_id)
    render.out(f"Removed key {key_id}")


@key_app.command("rotate")
def rotate(ctx: typer.Context, path: FileArgument,
           old: Annotated[str | None, typer.Option(
               help="The id of the key to replace (default: the --key-file the store was opened with).")
           ] = None,
           as_json: JsonOption = False) -> None:
    """Replace a master key by the key in FILE, in one change (no data is rewritten)."""
    with open_store(ctx) as store:
        info = store.keys.rotate(path, old)
    _print_key(info, as_json, "Rotated in")


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command."""
    app.add_typer(key_app, name="key")
