"""The ``casckpt`` command line: inspect a store, tag versions, export, check.

Every command but ``init`` opens an existing store, named by ``--store PATH``
or the ``CASCKPT_STORE`` environment variable. Commands that list or show
take ``--json``: stdout then holds one JSON document and nothing else (bytes
as base64, NaN/±inf as the strings "NaN"/"Infinity"/"-Infinity").

Exit codes (scripts may rely on them) are listed once, in
:data:`casckpt.cli.shared.EXIT_CODES`: ``casckpt --help`` prints them and
docs/guides/troubleshooting.md tables them.
"""

from __future__ import annotations

import gc
import os
import re
import shlex
import sys
import traceback
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import casckpt
from casckpt.cli import dirs as dirs_cli
from casckpt.cli import drill as drill_cli
from casckpt.cli import gc as gc_cli
from casckpt.cli import grants, logs, render
from casckpt.cli import history as history_cli
from casckpt.cli import keys as keys_cli
from casckpt.cli import mirror as mirror_cli
from casckpt.cli import report as report_cli
from casckpt.cli import retention as retention_cli
from casckpt.cli import storage as storage_cli
from casckpt.cli import tier as tier_cli
from casckpt.cli import transfer as transfer_cli
from casckpt.cli.progress import progress_bars

# the exit codes the module docstring documents, importable from here as they always were
from casckpt.cli.shared import EXIT_BROKEN_PIPE as EXIT_BROKEN_PIPE
from casckpt.cli.shared import EXIT_BUSY as EXIT_BUSY
from casckpt.cli.shared import EXIT_DENIED as EXIT_DENIED
from casckpt.cli.shared import EXIT_GC_REFUSED as EXIT_GC_REFUSED
from casckpt.cli.shared import EXIT_INTEGRITY as EXIT_INTEGRITY
from casckpt.cli.shared import EXIT_INTERNAL as EXIT_INTERNAL
from casckpt.cli.shared import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from casckpt.cli.shared import EXIT_NOT_FOUND as EXIT_NOT_FOUND
from casckpt.cli.shared import EXIT_OK as EXIT_OK
from casckpt.cli.shared import EXIT_OTHER as EXIT_OTHER
from casckpt.cli.shared import EXIT_PROBLEMS as EXIT_PROBLEMS
from casckpt.cli.shared import EXIT_USAGE as EXIT_USAGE
from casckpt.cli.shared import (
    FLAG,
    FastTierOption,
    JsonOption,
    KeyFileOption,
    RefArgument,
    StoreChoice,
    StoreOption,
    exit_code_for,
    exit_codes_help,
    open_path,
    open_store,
    read_only_asked,
    store_path,
)
from casckpt.config import BlobLocation
from casckpt.errors import (
    CasckptError,
    InvalidArgumentError,
    NotAStoreError,
    NotEncryptedError,
    ReadOnlyStoreError,
)

_DOMAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A failure domain given as ``--location DOMAIN=URL``."""

_EPILOG = exit_codes_help()

_CLI_EXCEPTIONS: tuple[type[Exception], ...] = (
    typer.Exit, typer.Abort,
    # newer typer vendors click, older typer uses click itself: either way the base of its
    # usage errors is ClickException, reached through the public BadParameter
    next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"),
)
_UsageError: type[Any] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_STORE_OPTIONS = ("--store", "-s")


def _store_goes_first(root: Any, failed: Any, after: list[str]) -> str:
    """What to say when ``--store`` came after the command: it is an option of ``casckpt``
    itself, so it goes before the command. ``root`` is the context of ``casckpt``, ``failed``
    that of the (sub)command that refused the option, ``after`` the words after the command's
    name; the command line is given rearranged."""
    command = failed
    while command is not None and command.parent is not root:
        command = command.parent
    words, store = [*([command.info_name] if command is not None else []), *after], "PATH"
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in _STORE_OPTIONS:
            store = value if eq else (words[i + 1] if i + 1 < len(words) else store)
            del words[i:i + (1 if eq else 2)]
            break
    fixed = shlex.join(["casckpt", "--store", store, *words])
    return (f"--store goes before the command, since it names the store for every command: "
            f"{fixed} (or set CASCKPT_STORE)")


def _help_flag(option: Any) -> Any:
    """``--help`` is a flag: like every flag of casckpt's, it shows no type label."""
    if option is not None:
        option.metavar = FLAG
    return option


