"""Mirrors: a failure keeps what the mirror sent, tags on versions gone at the destination are
reported exactly when the source's tag changed since the mirror carried it, dry runs and
generations leave failures alone, and the mirror errors pickle (review of the mirror fixes)."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.catalog import mirrors as mirror_sql
from casckpt.cli.main import app
from casckpt.errors import (
    CasckptError,
    MirrorDestinationError,
    MirrorsFailedError,
    RefNotFoundError,
    RunNotFoundError,
)
from casckpt.mirror_sending import Sending

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}


def commit(store: casckpt.Store, step: int, run: str = "ft", tags: tuple[str, ...] = ()) -> casckpt.Version:
    generator = torch.Generator().manual_seed(1000 + step)
    return store.commit({"w": torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=generator)},
                        run=run, step=step, tags=tags)


def steps(store: casckpt.Store, run: str = "ft") -> list[int]:
    return sorted(v.step for v in store.log(run))


def rows(store: casckpt.Store, name: str = "m") -> list[tuple[int, str]]:
    return sorted((o.step, o.state) for o in mirror_sql.outcomes(store._core.catalog, name))


@pytest.fixture
def src(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "src", **OPTS) as store:
        yield store


def _fail_once(monkeypatch: pytest.MonkeyPatch, store: casckpt.Store) -> casckpt.MirrorReport:
    """Run mirror m once with every copy failing (the destination busy, say)."""
    def busy(self: Sending, refs: list[str]) -> Any:
        raise CasckptError("transient: destination busy")
    with monkeypatch.context() as patch:
        patch.setattr(Sending, "_copy", busy)
        return store.mirrors.push("m")


# -- a failure keeps what the mirror sent ----------------------------------------------------


def test_a_failure_to_send_again_keeps_what_the_mirror_sent_so_deletions_still_propagate(
        src: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1, propagate_deletions=True)
    assert [v.status for v in src.mirrors.push("m").versions] == ["sent", "sent"]
    assert [v.status for v in _fail_once(monkeypatch, src).versions] == ["failed", "failed"]
    src.delete("ft@1")
    report = src.mirrors.push("m")
    assert [(v.step, v.status) for v in report.versions] == [(2, "present"), (1, "deleted")]
    assert rows(src) == [(1, "deleted"), (2, "sent")]  # still the mirror's own, both
    info = src.mirrors.get("m")
    assert info.failed == () and info.versions_sent == 1
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [2]


def test_a_failure_the_selection_dropped_is_sent_again_when_the_mirror_had_sent_it(
        src: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2):
        commit(src, step, tags=("best",))
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], tags=["best"])
    src.mirrors.push("m")
    _fail_once(monkeypatch, src)
    src.tag("ft@1", "best")  # ft@2 is no longer selected: its failure no longer matters
    src.mirrors.push("m")
    assert rows(src) == [(1, "sent"), (2, "sent")]  # not "unselected": the destination holds it
    assert src.mirrors.get("m").failed == ()


# -- dry runs and generations leave failures alone -------------------------------------------


def _diverged(src: casckpt.Store, dst: Path) -> None:
    """a@1, a@2 (best), b@1 here; a is a line of its own at ``dst``, so a@2 fails there."""
    for step in (1, 2):
        commit(src, step, run="a", tags=("best",) if step == 2 else ())
    commit(src, 1, run="b")
    with casckpt.open(dst, **OPTS) as d:
        d.commit({"w": torch.zeros(8)}, run="a", step=2)
    src.mirrors.add("m", str(dst), runs=["a", "b"], tags=["best"])
    assert [(v.run, v.step, v.status) for v in src.mirrors.push("m").versions] == [("a", 2, "failed")]


def test_a_dry_run_leaves_failures_no_longer_selected_as_they_are(src: casckpt.Store, tmp_path: Path) -> None:
    _diverged(src, tmp_path / "dst")
    src.tag("b@1", "best")
    src.mirrors.push("m", dry_run=True)
    assert [(f.run, f.step) for f in src.mirrors.get("m").failed] == [("a", 2)]
    src.mirrors.push("m")
    assert src.mirrors.get("m").failed == ()


def test_retiring_failures_for_another_generation_of_the_mirror_changes_nothing(
        src: casckpt.Store, tmp_path: Path) -> None:
    _diverged(src, tmp_path / "dst")
    catalog = src._core.catalog
    [row] = mirror_sql.mirrors(catalog, "m")
    assert mirror_sql.unselect_failures(catalog, "m", row.created_at + 1.0, set()) == 0  # a removed one's run
    assert [(f.run, f.step) for f in src.mirrors.get("m").failed] == [("a", 2)]
    assert mirror_sql.unselect_failures(catalog, "m", row.created_at, set()) == 1
    assert src.mirrors.get("m").failed == ()


# -- tags on versions gone at the destination ------------------------------------------------


def _run_cli(tmp_path: Path) -> Any:
    return CliRunner().invoke(app, ["--store", str(tmp_path / "src"), "mirror", "run", "m"])


def test_a_tag_the_destination_owner_moved_there_is_not_reported(src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2):
        commit(src, step, tags=("best",) if step == 1 else ())
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("m")
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # their own choice there
        dst.tag("ft@2", "best")
        dst.delete("ft@1")
    assert src.mirrors.push("m").stale_tags == ()
    shown = _run_cli(tmp_path)
    assert shown.exit_code == 0, shown.stdout


def test_a_tag_moved_here_onto_a_gone_version_is_reported_until_moved_here_whatever_the_destination_tags(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step, tags=("best",) if step == 3 else ())
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("m")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        dst.delete("ft@1")
    src.tag("ft@1", "best")
    assert src.mirrors.push("m").stale_tags == ("best",)
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # another version tagged there: not it
        dst.tag("ft@2", "best")
    report = src.mirrors.push("m")
    assert report.stale_tags == ("best",)
    [why] = [r for r in report.versions[0].reasons if "tag best" in r]
    assert "ft@2" in why and "undelete ft@1 there" in why and "move or remove the tag here" in why
    src.tag("ft@3", "best")  # moved here onto a version there: carried, and cleared
    again = src.mirrors.push("m")
    assert again.stale_tags == () and again.tags == ("best",)
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert dst.resolve("tag:best").step == 3


def test_a_new_tag_here_on_a_gone_version_is_reported_with_a_readable_summary(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("m")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        dst.delete("ft@1")
    src.tag("ft@1", "release")
    shown = _run_cli(tmp_path)
    assert shown.exit_code == 1 and "release" in shown.stdout
    summary = " ".join(shown.stdout.split())
    assert "no version to send" in summary and "sent 0 version(s)" not in summary
    assert "undelete the version there" in summary and "move or remove the tag here" in summary


def test_a_tag_whose_destination_tag_names_a_deleted_version_is_reported_once_it_changed_here(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step, tags=("best",) if step == 1 else ())
    commit(src, 4, tags=("other",))
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("m")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        dst.delete("ft@1")
        dst.delete("ft@4")
    assert src.mirrors.push("m").stale_tags == ()  # carried as they are: the destination's business
    src.tag("ft@4", "best")
    report = src.mirrors.push("m")
    assert report.stale_tags == ("best",)
    assert any("tag best" in r for v in report.versions if v.step == 4 for r in v.reasons)


# -- errors cross processes ------------------------------------------------------------------


def test_the_mirror_errors_survive_a_pickle_round_trip(src: casckpt.Store, tmp_path: Path) -> None:
    commit(src, 1)
    (tmp_path / "file").write_text("not a directory")
    src.mirrors.add("bad", str(tmp_path / "file" / "a"), runs=["ft"], keep_last=1)
    src.mirrors.add("good", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    with pytest.raises(MirrorsFailedError) as raised:
        src.mirrors.push_all()
    back = pickle.loads(pickle.dumps(raised.value))
    assert type(back) is MirrorsFailedError and str(back) == str(raised.value)
    assert [r.mirror for r in back.reports] == ["good"] and list(back.errors) == ["bad"]
    assert isinstance(back.errors["bad"], MirrorDestinationError)
    with pytest.raises(RefNotFoundError) as missing:
        src.resolve("ft@9")
    others = (RefNotFoundError("x", "no such thing", ["y"]), RunNotFoundError("nope", ["ft"]))
    for error in (missing.value, *others):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.__dict__ == error.__dict__


def test_propagation_never_deletes_what_a_replaced_destination_got_otherwise(tmp_path: Path) -> None:
    """The destination wiped and made again: what the mirror sent into the old store is not its
    own in the new one, so a version the new store's owner copied in by hand stays there when
    the source deletes it (final review of issue 34: the rows kept state `sent`)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    with casckpt.open(src, **OPTS) as store:
        v1, _ = commit(store, 1, run="r"), commit(store, 2, run="r")
        store.mirrors.add("m", str(dst), runs=["r"], keep_every=1, propagate_deletions=True)
        assert [v.status for v in store.mirrors.push("m").versions] == ["sent", "sent"]
    shutil.rmtree(dst)
    with casckpt.open(src, create=False) as store:
        store.copy(v1.id, to=str(dst))  # the new store's owner copies ft@1 by hand
        store.delete(v1.id, reason="at the source")
        report = store.mirrors.push("m")
        assert "deleted" not in [v.status for v in report.versions]
    with casckpt.open(dst, create=False) as there:
        assert there.resolve(v1.id).step == 1


