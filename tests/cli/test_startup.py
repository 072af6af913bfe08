"""Start-up costs users feel (issue 17): what a command or an open imports and does.

Behaviour only, no timings: the catalog-only commands never import torch (checked in a
fresh interpreter, through ``sys.modules``); opening a store at the current schema runs no
migration (and imports no Alembic); the revision open compares against is Alembic's head.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.catalog import migrate

RUN = "start"

# Runs each command line through the typer app in one fresh interpreter and reports, after
# each one, its exit code and whether these modules were imported by then.
_WRAPPER = """
import json, sys
from casckpt.cli.main import app
watched = ("torch", "alembic", "safetensors", "botocore", "numpy", "casckpt.engine.packlayer.packs",
           "casckpt.engine.memory.deltabase", "casckpt.engine.memory.staging")
out = []
for args in json.loads(sys.argv[1]):
    try:
        app(args, standalone_mode=False)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out.append({"args": args, "code": code, "loaded": [m for m in watched if m in sys.modules]})
sys.stdout.flush()
print("\\n" + json.dumps(out))
"""


def _commands_in_one_process(store: Path, commands: list[list[str]]) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(commands)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env=_env(store))
    assert done.returncode == 0, done.stderr
    result: list[dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _env(store: Path) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["CASCKPT_STORE"] = str(store)
    return env


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup") / "store"
    with casckpt.open(root) as store:
        for step in range(3):
            store.commit({"w": torch.full((8,), float(step)), "step": step}, run=RUN, step=step,
                         metrics={"loss": 1.0 / (step + 1)})
        store.ops.check()
    return root


def test_catalog_only_commands_import_no_torch(small_store: Path) -> None:
    commands = [
        ["--help"], ["--version"], ["runs"], ["runs", "--json"], ["log", RUN], ["log", RUN, "--json"],
        ["show", f"{RUN}@1"], ["show", f"{RUN}@1", "--tensors"], ["show", f"{RUN}@1", "--json"],
        ["tag", f"{RUN}@1", "good"], ["best", RUN, "--metric", "loss"], ["lineage"], ["audit"],
        ["gc", "--dry-run"], ["stats"], ["audit", "--since", "1h", "--action", "tag", "--json"],
        ["drill", "--history"], ["drill", "--history", "--json"],
    ]
    results = _commands_in_one_process(small_store, commands)
    assert [r["code"] for r in results] == [0] * len(commands), results
    assert [r for r in results if "torch" in r["loaded"]] == []  # type: ignore[operator]
    assert [r for r in results if "safetensors" in r["loaded"]] == []  # type: ignore[operator]
    # opening a store at the current schema never needs Alembic, nor a local one an S3 client
    assert [r for r in results if {"alembic", "botocore"} & set(r["loaded"])] == []  # type: ignore[call-overload]
    # the queries load neither numpy (show checks a manifest's nesting without it) nor the engine
    # (built on first use: gc and stats build it, the last ones run)
    queries = results[:commands.index(["gc", "--dry-run"])]
    assert [r for r in queries if "numpy" in r["loaded"]] == []  # type: ignore[operator]
    engine = {"casckpt.engine.packlayer.packs", "casckpt.engine.memory.deltabase",
              "casckpt.engine.memory.staging"}
    assert [r for r in queries if engine & set(r["loaded"])] == []  # type: ignore[call-overload]


def test_version_flag_prints_the_package_version(small_store: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "casckpt.cli.main", "--version"],
                          capture_output=True, text=True, timeout=120, check=False, env=_env(small_store))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"casckpt {casckpt.__version__}"


_ENTRY = """
import atexit, gc, sys
from casckpt.cli.main import main
atexit.register(lambda: print(f"frozen={gc.get_freeze_count()} enabled={gc.isenabled()}"))
sys.argv[0] = "casckpt"
main()
"""


def test_the_command_freezes_what_its_imports_made_and_keeps_the_collector_on(small_store: Path) -> None:
    # the entry point (`casckpt`, `python -m casckpt.cli.main`) moves the libraries' objects out of
    # the collector's reach; a collector switched off would let a long command's cycles pile up
    done = subprocess.run([sys.executable, "-c", _ENTRY, "log", RUN], capture_output=True, text=True,
                          timeout=120, check=False, env=_env(small_store))
    assert done.returncode == 0, done.stderr
    assert "enabled=True" in done.stdout
    frozen = int(done.stdout.rsplit("frozen=", 1)[1].split()[0])
    assert frozen > 10_000  # without the freeze: 0
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "casckpt"]
    assert script.value == "casckpt.cli.main:main"


def test_restore_still_exports_with_torch(small_store: Path, tmp_path: Path) -> None:
    """The command that needs tensors still gets them (torch imported on demand)."""
    from safetensors.torch import load_file

    target = tmp_path / "out.safetensors"
    results = _commands_in_one_process(small_store, [["restore", f"{RUN}@2", "--to", str(target)]])
    assert results[0]["code"] == 0 and "torch" in results[0]["loaded"]  # type: ignore[operator]
    assert torch.equal(load_file(str(target))["w"], torch.full((8,), 2.0))


def test_open_of_a_current_store_runs_no_migration(small_store: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("open of a current catalog entered the migration path")

    monkeypatch.setattr(migrate, "upgrade_once", refuse)
    with casckpt.open(small_store, create=False) as store:
        assert [v.step for v in store.log(RUN)] == [2, 1, 0]


def test_open_of_a_new_store_still_migrates(tmp_path: Path) -> None:
    calls: list[str] = []
    upgrade_once = migrate.upgrade_once

    def counted(db: object, where: str) -> None:
        calls.append(where)
        upgrade_once(db, where)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(migrate, "upgrade_once", counted)
        with casckpt.open(tmp_path / "new") as store:
            store.commit({"x": torch.arange(4)}, run=RUN, step=0)
        assert len(calls) == 1
        with casckpt.open(tmp_path / "new", create=False) as store:
            assert torch.equal(store.restore(f"{RUN}@0")["x"], torch.arange(4))
        assert len(calls) == 1  # the second open found it current


def test_open_imports_no_alembic_in_a_fresh_process(small_store: Path) -> None:
    code = ("import sys, casckpt\n"
            f"casckpt.open({str(small_store)!r}, create=False).close()\n"
            "print(sorted(m for m in ('alembic', 'torch', 'botocore', 'transformers', 'accelerate', 'peft',\n"
            "                         'numpy', 'casckpt.engine.packlayer.packs', 'casckpt.format.manifest')\n"
            "             if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_shipped_head_is_alembics_head() -> None:
    """Open compares the catalog against the newest script by file name: every script must be
    named for its revision, each revising the one before, so that name is Alembic's head."""
    from alembic.script import ScriptDirectory

    scripts = {s.revision: s for s in ScriptDirectory.from_config(migrate._config()).walk_revisions()}
    for revision, script in scripts.items():
        assert script.path is not None
        name = Path(script.path).name
        match = migrate.SCRIPT_NAME.fullmatch(name)
        assert match is not None and match.group(1) == revision, \
            f"{name}: name migration scripts NNNN_what.py with revision = 'NNNN'"
        if script.down_revision is not None:
            assert int(str(script.down_revision)) == int(revision) - 1, name
    assert migrate.shipped_head() == migrate.head_revision()


