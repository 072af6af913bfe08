"""``Store.copy``: what the review of the copy fixes found -- a copy's report, progress, tag
records and tree node rows stay true when a location is down, the destination's gc runs
mid-copy, a publish fails, or the copy goes across keys.

Real stores (SQLite catalogs, local directories) as in test_copy.py; each test fails on the
code before its fix (named in its docstring)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import test_copyplan
import torch
from test_copy import OPTS, _key, _spread, assert_same, commit_run

import casckpt
from casckpt.engine.copying import copy as copy_engine
from casckpt.errors import CatalogError


@pytest.fixture
def src(tmp_path: Path) -> Any:
    with casckpt.open(tmp_path / "src", **OPTS) as store:
        yield store


@pytest.fixture
def dst(tmp_path: Path) -> Any:
    with casckpt.open(tmp_path / "dst", **OPTS) as store:
        yield store
        assert store.ops.check(read_data=True).ok


def test_chunks_sent_again_are_counted_in_the_progress(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline.resend packed with Progress(None, ...): the user's callback never saw them."""
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        commit_run(src, range(1, 3))
        src.copy("ft@1", to=dst)
        dst.delete("ft@1")
        real = copy_engine.plan_batches

        def plan_then_sweep(*args: Any, **kwargs: Any) -> Any:
            planned = real(*args, **kwargs)
            if not swept:
                swept.append(dst.gc(grace=0).versions_purged + dst.gc(grace=0).versions_purged)
            return planned

        swept: list[int] = []
        monkeypatch.setattr(copy_engine, "plan_batches", plan_then_sweep)
        seen: list[tuple[int, int]] = []
        report = src.copy("ft@2", to=dst, progress=lambda _phase, done, total: seen.append((done, total)))
        assert swept == [1] and [(v.step, v.sent) for v in report.versions] == [(2, True)]
        assert seen[-1][0] == report.bytes and all(done <= total for done, total in seen)
        assert dst.ops.check(read_data=True).ok


def test_a_location_down_neither_rewrites_tag_records_nor_warns_for_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each copy carrying tags of versions already there read the record on the down
    location, failed, and wrote every record again everywhere, warning per tag and copy."""
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit_run(src, range(1, 4))
        for step in (1, 3):
            src.tag(f"ft@{step}", f"t{step}")
        with _spread(tmp_path / "dst") as dst:
            src.copy("ft@3", to=dst)
        shutil.rmtree(tmp_path / "disk1")
        before = {p: p.read_bytes() for p in (tmp_path / "disk0" / "refs" / "tags").iterdir()}
        with _spread(tmp_path / "dst") as dst:
            for _ in range(2):
                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    assert src.copy("ft@3", to=dst).nothing_sent
                refs = [r.getMessage() for r in caplog.records if "refs/tags" in r.getMessage()]
                assert refs == []
                once = [r for r in caplog.records if "could not be read or written" in r.getMessage()]
                assert len(once) == 1 and "loc1" in once[0].getMessage()
        assert {p: p.read_bytes() for p in (tmp_path / "disk0" / "refs" / "tags").iterdir()} == before


def test_a_failed_publish_leaves_no_tag_record_disagreeing_with_the_catalog(
        src: casckpt.Store, dst: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy found tag best absent and wrote its record before the publish, which failed:
    the record outlived it (a later copy publishing ft@2 without the tag left it, and a
    rebuild brought the tag back). And should the user set best at the destination meanwhile,
    the record named the unpublished version, newer than the user's, disagreeing with the
    catalog (a rebuild lost the tag)."""
    commit_run(src, range(1, 3))
    src.copy("ft@1", to=dst)
    real_record, real_publish = copy_engine.records.record_tag, copy_engine._publish
    race: list[str] = []

    def user_tags_first(*args: Any, **kwargs: Any) -> Any:
        if race == ["armed"]:
            race.append("raced")
            dst.tag("ft@1", "best")  # its record, then the copy's, newer
        return real_record(*args, **kwargs)

    def publish_fails(*args: Any, **kwargs: Any) -> Any:
        raise CatalogError("the destination's catalog refused the publish")

    monkeypatch.setattr(copy_engine.records, "record_tag", user_tags_first)
    monkeypatch.setattr(copy_engine, "_publish", publish_fails)
    with pytest.raises(CatalogError, match="refused the publish"):
        src.copy("ft@2", to=dst)
    tags = tmp_path / "dst" / "refs" / "tags"
    assert not (tags.exists() and list(tags.iterdir()))  # no record of a tag the catalog lacks
    race.append("armed")
    with pytest.raises(CatalogError, match="refused the publish"):
        src.copy("ft@2", to=dst)
    assert race[-1] == "raced" and dst.resolve("tag:best").step == 1
    assert dst.ops.check().ok  # the record says what the catalog says
    monkeypatch.setattr(copy_engine, "_publish", real_publish)
    src.copy("ft@2", to=dst)
    assert dst.resolve("tag:best").step == 2


def test_tree_nodes_the_destinations_gc_purged_after_the_plan_get_their_rows_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """r@2 shares tree nodes with r@1, deleted at the destination: their rows were there when
    the copy planned, purged by its gc before the publish; the nodes were sent again but
    their rows not added back (the plan held only the nodes it expected to need)."""
    with casckpt.open(tmp_path / "src", **test_copyplan.OPTS) as src, \
            casckpt.open(tmp_path / "dst", **test_copyplan.OPTS) as dst:
        for step in (1, 2):
            src.commit(test_copyplan.state(step), run="r", step=step)
        src.copy("r@1", to=dst)
        dst.delete("r@1")
        real = copy_engine.plan_batches
        swept: list[int] = []

        def plan_then_sweep(*args: Any, **kwargs: Any) -> Any:
            planned = real(*args, **kwargs)
            if not swept:
                swept.append(dst.gc(grace=0).versions_purged + dst.gc(grace=0).versions_purged)
            return planned

        monkeypatch.setattr(copy_engine, "plan_batches", plan_then_sweep)
        report = src.copy("r@2", to=dst)
        assert swept == [1] and [(v.step, v.sent) for v in report.versions] == [(2, True)]
        assert dst.ops.check(read_data=True).ok
        got, want = dst.restore("r@2"), test_copyplan.state(2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()
                                                 if isinstance(v, torch.Tensor))


def test_a_copy_across_keys_reports_its_degraded_packs(tmp_path: Path) -> None:
    """rekey.execute never counted the packs each commit stored below their redundancy."""
    key = _key(tmp_path / "key")
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit_run(src, range(1, 3))
        with casckpt.open(tmp_path / "dst", blobs=[str(tmp_path / f"disk{i}") for i in range(6)],
                          redundancy="ec:4+2", key_file=key, **OPTS) as dst:
            assert src.copy("ft@1", to=dst).degraded_packs == 0
            shutil.rmtree(tmp_path / "disk1")
            report = src.copy("ft@2", to=dst)
            assert [(v.step, v.sent) for v in report.versions] == [(2, True)]
            assert report.degraded_packs > 0 and dst.show("ft@2").degraded
            assert_same(dst.restore("ft@2"), 2)