def test_an_upgraded_gone_row_is_not_the_mirrors_own(tmp_path: Path) -> None:
    """Before 0019 a version the mirror found present and later gone there was recorded `gone`,
    like one it sent: the upgrade cannot tell them apart and takes neither as its own, so a
    deletion here never deletes the destination owner's version there."""
    from alembic import command
    from sqlalchemy import create_engine

    from casckpt.catalog.migrate import _config

    src, dst = tmp_path / "src", tmp_path / "dst"
    with casckpt.open(src, **OPTS) as store:
        version = commit(store, 1, run="r")
        store.copy(version.id, to=str(dst))  # the destination's owner copied it by hand
        store.mirrors.add("m", str(dst), runs=["r"], keep_last=1, propagate_deletions=True)
        assert [v.status for v in store.mirrors.push("m").versions] == ["present"]
    with casckpt.open(dst, create=False) as there:
        there.delete(version.id, reason="its owner")
    with casckpt.open(src, create=False) as store:
        assert [v.status for v in store.mirrors.push("m").versions] == ["gone"]
    engine = create_engine(f"sqlite:///{src / 'catalog.db'}")
    with engine.connect() as conn:
        command.downgrade(_config(conn), "0018")
        conn.commit()
    engine.dispose()
    with casckpt.open(src, create=False) as store:  # upgraded again on open
        rows = mirror_sql.outcomes(store._core.catalog, "m")
        assert [(o.state, o.owned) for o in rows] == [("gone", False)]
    with casckpt.open(dst, create=False) as there:
        there.undelete(version.id)  # the owner takes it back
    with casckpt.open(src, create=False) as store:
        store.mirrors.push("m")
        store.delete(version.id, reason="at the source")
        store.mirrors.push("m")
    with casckpt.open(dst, create=False) as there:
        assert there.resolve(version.id).step == 1
