"""docs/RUNBOOKS.md runs: every command of every runbook, against a store in the state it describes.

How the document is read (the document says the same to its readers):

- ``## The running example`` builds the store: its ```console blocks run,
  and its ```python block (the stand-in for a training job) is executed.
  Each ``## Runbook …`` section then gets a store of its own built that
  way, the incident the runbook is about staged on it by :data:`STAGES`
  (keyed by the section's title: a runbook without a stage fails), and its
  ```console blocks run in order. A ```log block shows what the training
  job logged while the incident was staged (casckpt's warnings, one message
  a line), matched like a command's output; a runbook without one says the
  job logged nothing. Other blocks (```sh) are notes and do not run.
- In a ```console block, a line ``$ COMMAND`` is a command and the lines
  after it, up to the next ``$`` line or the end of the block, are what it
  prints: stdout and stderr together, as a terminal shows them. A trailing
  ``# exit N`` on the command line is its exit status; without one it is 0.
  A command line ending in a backslash continues on the next line.
- ``casckpt …`` runs the real command line in this process (typer's
  CliRunner: not a terminal, so no colours, no progress bars and tables as
  wide as their cells). ``mv SRC DST`` is the only other command allowed.
- Paths: everything happens under a temporary root R, in the working
  directory R/srv; ``/srv/…`` and ``/mnt/…`` in a command or in the python
  block mean R/srv/… and R/mnt/…, and R is cut out of what the commands
  print (so they print /mnt/d0/ckpts, file:///mnt/d0/ckpts).

How output is matched (strict otherwise; the same number of lines):

- trailing spaces and trailing blank lines are ignored, and any run of
  spaces matches any other run of spaces (column widths follow the values);
  any run of ``─`` (a table's rule) matches any other run of ``─``;
- ``…`` matches any run of characters within one line, possibly empty: the
  placeholder for ids, times, probe durations and the like;
- a line that is ``…`` and nothing else matches any number of whole lines,
  none included: for output whose length varies from run to run (the runbook
  says why where it uses one);
- every other character must be equal, and so must the exit status.

So a change to what a command prints or to its exit status fails this test
until docs/RUNBOOKS.md says the new thing.
"""

from __future__ import annotations

import functools
import logging
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "RUNBOOKS.md"
GC_WORKER = Path(__file__).parents[1] / "helpers" / "gc_worker.py"
SETUP = "The running example"
STORE = "srv/ckpts"  # relative to the root R

_HEADING = re.compile(r"^## (?P<title>.+?)\s*$")
_FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
_COMMAND = re.compile(r"^\$ (?P<command>.*?)(?:\s+# exit (?P<code>\d+))?\s*$")
_PLACES = re.compile(r"(?<![\w./])/(?=(?:mnt|srv)/)")
_SPACES = re.compile(r" +")
_RULE = re.compile(r"─+")


@dataclass(frozen=True)
class Command:
    """One ``$`` line of a console block and what the document says it prints."""

    line: int  # 1-based, in RUNBOOKS.md
    text: str
    exit_code: int
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Python:
    """A ```python block of the running example."""

    line: int
    source: str


@dataclass
class Section:
    title: str
    line: int
    steps: list[Command | Python] = field(default_factory=list)
    log: tuple[str, ...] = ()  # what the job logged during the incident (a ```log block)
    log_line: int = 0


def _trim(lines: list[str]) -> tuple[str, ...]:
    while lines and not lines[-1].strip():
        lines.pop()
    return tuple(lines)


def _console(block: list[str], first: int) -> list[Command]:
    commands: list[Command] = []
    current: tuple[int, str, int] | None = None
    output: list[str] = []
    lines = iter(enumerate(block))
    for offset, text in lines:
        while text.startswith("$ ") and text.endswith("\\"):  # a command continued on the next line
            text = text[:-1] + next(lines, (0, ""))[1].strip()
        found = _COMMAND.match(text)
        if found is None:
            if current is None:
                raise AssertionError(f"{DOC.name}:{first + offset}: console block output before a `$` line")
            output.append(text)
            continue
        if current is not None:
            commands.append(Command(*current, _trim(output)))
        current, output = (first + offset, found["command"], int(found["code"] or 0)), []
    if current is not None:
        commands.append(Command(*current, _trim(output)))
    return commands