def test_a_catalog_query_opens_no_index_cache(small_store: Path, tmp_path: Path) -> None:
    """The LMDB index cache opens on first use: a store opened to query its catalog never
    creates it; a commit (which looks chunks up in it) does."""
    cache = tmp_path / "cache"
    with casckpt.open(small_store, create=False, cache=cache) as store:
        assert [v.step for v in store.log(RUN)] == [2, 1, 0]
        store.show(f"{RUN}@1")
    assert not (cache / "index").exists()
    with casckpt.open(small_store, create=False, cache=cache) as store:
        assert torch.equal(store.restore(f"{RUN}@1")["w"], torch.full((8,), 1.0))
        store.commit({"w": torch.ones(8)}, run="cached", step=0)
    assert (cache / "index" / "data.mdb").is_file()


def test_a_long_log_streams_the_same_rows_as_the_table(small_store: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past LOG_TABLE_ROWS versions, `log` writes aligned lines instead of laying out a rich
    table (seconds for thousands of rows): the same columns, the same cells."""
    from typer.testing import CliRunner

    from casckpt.cli import render
    from casckpt.cli.main import app

    def rows(limit: int) -> list[list[str]]:
        monkeypatch.setattr(render, "LOG_TABLE_ROWS", limit)
        result = CliRunner().invoke(app, ["--store", str(small_store), "log", RUN])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert set(lines[1].strip()) == {"─"}
        return [line.split() for line in [lines[0], *lines[2:]]]

    table, streamed = rows(100), rows(1)
    assert streamed == table
    assert [r[2] for r in streamed[1:]] == ["2", "1", "0"]
