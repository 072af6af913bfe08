"""docs/guides/*.md and the README's tour run: every block, in order, against real services.

The guides are read the way tests/e2e/test_runbooks.py reads docs/RUNBOOKS.md, with
its parser and its output matching (see that module's docstring: ``$`` lines,
``# exit N``, ``…``), so a guide whose command prints something else, or exits
otherwise, fails here until the guide says the new thing. What differs:

- One guide is one test, in a fresh root R (cwd R/srv; ``/srv/…``, ``/mnt/…``
  and ``/shared/…`` mean the same under R). Its blocks share one namespace
  (a later ```python block sees the ``store`` an earlier one opened).
- Blocks that run: ```python (executed), ```console (each ``$`` line run and
  its output matched) and ```toml (read by the real config reader, so a
  casckpt.toml a guide shows is one casckpt accepts). Besides ``casckpt …``
  (in-process, typer's CliRunner) and ``mv SRC DST``, a console block may run
  ``cat FILE`` and ``export NAME=VALUE``.
- A block of any other kind must be opted out by the line before its fence:
  ``<!-- not run: WHY -->`` (a crontab line, say); an opt-out without a reason,
  or an unmarked block that cannot run, fails the test. Opt-outs are counted
  and kept rare (:data:`MAX_OPT_OUTS`).
- Services are real: the guides name ``postgresql+psycopg://trainer@db.internal/casckpt``,
  ``http://s3.internal:9000`` and the bucket ``team-ckpts``; here they are a
  fresh database on the session's pgserver, the session's moto server on
  127.0.0.1 and a fresh bucket on it (substituted in, and back out of what the
  commands print). HOME and XDG_CACHE_HOME are the test's own temp dirs.

The deployment guide must also name every option of ``casckpt init`` and every
key an ``[s3]`` table may hold, so neither list can grow without the guide.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_runbooks import Command, Shell, _console, _trim, mismatch
from typer.main import get_command

from casckpt.cli.main import app
from casckpt.config_file import read_config_file
from casckpt.storage.s3_backend import OPTIONS as S3_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
DOCS = [*GUIDES, ROOT / "README.md"]
DEPLOYMENT = ROOT / "docs" / "guides" / "s3-postgres.md"
SLOW = {"megatron.md",  # importing Megatron-Core alone takes seconds: run with -m slow
        "deepspeed.md",  # launches real DeepSpeed ranks twice (~30 s on 2 cores)
        "torchtitan.md"}  # imports torchtitan and runs six launches of its manager (~5 s)
NEEDS = {"torchtitan.md": "torchtitan"}  # an extra the test extra leaves out (see pyproject.toml)
MAX_OPT_OUTS = 4  # in all the documents together: a guide is worth having because it runs

PG = "postgresql+psycopg://trainer@db.internal/casckpt"
S3_ENDPOINT = "http://s3.internal:9000"
BUCKET = "team-ckpts"

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
_OPT_OUT = re.compile(r"^<!-- not run: (?P<why>\S.*?) -->\s*$")
_PLACES = re.compile(r"(?<![\w./])/(?=(?:mnt|srv|shared)/)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a document."""

    doc: Path
    line: int  # 1-based, of the first line inside the fence
    lang: str
    text: str
    opt_out: str | None  # why it does not run, or None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc``, in order."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        marker = _OPT_OUT.match(lines[i - 1]) if i else None
        found.append(Block(doc, i + 2, fence["lang"], "\n".join(lines[i + 1 : end]),
                           marker["why"] if marker else None))
        i = end + 1
    return found


@dataclass
class Services:
    """What the documents' placeholders stand for in this test (only those it uses are started)."""

    pairs: list[tuple[str, str]] = field(default_factory=list)  # (in the document, here)

    def into(self, text: str) -> str:
        for doc, here in self.pairs:
            text = text.replace(doc, here)
        return text

    def out(self, text: str) -> str:
        for doc, here in self.pairs:
            text = text.replace(here, doc)
        return text