def _quiet_help(command: Any, ctx: Any) -> None:
    """Give the ``--help`` of ``command`` and of every command under it no type label."""
    _help_flag(command.get_help_option(ctx))
    for sub in getattr(command, "commands", {}).values():
        _quiet_help(sub, ctx)


class _CasckptGroup(TyperGroup):
    """Turns every :class:`CasckptError` into one red line on stderr and its exit code, and
    anything else into a code of its own: never 1, which scripts read as "check found problems".
    While a command runs, casckpt's warnings print on stderr (:mod:`casckpt.cli.logs`)."""

    def get_help_option(self, ctx: Any) -> Any:
        return _help_flag(super().get_help_option(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _quiet_help(command, ctx)
        return command

    def invoke(self, ctx: Any) -> Any:
        after = list(ctx.args)  # the command consumes them
        try:
            with logs.command_logging():
                return super().invoke(ctx)
        except _CLI_EXCEPTIONS as exc:
            if ctx.parent is None and getattr(exc, "option_name", None) in _STORE_OPTIONS:
                failed = getattr(exc, "ctx", None)
                raise _UsageError(_store_goes_first(ctx, failed, after), ctx=failed) from None
            raise  # typer's own exits and usage errors carry their codes
        except CasckptError as exc:
            render.error(str(exc))
            raise typer.Exit(exit_code_for(exc)) from None
        except KeyboardInterrupt:
            render.error("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            # the reader of stdout is gone: nothing to say, and nothing more may be flushed there
            with suppress(OSError, ValueError):  # a stdout without a file (CliRunner) has nothing to flush
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            render.error(
                f"internal error: {type(exc).__name__}: {exc}. This is a bug in casckpt: please "
                f"report it with the traceback above (exit code {EXIT_INTERNAL})"
            )
            raise typer.Exit(EXIT_INTERNAL) from None


app = typer.Typer(cls=_CasckptGroup, help="Content-addressed, incremental checkpoint store for PyTorch.",
                  epilog=_EPILOG, no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)


def _print_version(asked: bool) -> None:
    if asked:
        render.out(f"casckpt {casckpt.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context, store: StoreOption = None, key_file: KeyFileOption = None,
    fast_tier: FastTierOption = None,
    version: Annotated[bool, typer.Option(
        "--version", metavar=FLAG, callback=_print_version, is_eager=True,
        help="Print casckpt's version and exit.")] = False,
    read_only: Annotated[bool, typer.Option(
        "--read-only", metavar=FLAG,
        help="Open the store read-only: nothing in it is written; commands that write fail "
             f"(exit {EXIT_DENIED}). Automatic, with a warning, when the store cannot be written.")] = False,
) -> None:
    ctx.obj = StoreChoice(store=store, key_file=key_file, read_only=read_only, fast_tier=fast_tier)


@app.command()
def init(
    ctx: typer.Context,
    path: Annotated[
        Path | None,
        typer.Argument(help="Where to create the store (default: --store / CASCKPT_STORE)."),
    ] = None,
    blobs: Annotated[str | None, typer.Option(
        help="Where packs live: a directory or s3://bucket/prefix (default: PATH itself).")] = None,
    catalog: Annotated[str | None, typer.Option(
        help="Catalog SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db "
             "(default: SQLite in PATH).")] = None,
    s3_endpoint: Annotated[str | None, typer.Option(
        help="S3-compatible endpoint URL (recorded in casckpt.toml).")] = None,
    s3_region: Annotated[str | None, typer.Option(help="S3 region.")] = None,
    sse: Annotated[str | None, typer.Option(
        help="Server-side encryption for S3 objects: AES256 or aws:kms.")] = None,
    kms_key_id: Annotated[str | None, typer.Option(help="KMS key id for --sse aws:kms.")] = None,
    location: Annotated[list[str] | None, typer.Option(
        "--location", metavar="[DOMAIN=]URL",
        help="A blob location (repeat for several; instead of --blobs): a directory, "
             "file:///dir or s3://bucket/prefix, optionally prefixed DOMAIN= to name its "
             "failure domain; locations sharing a domain fail together (default domain: "
             "its own). Named loc0, loc1, ... in order.")] = None,
    redundancy: Annotated[str | None, typer.Option(
        help="Redundancy of new packs: none, replicate:N or ec:K+M (needs K+M failure "
             "domains) (default: none).")] = None,
    encrypt: Annotated[bool, typer.Option(
        "--encrypt", metavar=FLAG,
        help="Create the store encrypted (every object sealed, chunk ids keyed; see "
             "docs/SECURITY.md): requires a key file. A key file given any way (--key-file, "
             "CASCKPT_KEY_FILE) makes a new store encrypted.")] = False,
    key_file: Annotated[Path | None, typer.Option(
        "--key-file", metavar="FILE", dir_okay=False,
        help="The master key file (--encrypt); default: casckpt --key-file / CASCKPT_KEY_FILE. "
             "`casckpt key generate FILE` makes one.")] = None,
    print_grants: Annotated[str | None, typer.Option(
        "--print-grants", metavar="reader|writer|admin",
        help="Create nothing: print the PostgreSQL GRANT statements and the S3 IAM policy of "
             "this role for the store at PATH (or the --blobs/--location given; placeholders "
             "otherwise). See docs/guides/roles.md.")] = None,
    role_name: Annotated[str | None, typer.Option(
        help="The PostgreSQL role --print-grants grants to (default: casckpt_ROLE).")] = None,
    fast_tier: Annotated[Path | None, typer.Option(
        "--fast-tier", metavar="DIR", file_okay=False,
        help="A directory on each host's fast local disk (recorded in casckpt.toml): commits "
             "land there and drain to the locations in the background (see "
             "docs/guides/fast-tier.md); default: casckpt --fast-tier / CASCKPT_FAST_TIER.")] = None,
    fast_tier_bytes: Annotated[str | None, typer.Option(
        "--fast-tier-bytes", metavar="SIZE",
        help="The fast tier's budget, e.g. 200GiB (recorded; default: half its disk's free "
             "space when opened).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Create a store (does nothing to an existing one).

    PATH gets a casckpt.toml recording where blobs and catalog live, so every
    job and command opens the store with PATH alone. Relative directories in
    --blobs and --location are relative to PATH.

    Example, six disks in six failure domains, any four of which restore
    every pack: casckpt init /ckpt --redundancy ec:4+2 --location d0=/mnt/d0
    --location d1=/mnt/d1 ... --location d5=/mnt/d5
    """
    if print_grants is not None:
        urls = ([loc.url for loc in parse_locations(location)] if location else [blobs] if blobs
                else grants.store_urls(path if path is not None else ctx.obj.store))
        grants.print_grants(print_grants, role_name, urls, as_json=as_json)
        return
    target = path if path is not None else store_path(ctx)
    key_file = key_file or ctx.find_root().obj.key_file
    if encrypt and key_file is None:
        raise typer.BadParameter("--encrypt needs a master key: pass --key-file FILE (make one with "
                                 "`casckpt key generate FILE`)", param_hint="--key-file")
    if blobs is not None and location:
        raise typer.BadParameter("give either --blobs or --location, not both", param_hint="--location")
    places = parse_locations(location) if location else blobs
    fast_tier = fast_tier or ctx.find_root().obj.fast_tier
    if fast_tier_bytes is not None and fast_tier is None:
        raise typer.BadParameter("a budget needs a fast tier: pass --fast-tier DIR too",
                                 param_hint="--fast-tier-bytes")
    try:
        existing = open_path(ctx, target, create=False, key_file=key_file)
    except NotAStoreError:
        if read_only_asked(ctx):
            raise ReadOnlyStoreError(f"no casckpt store at {target}, and creating one needs write "
                                     "access: run init without --read-only", right="store:create") from None
        s3 = {k: v for k, v in (("endpoint_url", s3_endpoint), ("region", s3_region),
                                ("sse", sse), ("kms_key_id", kms_key_id)) if v is not None}
        with casckpt.open(target, create=True, blobs=places, catalog=catalog, s3=s3,
                          redundancy=redundancy, key_file=key_file, fast_tier=fast_tier,
                          fast_tier_bytes=fast_tier_bytes) as store:
            render.out(f"Created an empty{' encrypted' if key_file else ''} casckpt store in {store.path}")
            if redundancy is not None or location:
                render.out(f"redundancy {store.locations.redundancy()} over "
                           f"{len(store.locations.list())} location(s)")
            if fast_tier is not None:
                budget = (render.human_bytes(store.tier.status().budget or 0) if fast_tier_bytes
                          else "half its disk's free space")
                render.out(f"fast tier {fast_tier.expanduser().resolve()} (budget {budget})")
        return
    with existing as store:
        render.out(f"A casckpt store already exists in {target} ({_what_it_holds(store)}); "
                   "init left its settings as they were")


def _what_it_holds(store: casckpt.Store) -> str:
    """Whether an existing store is encrypted and how many versions it holds: what a retried
    ``init --encrypt`` must tell truthfully."""
    try:
        sealed = bool(store.keys.list())
    except NotEncryptedError:
        sealed = False
    count = sum(run.versions for run in store.runs())
    return f"{'encrypted' if sealed else 'not encrypted'}, {count} version{'' if count == 1 else 's'}"


def parse_locations(values: list[str]) -> list[BlobLocation]:
    """``["d0=/mnt/a", "/mnt/b"]`` -> locations; a prefix before ``=`` without ``/`` or ``:`` is a domain."""
    out = []
    for value in values:
        domain, sep, url = value.partition("=")
        if sep and _DOMAIN.match(domain):
            if not url:
                raise InvalidArgumentError(f"--location {value!r}: give a URL after {domain}=")
            out.append(BlobLocation(url, domain))
        else:
            out.append(BlobLocation(value))
    return out


@app.command()
def runs(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """List the runs of the store."""
    with open_store(ctx) as store:
        found = store.runs()
    render.emit(as_json, [run.to_dict() for run in found], render.runs_table(found), empty="no runs yet")


@app.command()
def show(
    ctx: typer.Context, ref: RefArgument,
    tensors: Annotated[bool, typer.Option(
        "--tensors", metavar=FLAG,
        help="List every tensor (streamed, in natural order: layers.2 before layers.10).",
    )] = False,
    as_json: JsonOption = False,
) -> None:
    """Show one version: its metadata, a summary of its tensors (--tensors: each one) and its
    plain values. --json streams every tensor."""
    with open_store(ctx) as store:
        detail = store.show(ref, tensors=tensors or as_json)
    if as_json:
        render.stream_json(detail.to_dict(), "tensors")
    else:
        render.out(*render.detail_view(detail, tensors=tensors))
        if tensors:
            render.stream_tensors(detail)


@app.command()
def tag(
    ctx: typer.Context,
    ref: RefArgument,
    name: Annotated[str, typer.Argument(help="Tag name; later `show tag:NAME`.")],
    as_json: JsonOption = False,
) -> None:
    """Point tag NAME at a version."""
    with open_store(ctx) as store:
        version = store.tag(ref, name)
    render.emit(as_json, version.to_dict(),
                f"Tagged {version.short_id} ({version.run}@{version.step}) as {name}")


@app.command()
def restore(
    ctx: typer.Context,
    ref: RefArgument,
    to: Annotated[Path, typer.Option("--to", metavar="FILE",
        help="Target .safetensors file.", dir_okay=False)],
    force: Annotated[bool, typer.Option("--force", "-f", metavar=FLAG, help="Overwrite the target.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Export a version to a safetensors file (tensors by dotted path, plain values as JSON).

    Metadata: casckpt.version (id), casckpt.run, casckpt.step and casckpt.values
    (JSON); values over 64 KiB go to a sidecar FILE.values.json instead.
    """
    with open_store(ctx) as store, progress_bars() as progress:
        version = store.resolve(ref)
        result = store.export(version, to, format="safetensors-file", overwrite=force, progress=progress)
    values_file = next((result.directory / f for f in result.files if f != to.name), None)
    render.emit(as_json, {"version": version.to_dict(), "file": str(to), "tensors": result.tensors,
                          "values": result.values,
                          "values_file": None if values_file is None else str(values_file)},
                f"Wrote {result.tensors} tensors and {result.values} values of {version.short_id} "
                f"({version.run}@{version.step}) to {to}")
    if values_file is not None and not as_json:
        render.note(f"plain values are over 64 KiB: written to {values_file}")


@app.command()
def check(
    ctx: typer.Context,
    read_data: Annotated[
        bool, typer.Option("--read-data", metavar=FLAG, help="Also read and verify every pack and chunk.")
    ] = False,
    read_data_subset: Annotated[str | None, typer.Option(
        "--read-data-subset", metavar="P%",
        help="Read and verify only this share of the stored bytes (e.g. 5% or 0.05), least "
             "recently verified packs first; not together with --read-data.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Verify the store's consistency; exit 1 if any problem is found.

    Without --read-data: every location's identity, every manifest (in the
    catalog, bound to its version, and a copy on every location), the catalog's
    rows against the manifests, the refs records, every pack and shard by
    listing, and shards sharing a failure domain. --read-data also reads every
    pack and manifest copy back and verifies every chunk, and the sampled
    fingerprint of each tensor a commit reused on a change hint (a "hint"
    problem: the hint was wrong). A daily
    `check --read-data-subset 5%` verifies every byte every 20 days. Damaged
    shards found are queued for `casckpt repair`; docs/GUARANTEES.md says what
    a clean check proves.
    """
    if read_data and read_data_subset is not None:
        raise typer.BadParameter("--read-data reads everything; drop it to read only a subset",
                                 param_hint="--read-data-subset")
    with open_store(ctx) as store, progress_bars() as progress:
        report = store.ops.check(read_data=read_data, read_data_subset=read_data_subset,
                             progress=progress)
    render.emit(as_json, render.check_dict(report), *render.check_view(report))
    if not report.ok:
        raise typer.Exit(EXIT_PROBLEMS)


@app.command()
def stats(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Space accounting: logical, unique and stored bytes; dedup and compression ratios."""
    with open_store(ctx) as store:
        result = store.ops.stats()
    render.emit(as_json, render.stats_dict(result), render.stats_table(result))


@app.command()
def migrate(ctx: typer.Context) -> None:
    """Upgrade the store's catalog to this casckpt's schema (opening a store does it)."""
    path = store_path(ctx)
    with open_store(ctx) as store:  # casckpt.open upgrades an older catalog, or refuses a newer one
        if store.read_only is not None:  # at the shipped revision already, or opening had refused
            render.note(f"casckpt: read-only ({store.read_only}): nothing to upgrade")
    render.out(f"Catalog of {path} is up to date with this casckpt")


# the commands of the other modules come after init ... migrate in help, as they always have
gc_cli.register(app)
history_cli.register(app)
retention_cli.register(app)
storage_cli.register(app)
tier_cli.register(app)
transfer_cli.register(app)
mirror_cli.register(app)
dirs_cli.register(app)
keys_cli.register(app)
drill_cli.register(app)
report_cli.register(app)



def main() -> None:
    """The ``casckpt`` command. The command owns its process, so everything its imports made
    (SQLAlchemy, typer, rich, casckpt) is moved out of the collector's reach first
    (``gc.freeze``): collections during the command then walk only what the command makes,
    not the libraries' objects again (docs/perf/startup3.md measured 55-80 ms of a command's
    CPU in the collector). The collector itself stays on. ``app`` is left untouched for
    programs that embed the CLI (``CliRunner`` in the tests), whose objects are theirs."""
    gc.freeze()
    app()


if __name__ == "__main__":  # `python -m casckpt.cli.main`
    main()
