"""Creating a store is atomic: everyone opening a new path at once gets the same store.

Four processes with four threads each (as on four hosts, four ranks each)
open the same new path at the same moment, for several rounds; each round
every opener must succeed, see the same catalog store id, and commit its own
step, and the store must end with one config file and every step.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import casckpt
from casckpt import config as cfg
from casckpt.catalog import Catalog
from casckpt.errors import NotAStoreError
from casckpt.testing.internals import internals

HELPER = Path(__file__).parent / "helpers" / "creator.py"
PROCESSES, THREADS, ROUNDS = 4, 4, 2


class Creators:
    """The helper processes, each serving rounds (see tests/helpers/creator.py)."""

    def __init__(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, str(HELPER), str(w)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
                      for w in range(PROCESSES)]

    def _line(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"a creator process died (exit {proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def round(self, root: Path, go: Path, how: str = "open", **kwargs: Any) -> list[dict[str, Any]]:
        """All processes open ``root`` at once; returns each one's report."""
        job = json.dumps({"root": str(root), "go": str(go), "threads": THREADS, "how": how,
                          "kwargs": kwargs})
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(job + "\n")
            proc.stdin.flush()
        for proc in self.procs:
            assert self._line(proc) == {"ready": True}
        go.touch()
        return [self._line(proc) for proc in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture(scope="module")
def creators() -> Iterator[Creators]:
    procs = Creators()
    try:
        yield procs
    finally:
        procs.close()


def _assert_one_store(root: Path, reports: list[dict[str, Any]]) -> None:
    errors = [e for r in reports for e in r["errors"]]
    assert not errors, f"{len(errors)} of {PROCESSES * THREADS} opens failed:\n" + "\n".join(errors[:3])
    ids = {i for r in reports for i in r["store_ids"]}
    assert len(ids) == 1, f"openers saw different stores: {ids}"
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(f".{cfg.CONFIG_FILE}")]
    assert not leftovers, f"temporary config files left behind: {leftovers}"
    with casckpt.open(root, create=False) as store:
        assert internals(store).catalog.store_id in ids
        assert sorted(v.step for v in store.log("r")) == list(range(PROCESSES * THREADS))
        report = store.ops.check()
        assert report.ok, report.problems[:5]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["default", "blobs"])
def test_processes_and_threads_creating_one_store_at_once(
        creators: Creators, tmp_path: Path, layout: str) -> None:
    for i in range(ROUNDS):
        root = tmp_path / f"store{i}" / "nested"  # the parents are new too
        kwargs = {"blobs": str(tmp_path / f"blobs{i}")} if layout == "blobs" else {}
        reports = creators.round(root, tmp_path / f"go{i}", **kwargs)
        _assert_one_store(root, reports)


@pytest.mark.slow
def test_creating_one_store_with_a_postgres_catalog_at_once(
        creators: Creators, tmp_path: Path, new_pg_url: Callable[[], str]) -> None:
    for i in range(ROUNDS):
        root = tmp_path / f"store{i}"
        url = new_pg_url()
        reports = creators.round(root, tmp_path / f"go{i}", catalog=url, redundancy="none")
        _assert_one_store(root, reports)
        assert cfg.read_config_file(root / cfg.CONFIG_FILE)["store"]["catalog"] == url


def test_threads_registering_a_new_store_in_a_migrated_postgres_catalog_at_once(
        tmp_path: Path, new_pg_url: Callable[[], str]) -> None:
    """Past the (serialised) migration, openers race to register locations and redundancy."""
    def open_it(root: Path, url: str, barrier: threading.Barrier, errors: list[BaseException]) -> None:
        barrier.wait()
        try:
            casckpt.open(root, catalog=url, redundancy="none").close()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    for i in range(ROUNDS):
        root, url = tmp_path / f"store{i}", new_pg_url()
        Catalog(url, where="test").close()  # as `casckpt migrate` leaves a database
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=open_it, args=(root, url, barrier, errors)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, f"{len(errors)} of 8 opens failed, e.g. {errors[0]!r}"
        with casckpt.open(root, create=False) as store:
            assert [loc.name for loc in store.locations.list()] == ["loc0"]
            assert store.locations.redundancy() == "none"


@pytest.mark.slow
def test_cli_init_of_one_store_at_once(creators: Creators, tmp_path: Path) -> None:
    for i in range(ROUNDS):
        root = tmp_path / f"store{i}"
        reports = creators.round(root, tmp_path / f"go{i}", how="init")
        _assert_one_store(root, reports)


def test_an_empty_directory_left_by_a_crashed_creator_still_becomes_a_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / f".{cfg.CONFIG_FILE}.1234.5678.tmp").write_text("[store]\n")  # killed mid-write
    with casckpt.open(root) as store:
        store.commit({"a": 1}, run="r", step=0)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_a_directory_with_other_files_is_still_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(casckpt.errors.NotAStoreError, match="is not empty"):
        casckpt.open(root)
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_creating_a_store_says_so_and_create_false_refuses_a_mistyped_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def creations() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("created a new casckpt store")]

    caplog.set_level(logging.WARNING, logger="casckpt")
    monkeypatch.chdir(tmp_path)
    with casckpt.open("store") as made:
        assert made.created
    [record] = creations()
    assert record.levelno == logging.WARNING and record.name == "casckpt.opening"
    assert f"at {tmp_path / 'store'};" in record.getMessage()  # the absolute path
    assert "create=False" in record.getMessage()
    caplog.clear()
    with casckpt.open("store", create=False) as reopened:
        assert not reopened.created
    with pytest.raises(NotAStoreError, match="no casckpt store"):
        casckpt.open("stroe", create=False)  # the typo of a restarted job: refused, not created
    assert not (tmp_path / "stroe").exists() and not creations()

    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    with casckpt.open(blobs=str(tmp_path / "blobs"), catalog=catalog) as by_urls:
        assert by_urls.created
    assert len(creations()) == 1 and "catalog.db" in creations()[0].getMessage()
    with casckpt.open(blobs=str(tmp_path / "blobs"), catalog=catalog) as again:
        assert not again.created
    assert len(creations()) == 1
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    init = CliRunner().invoke(app, ["init", str(tmp_path / "by-init")])
    assert init.exit_code == 0 and "Created an empty casckpt store" in init.stdout
    assert "warning" not in init.stderr  # init says so itself; the record is still logged
    assert str(tmp_path / "by-init") in creations()[-1].getMessage()