def parse(text: str) -> list[Section]:
    """The ``##`` sections of the document, with their console commands and python blocks in order."""
    sections: list[Section] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            heading = _HEADING.match(lines[i])
            if heading is not None:
                sections.append(Section(heading["title"], i + 1))
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        body = lines[i + 1 : end]
        if fence["lang"] in ("console", "python", "log"):
            assert sections, f"{DOC.name}:{i + 1}: a block before the first section"
            if fence["lang"] == "console":
                sections[-1].steps.extend(_console(body, i + 2))
            elif fence["lang"] == "python":
                sections[-1].steps.append(Python(i + 2, "\n".join(body)))
            else:
                assert not sections[-1].log_line, f"{DOC.name}:{i + 1}: a second log block"
                sections[-1].log, sections[-1].log_line = _trim(list(body)), i + 2
        i = end + 1
    return sections


def _normal(line: str) -> str:
    return _RULE.sub("─", _SPACES.sub(" ", line.rstrip()))


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is what the document's ``expected`` line says (see the module docstring)."""
    pattern = ".*?".join(re.escape(part) for part in _normal(expected).split("…"))
    return re.fullmatch(pattern, _normal(actual)) is not None


class Shell:
    """Runs a runbook's commands the way an operator would, inside the root R."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cwd = root / "srv"

    def place(self, text: str) -> str:
        """``/mnt/…`` and ``/srv/…`` -> the same under R."""
        return _PLACES.sub(f"{self.root}/", text)

    def unplace(self, text: str) -> str:
        return text.replace(str(self.root.resolve()), "").replace(str(self.root), "")

    def run(self, command: Command) -> tuple[int, str]:
        argv = [self.place(arg) for arg in shlex.split(command.text)]
        where = f"{DOC.name}:{command.line}: `{command.text}`"
        if argv[0] == "mv" and len(argv) == 3:
            shutil.move(self.cwd / argv[1], self.cwd / argv[2])
            return 0, ""
        assert argv[0] == "casckpt", f"{where}: the runbooks run only casckpt and mv"
        result = CliRunner().invoke(app, argv[1:])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(f"{where} raised") from result.exception
        return result.exit_code, self.unplace(result.output)

    def execute(self, block: Python) -> None:
        code = compile(self.place(block.source), f"{DOC}:{block.line}", "exec")
        exec(code, {"__name__": "runbook"})


def mismatch(expected: tuple[str, ...], actual: tuple[str, ...]) -> str | None:
    """None if ``actual`` is what ``expected`` says, line by line; else where they part."""
    misses: list[tuple[int, int]] = []  # (expected, actual) line pairs that did not match

    @functools.cache
    def fits(i: int, j: int) -> bool:
        if i == len(expected):
            if j < len(actual):
                misses.append((i, j))
            return j == len(actual)
        if expected[i].strip() == "…":
            return any(fits(i + 1, k) for k in range(j, len(actual) + 1))
        if j < len(actual) and matches(expected[i], actual[j]):
            return fits(i + 1, j + 1)
        misses.append((i, j))
        return False

    if fits(0, 0):
        return None
    i, j = max(misses)  # where the attempt that got furthest through the runbook's lines failed
    want = repr(expected[i]) if i < len(expected) else "(no more lines)"
    got = repr(actual[j]) if j < len(actual) else "(no more lines)"
    return f"output line {j + 1}:\n  runbook: {want}\n  printed: {got}"


def log_mismatch(expected: tuple[str, ...], actual: tuple[str, ...]) -> str | None:
    """None if the job's log ``actual`` holds the lines ``expected`` says, in any order: a
    commit's warnings come from its upload threads (its manifest and its packs are written
    at once), so their order is not defined; else the first line either side lacks."""
    left = list(actual)
    for i, line in enumerate(expected):
        hit = next((j for j, got in enumerate(left) if matches(line, got)), None)
        if hit is None:
            return f"line {i + 1} of the runbook's log was not logged:\n  runbook: {line!r}"
        del left[hit]
    if left:
        return f"a line the runbook's log lacks:\n  printed: {left[0]!r}"
    return None


def expect(shell: Shell, command: Command) -> None:
    code, output = shell.run(command)
    actual = _trim(output.splitlines())
    where = f"{DOC.name}:{command.line}: `{command.text}`"
    shown = "\n".join(actual)
    assert code == command.exit_code, (
        f"{where} exited {code}, the runbook says {command.exit_code}; it printed:\n{shown}")
    parted = mismatch(command.expected, actual)
    assert parted is None, f"{where}, {parted}\nthe whole output:\n{shown}"


def run_section(shell: Shell, section: Section) -> None:
    for step in section.steps:
        if isinstance(step, Python):
            shell.execute(step)
        else:
            expect(shell, step)


# -- the incidents ----------------------------------------------------------------------------


def _store(root: Path) -> Path:
    return root / STORE


def _location(root: Path, disk: int) -> Path:
    return root / "mnt" / f"d{disk}" / "ckpts"


class _JobLog(logging.Handler):
    """casckpt's warnings while a staged job runs: what its log would show."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _state(step: int) -> dict[str, Any]:
    """What the running example's job commits at ``step`` (its python block, verbatim)."""
    gen = torch.Generator().manual_seed(step)
    model = {"w": torch.randn(256, 1024, generator=gen), "b": torch.randn(1024, generator=gen)}
    return {"model": model, "step": step}


