"""``store.mirrors``: what a run and the status report -- only the failures that still matter,
a tag the run cannot move, a dry run's deletions, and every mirror's report when
``push_all`` meets a destination it cannot open.

Every store is real (SQLite catalogs, local directories).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import MirrorDestinationError, MirrorsFailedError

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}


def commit(store: casckpt.Store, step: int, run: str = "ft", tags: tuple[str, ...] = ()) -> casckpt.Version:
    generator = torch.Generator().manual_seed(1000 + step)
    return store.commit({"w": torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=generator)},
                        run=run, step=step, tags=tags)


def steps(store: casckpt.Store, run: str = "ft") -> list[int]:
    return sorted(v.step for v in store.log(run))


@pytest.fixture
def src(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "src", **OPTS) as store:
        yield store


def _diverged(src: casckpt.Store, dst: Path) -> None:
    """a@1, a@2, b@1 here; run a a line of its own at ``dst``, so a's versions fail there."""
    for step in (1, 2):
        commit(src, step, run="a", tags=("best",) if step == 2 else ())
    commit(src, 1, run="b")
    with casckpt.open(dst, **OPTS) as d:
        d.commit({"w": torch.zeros(8)}, run="a", step=2)


def test_status_shows_only_the_failures_of_versions_still_selected(
        src: casckpt.Store, tmp_path: Path) -> None:
    _diverged(src, tmp_path / "dst")
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["a", "b"], tags=["best"])
    assert [(v.run, v.step, v.status) for v in src.mirrors.push("m").versions] == [("a", 2, "failed")]
    assert [(f.run, f.step) for f in src.mirrors.get("m").failed] == [("a", 2)]
    src.tag("b@1", "best")  # a@2 is no longer selected: its old failure no longer matters
    moved = src.mirrors.push("m")
    assert [(v.run, v.step, v.status) for v in moved.versions] == [("b", 1, "sent")]
    info = src.mirrors.get("m")
    assert info.failed == () and info.versions_sent == 1
    [listed] = src.mirrors.list()
    assert listed.failed == ()
    shown = CliRunner().invoke(app, ["--store", str(tmp_path / "src"), "mirror", "status", "--json"])
    assert json.loads(shown.stdout)[0]["failed"] == []
    src.tag("a@2", "best")  # selected again: it fails again, and shows again
    assert src.mirrors.push("m").failed
    assert [(f.run, f.step) for f in src.mirrors.get("m").failed] == [("a", 2)]


def test_a_failed_version_deleted_here_leaves_the_status_even_if_the_destination_is_down(
        src: casckpt.Store, tmp_path: Path) -> None:
    _diverged(src, tmp_path / "dst")
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["a"], keep_every=1)
    assert len(src.mirrors.push("m").failed) == 2
    src.delete("a@1")
    (tmp_path / "dst").rename(tmp_path / "away")
    (tmp_path / "dst").write_text("not a store")  # the destination cannot be opened now
    with pytest.raises(MirrorDestinationError):
        src.mirrors.push("m")
    info = src.mirrors.get("m")  # a@2 is still selected and not there: it still matters
    assert [(f.run, f.step) for f in info.failed] == [("a", 2)] and info.last_error is not None


def test_a_tag_moved_onto_a_version_gone_there_is_reported_not_left_silently(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step, tags=("best",) if step == 3 else ())
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("m")
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # its own retention, say
        dst.delete("ft@1")
    src.tag("ft@1", "best")
    report = src.mirrors.push("m")
    assert [(v.step, v.status) for v in report.versions] == [(1, "gone"), (2, "present"), (3, "present")]
    assert report.stale_tags == ("best",) and not report.nothing_sent
    assert any("tag best" in r and "ft@3" in r for r in report.versions[0].reasons)
    shown = CliRunner().invoke(app, ["--store", str(tmp_path / "src"), "mirror", "run", "m"])
    assert shown.exit_code == 1 and "best" in shown.stdout and "gone" in shown.stdout
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # undeleted there: the next run moves it
        dst.undelete("ft@1")
    again = src.mirrors.push("m")
    assert again.stale_tags == () and again.tags == ("best",)
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert dst.resolve("tag:best").step == 1


def test_a_dry_run_says_would_delete_and_deletes_nothing(src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1, propagate_deletions=True)
    src.mirrors.push("m")
    src.delete("ft@1")
    dry = src.mirrors.push("m", dry_run=True)
    assert [(v.step, v.status) for v in dry.versions] == [(2, "present"), (1, "would delete")]
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1, 2]
    assert [(v.step, v.status) for v in src.mirrors.push("m").versions] == [(2, "present"), (1, "deleted")]
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [2]


def test_push_all_gives_every_report_and_every_error(src: casckpt.Store, tmp_path: Path) -> None:
    commit(src, 1)
    (tmp_path / "file").write_text("not a directory")
    src.mirrors.add("a-bad", str(tmp_path / "file" / "a"), runs=["ft"], keep_last=1)
    src.mirrors.add("b-good", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    src.mirrors.add("c-bad", str(tmp_path / "file" / "c"), runs=["ft"], keep_last=1)
    with pytest.raises(MirrorsFailedError, match="2 of 3 mirrors") as raised:
        src.mirrors.push_all()
    failed = raised.value
    assert isinstance(failed, MirrorDestinationError)  # what push_all raised before: still caught
    assert [r.mirror for r in failed.reports] == ["b-good"]
    assert [(v.step, v.status) for v in failed.reports[0].versions] == [(1, "sent")]
    assert list(failed.errors) == ["a-bad", "c-bad"]
    assert all(isinstance(e, MirrorDestinationError) and "could not be opened" in str(e)
               for e in failed.errors.values())
