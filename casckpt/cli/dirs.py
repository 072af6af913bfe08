"""``casckpt add DIR`` and ``casckpt checkout REF DIR``: directory snapshots, byte-identical.

``add`` stores a directory (a ``checkpoint-N/`` folder, a folder of ``.pt`` files) as a
version; ``checkout`` writes it back into a new or empty directory, every file verified
(see ``Store.add_dir`` and ``Store.checkout``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import JsonOption, RefArgument, open_store
from casckpt.errors import InvalidArgumentError

_DIR_KEY = "casckpt.dir"  # the metadata summary add_dir records (casckpt.format.dirsnap.DIR_KEY)


def parse_metrics(values: list[str] | None) -> dict[str, float]:
    """``["loss=0.5"]`` -> ``{"loss": 0.5}``.

    Raises:
        InvalidArgumentError: an item is not NAME=NUMBER.
    """
    out: dict[str, float] = {}
    for item in values or ():
        name, sep, text = item.partition("=")
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not sep or not name or not math.isfinite(value):
            raise InvalidArgumentError(f"--metric {item!r}: use NAME=NUMBER, e.g. --metric loss=0.25")
        out[name] = value
    return out


def add(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="The directory to store.",
                                              file_okay=False)],
    run: Annotated[str, typer.Option("--run", help="Run to add the version to.")],
    step: Annotated[int, typer.Option("--step", help="Step of the version.")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="A message for the version.")] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="Tag the version (repeatable).")] = None,
    metric: Annotated[list[str] | None, typer.Option(
        "--metric", metavar="NAME=NUMBER", help="Record a metric (repeatable).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Store a directory as version RUN@STEP, byte-identical: names, modes, bytes, links.

    Unchanged tensors inside changed safetensors and torch.save files, and unchanged stretches
    of any other file, are not stored again. `casckpt checkout` writes it back.
    """
    metrics = parse_metrics(metric)
    with open_store(ctx, drain=True) as store, progress_bars() as progress:
        version = store.add_dir(directory, run=run, step=step, metrics=metrics, message=message,
                                tags=tuple(tag or ()), progress=progress)
    counts: dict[str, Any] = version.metadata.get(_DIR_KEY, {})
    render.emit(
        as_json, version.to_dict(),
        f"Added {directory} as {version.short_id} ({version.run}@{version.step}): "
        f"{counts.get('files', 0)} file(s), {counts.get('dirs', 0)} dir(s), {counts.get('links', 0)} "
        f"link(s), {render.human_bytes(version.logical_bytes)}; "
        f"{render.human_bytes(version.new_bytes)} new, {render.human_bytes(version.stored_bytes)} stored"
    )


def checkout(
    ctx: typer.Context,
    ref: RefArgument,
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A new or empty directory to write to.",
                                              file_okay=False)],
    as_json: JsonOption = False,
) -> None:
    """Write a directory snapshot (stored by `casckpt add`) into DIR, which must be new or empty.

    Every file is checked against the BLAKE3 recorded when it was added; on any failure DIR is
    left as it was.
    """
    with open_store(ctx) as store:
        version = store.resolve(ref)
        with progress_bars() as progress:
            written = store.checkout(version, directory, progress=progress)
    counts: dict[str, Any] = version.metadata.get(_DIR_KEY, {})
    render.emit(
        as_json, {"version": version.to_dict(), "path": str(written), **counts},
        f"Checked out {version.short_id} ({version.run}@{version.step}) into {written}: "
        f"{counts.get('files', 0)} file(s), {render.human_bytes(int(counts.get('bytes', 0)))}, verified"
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command."""
    app.command()(add)
    app.command()(checkout)