def _commit(root: Path, step: int) -> list[str]:
    """One more checkpoint of the running example's job; returns the warnings it logged."""
    logger, log = logging.getLogger("casckpt"), _JobLog()
    logger.addHandler(log)
    try:
        with casckpt.open(_store(root), create=False) as store:
            store.commit(_state(step), run="llama-ft", step=step, metrics={"loss": 1 / step})
    finally:
        logger.removeHandler(log)
    return log.lines


def lose_a_location(root: Path) -> list[str]:
    """Disk d3 dies: its location directory is gone; the job commits llama-ft@400 meanwhile.
    A spare disk is mounted at /mnt/d6."""
    shutil.rmtree(_location(root, 3))
    log = _commit(root, 400)
    (root / "mnt" / "d6").mkdir()
    return log


def damage_a_location(root: Path) -> list[str]:
    """Disk d2 rots: bits flip in its shard of the first pack, its shard of the last pack is cut
    short. A spare disk is mounted at /mnt/d6."""
    shards = sorted((p for p in (_location(root, 2) / "packs").rglob("*") if p.is_file()),
                    key=lambda p: p.stat().st_mtime_ns)
    assert len(shards) == 3, shards
    flipped = bytearray(shards[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(flipped))
    cut = shards[-1].read_bytes()
    shards[-1].write_bytes(cut[: len(cut) // 2])
    (root / "mnt" / "d6").mkdir()
    return []


def lose_the_catalog(root: Path) -> list[str]:
    """The disk holding catalog.db dies."""
    for file in _store(root).glob("catalog.db*"):
        file.unlink()
    return []


def kill_a_gc(root: Path) -> list[str]:
    """``gc --grace 0s`` SIGKILLed after it swept the catalog and deleted its first object."""
    killed = subprocess.run([sys.executable, str(GC_WORKER), "killed-gc", str(_store(root)),
                             "delete-object", "1"], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    return []


def restore_a_stale_catalog(root: Path) -> list[str]:
    """catalog.db is put back from a backup taken before llama-ft@400 was committed."""
    catalog = _store(root) / "catalog.db"
    backup = root / "catalog-backup.db"
    with closing(sqlite3.connect(catalog)) as live, closing(sqlite3.connect(backup)) as copy:
        live.backup(copy)
    log = _commit(root, 400)
    for file in _store(root).glob("catalog.db*"):
        file.unlink()
    shutil.copy(backup, catalog)
    return log


STAGES: dict[str, Callable[[Path], list[str]]] = {
    "Runbook 1: a location is lost": lose_a_location,
    "Runbook 2: a location is failing slowly or corrupting data": damage_a_location,
    "Runbook 3: the catalog is lost": lose_the_catalog,
    "Runbook 4: a gc was killed": kill_a_gc,
    "Runbook 5: gc refused to delete (exit 7)": restore_a_stale_catalog,
}

SECTIONS = {section.title: section for section in parse(DOC.read_text(encoding="utf-8"))}
RUNBOOKS = [title for title in SECTIONS if title.startswith("Runbook")]


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Shell:
    """The running example's store, built by the document's own commands."""
    root = tmp_path / "r"
    for disk in range(6):
        (root / "mnt" / f"d{disk}").mkdir(parents=True)
    (root / "srv").mkdir()
    monkeypatch.chdir(root / "srv")
    monkeypatch.delenv("CASCKPT_STORE", raising=False)
    shell = Shell(root)
    run_section(shell, SECTIONS[SETUP])
    return shell


def test_every_runbook_is_staged_and_runs_commands() -> None:
    assert set(RUNBOOKS) == set(STAGES), "a runbook without a stage, or a stage without its runbook"
    for title in [SETUP, *RUNBOOKS]:
        assert any(isinstance(step, Command) for step in SECTIONS[title].steps), title


@pytest.mark.parametrize("title", RUNBOOKS)
def test_runbook(shell: Shell, title: str) -> None:
    section = SECTIONS[title]
    log = _trim([shell.unplace(line) for line in STAGES[title](shell.root)])
    parted = log_mismatch(section.log, log)
    assert parted is None, (f"{DOC.name}:{section.log_line or section.line}: the job's log, {parted}\n"
                            "the whole log:\n" + "\n".join(log))
    run_section(shell, section)
    # whatever the runbook did, it left a store whose every byte verifies and every version
    # restores to what the job committed
    with casckpt.open(_store(shell.root), create=False) as store:
        assert store.ops.check(read_data=True).ok
        versions = store.log("llama-ft")
        assert versions
        for version in versions:
            restored = store.restore(version)
            want = _state(version.step)
            assert restored["step"] == version.step
            assert all(torch.equal(restored["model"][k], want["model"][k]) for k in want["model"])


@pytest.mark.parametrize("expected,actual,ok", [
    ("loc0   d0   …   yes", "loc0 d0 active 3 ms yes", True),
    ("checked 3 versions", "checked 3 versions, 3 packs", False),
    ("store … (generation 1)", "store 6b1e2 (generation 1)", True),
    ("store … (generation 1)", "store 6b1e2 (generation 2)", False),
    ("────", "──────────────", True),
    ("a.b", "axb", False),
    ("", "", True),
    ("…", "", True),
])
def test_the_matching_rule(expected: str, actual: str, ok: bool) -> None:
    assert matches(expected, actual) is ok


@pytest.mark.parametrize("expected,actual,ok", [
    (("a", "…", "d"), ("a", "b", "c", "d"), True),
    (("a", "…", "d"), ("a", "d"), True),
    (("a", "…"), ("a",), True),
    (("a", "…", "d"), ("a", "b", "c"), False),
    (("a", "b"), ("a", "b", "c"), False),
    (("a", "b", "c"), ("a", "b"), False),
    (("a …",), ("a b", "c"), False),
])
def test_the_matching_rule_for_lines(expected: tuple[str, ...], actual: tuple[str, ...], ok: bool) -> None:
    assert (mismatch(expected, actual) is None) is ok