class GuideShell(Shell):
    """The runbooks' shell, plus ``cat`` and ``export``, ``/shared/…`` and the services."""

    def __init__(self, root: Path, services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(root)
        self.services = services
        self.monkeypatch = monkeypatch
        self.namespace: dict[str, Any] = {"__name__": "guide"}

    def place(self, text: str) -> str:
        return _PLACES.sub(f"{self.root}/", self.services.into(text))

    def unplace(self, text: str) -> str:
        return self.services.out(super().unplace(text))

    def run(self, command: Command) -> tuple[int, str]:
        argv = shlex.split(command.text)
        if argv[0] == "cat" and len(argv) == 2:
            return 0, self.unplace((self.cwd / self.place(argv[1])).read_text(encoding="utf-8"))
        if argv[0] == "export" and len(argv) == 2 and "=" in argv[1]:
            name, _, value = argv[1].partition("=")
            self.monkeypatch.setenv(name, self.place(value))
            return 0, ""
        return super().run(command)

    def execute_python(self, block: Block) -> None:
        code = compile(self.place(block.text), block.where, "exec")
        exec(code, self.namespace)

    def expect(self, block: Block, command: Command) -> None:
        code, output = self.run(command)
        actual = _trim(output.splitlines())
        where = f"{block.doc.relative_to(ROOT)}:{command.line}: `{command.text}`"
        shown = "\n".join(actual)
        assert code == command.exit_code, (
            f"{where} exited {code}, the guide says {command.exit_code}; it printed:\n{shown}")
        parted = mismatch(command.expected, actual)
        assert parted is None, f"{where}, {parted}\nthe whole output:\n{shown}".replace(
            "runbook:", "guide:  ")

    def run_block(self, block: Block) -> None:
        if block.lang == "python":
            self.execute_python(block)
        elif block.lang == "console":
            offset = block.line  # _console numbers lines from the block's first line
            for command in _console(block.text.splitlines(), offset):
                self.expect(block, command)
        elif block.lang == "toml":
            file = self.root / "shown.toml"
            file.write_text(block.text, encoding="utf-8")
            read_config_file(file)
        else:
            raise AssertionError(
                f"{block.where}: a ```{block.lang or '(no language)'} block cannot run; make it "
                "python, console or toml, or put `<!-- not run: WHY -->` on the line before it")


@pytest.fixture
def services(request: pytest.FixtureRequest) -> Callable[[str], Services]:
    """Factory: the services a document's text names, started on demand."""
    def make(text: str) -> Services:
        found = Services()
        if PG in text:
            found.pairs.append((PG, request.getfixturevalue("new_pg_url")()))
        if S3_ENDPOINT in text or f"s3://{BUCKET}/" in text:
            found.pairs.append((S3_ENDPOINT, request.getfixturevalue("moto_endpoint")))
            bucket = request.getfixturevalue("s3_bucket_url")().removeprefix("s3://").split("/")[0]
            found.pairs.append((f"s3://{BUCKET}/", f"s3://{bucket}/"))
        return found

    return make


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """R: srv/ (the working directory), mnt/d0..d5 and shared/; HOME and the cache inside it."""
    root = tmp_path / "r"
    for disk in range(6):
        (root / "mnt" / f"d{disk}").mkdir(parents=True)
    (root / "srv").mkdir()
    (root / "shared").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    monkeypatch.delenv("CASCKPT_STORE", raising=False)
    for width in ("COLUMNS", "TERMINAL_WIDTH"):  # usage errors are boxes as wide as the terminal
        monkeypatch.delenv(width, raising=False)
    monkeypatch.chdir(root / "srv")
    return root


@pytest.mark.parametrize("doc", [pytest.param(d, marks=pytest.mark.slow) if d.name in SLOW else d
                                 for d in DOCS], ids=lambda doc: doc.stem)
def test_guide_runs(doc: Path, root: Path, services: Callable[[str], Services],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    if doc.name in NEEDS:
        pytest.importorskip(NEEDS[doc.name], reason=f"the {NEEDS[doc.name]} extra is not installed")
    shell = GuideShell(root, services(doc.read_text(encoding="utf-8")), monkeypatch)
    ran = 0
    try:
        for block in blocks(doc):
            if block.opt_out is None:
                shell.run_block(block)
                ran += 1
    finally:
        store = shell.namespace.get("store")
        if store is not None and hasattr(store, "close"):
            store.close()
    assert ran, f"{doc.relative_to(ROOT)} has no block that runs"


def test_opt_outs_are_few_and_say_why() -> None:
    marked = [block for doc in DOCS for block in blocks(doc) if block.opt_out is not None]
    assert len(marked) <= MAX_OPT_OUTS, [block.where for block in marked]
    unmarked = [line for doc in DOCS for line in doc.read_text(encoding="utf-8").splitlines()
                if line.startswith("<!-- not run") and not _OPT_OUT.match(line)]
    assert not unmarked, f"an opt-out must say why: {unmarked}"


def test_every_guide_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert [g.name for g in GUIDES if f"guides/{g.name}" not in nav] == []


def test_the_deployment_guide_names_every_init_option_and_s3_key() -> None:
    text = DEPLOYMENT.read_text(encoding="utf-8")
    init = get_command(app).commands["init"]  # type: ignore[attr-defined]
    options = [opt for param in init.params for opt in param.opts if opt.startswith("--")]
    assert "--location" in options and "--sse" in options  # the list is the real one
    assert [opt for opt in options if f"`{opt}" not in text] == []
    assert [key for key in S3_OPTIONS if f"`{key}`" not in text] == []
    assert os.path.basename(DEPLOYMENT) in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_the_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = "pip install 'torch==2.13.0' -e '.[test]' && python -m pytest -q"
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_test_servers_and_clients_are_bounded_and_ci_resolves_the_newest() -> None:
    """A fresh venv resolves the newest versions the test extra allows: each server and client
    the suite runs against is bounded above (moto 5.2 broke the README's command by naming S3
    actions differently), and CI installs the newest allowed, eagerly, and prints them before
    the README's command runs."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"]
    test = {req.name: req.specifier for req in map(Requirement, extras["test"])}
    bounded = ("moto", "boto3", "pgserver", "psycopg", "pytest", "pytest-xdist", "hypothesis",
               "transformers", "lightning", "accelerate", "peft", "matplotlib", "megatron-core",
               "deepspeed")
    for name in bounded:
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in test[name]), name
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    readme_command = ci.index("pip install 'torch==2.13.0' -e '.[test]' && python -m pytest -q")
    upgrade = [n for n, line in enumerate(ci) if "--upgrade-strategy eager" in line and "'.[test]'" in line]
    listing = [n for n, line in enumerate(ci) if "pip list" in line]
    assert upgrade and listing and upgrade[0] < listing[0] < readme_command
