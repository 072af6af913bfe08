"""``store.mirrors``: a mirror sends exactly the versions its selection picks, a run again sends
nothing, tags that move here move there, deletions stay here unless asked, and what was sent
or failed is recorded in the source's catalog.

Every store is real (SQLite catalogs, local directories); versions are restored from the
destination alone, the source's directory deleted first.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import InvalidArgumentError, InvalidNameError, MirrorDestinationError, RefNotFoundError
from casckpt.mirror_rules import make_selection

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}


def state(step: int) -> dict[str, Any]:
    """A shared frozen part, a part new at each step, plain values."""
    frozen = torch.Generator().manual_seed(7)
    new = torch.Generator().manual_seed(1000 + step)
    return {"frozen": torch.randn(4096, generator=frozen),
            "head": torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=new), "step": step}


def commit(store: casckpt.Store, step: int, run: str = "ft", tags: tuple[str, ...] = ()) -> casckpt.Version:
    return store.commit(state(step), run=run, step=step, metrics={"loss": 1.0 / step}, tags=tags)


def assert_same(got: dict[str, Any], step: int) -> None:
    want = state(step)
    assert got.keys() == want.keys() and got["step"] == step
    assert torch.equal(got["frozen"], want["frozen"]) and torch.equal(got["head"], want["head"])


def steps(store: casckpt.Store, run: str = "ft") -> list[int]:
    return sorted(v.step for v in store.log(run))


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and p.parts[len(root.parts)] in {"packs", "manifests", "refs"}}


@pytest.fixture
def src(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "src", **OPTS) as store:
        yield store


def wait_for(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_run_sends_exactly_the_selected_versions_which_restore_without_the_source(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in range(1, 8):
        commit(src, step, tags=("best",) if step == 2 else ())
    # every 3rd step's first version (1, 3, 6), the latest (7), the one tagged best (2)
    src.mirrors.add("arch", str(tmp_path / "dst"), runs=["f*"], tags=["best"], keep_every=3, keep_last=1)
    dry = src.mirrors.push("arch", dry_run=True)
    assert [(v.step, v.status) for v in dry.versions] == [(s, "would send") for s in (1, 2, 3, 6, 7)]
    assert not (tmp_path / "dst").exists()  # a dry run makes no store

    report = src.mirrors.push("arch")
    assert [(v.step, v.status) for v in report.versions] == [(s, "sent") for s in (1, 2, 3, 6, 7)]
    assert dict((v.step, v.reasons) for v in report.versions)[2] == ("tag best",)
    assert report.tags == ("best",) and report.bytes > 0 and not report.failed
    info = src.mirrors.get("arch")
    assert (info.versions_sent, info.bytes_sent, info.failed, info.last_error) == (5, report.bytes, (), None)
    assert info.last_run_at is not None and info.last_finished_at is not None
    ids = {v.step: v.id for v in src.log("ft")}
    src.close()
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert {v.step: v.id for v in dst.log("ft")} == {s: ids[s] for s in (1, 2, 3, 6, 7)}  # no lineage
        assert dst.resolve("tag:best").step == 2
        for step in (1, 2, 3, 6, 7):
            assert_same(dst.restore(f"ft@{step}"), step)
        assert dst.ops.check(read_data=True).ok


def test_a_second_run_sends_nothing(src: casckpt.Store, tmp_path: Path) -> None:
    for step in range(1, 4):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=2)
    assert not src.mirrors.push("m").nothing_sent
    before = files(tmp_path / "dst")
    again = src.mirrors.push("m")
    assert again.nothing_sent and again.chunks == 0 and again.bytes == 0
    assert [v.status for v in again.versions] == ["present", "present"]
    assert files(tmp_path / "dst") == before
    assert src.mirrors.get("m").versions_sent == 2


def test_a_tag_moved_here_moves_there_at_the_next_run_and_nothing_is_deleted_there(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in range(1, 5):
        commit(src, step, tags=("best",) if step == 1 else ())
    src.mirrors.add("best", str(tmp_path / "dst"), runs=["ft"], tags=["best"])
    src.mirrors.push("best")
    src.tag("ft@3", "best")
    moved = src.mirrors.push("best")
    assert [(v.step, v.status) for v in moved.versions] == [(3, "sent")] and moved.tags == ("best",)
    src.tag("ft@1", "best")  # back onto a version the destination holds
    back = src.mirrors.push("best")
    assert [(v.step, v.status) for v in back.versions] == [(1, "present")] and back.tags == ("best",)
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert dst.resolve("tag:best").step == 1
        assert steps(dst) == [1, 3]  # 3, no longer tagged here, stays there


def test_deletions_do_not_propagate_unless_asked(src: casckpt.Store, tmp_path: Path) -> None:
    for step in range(1, 4):
        commit(src, step)
    src.mirrors.add("keep", str(tmp_path / "a"), runs=["ft"], keep_every=1)
    src.mirrors.add("prune", str(tmp_path / "b"), runs=["ft"], keep_every=1, propagate_deletions=True)
    assert src.mirrors.get("prune").propagate_deletions
    src.mirrors.push_all()
    src.delete("ft@2")
    kept, pruned = src.mirrors.push_all()
    assert [(v.step, v.status) for v in kept.versions] == [(1, "present"), (3, "present")]
    assert [(v.step, v.status) for v in pruned.versions] == [(1, "present"), (3, "present"), (2, "deleted")]
    with casckpt.open(tmp_path / "a", create=False) as a, casckpt.open(tmp_path / "b", create=False) as b:
        assert steps(a) == [1, 2, 3] and steps(b) == [1, 3]
        assert b.undelete("ft@2").step == 2  # a soft delete there, as any: its gc reclaims it
    assert src.mirrors.get("prune").versions_sent == 2


def test_a_failed_version_is_recorded_and_stops_no_other(src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2):
        commit(src, step, run="a")
        commit(src, step, run="b")
    with casckpt.open(tmp_path / "dst", **OPTS) as dst:  # the runs diverged there at a@2
        dst.commit({"w": torch.zeros(8)}, run="a", step=2)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["a", "b"], keep_every=1)
    report = src.mirrors.push("m")
    assert [(v.run, v.step, v.status) for v in report.versions] == [  # a is a line of its own there
        ("a", 1, "failed"), ("a", 2, "failed"), ("b", 1, "sent"), ("b", 2, "sent")]
    first, second = report.failed
    assert first.error is not None and "CopyConflictError" in first.error and "line of its own" in first.error
    assert second.error is not None and "diverged" in second.error
    info = src.mirrors.get("m")
    assert info.versions_sent == 2 and info.last_error is None
    assert [(f.run, f.step) for f in info.failed] == [("a", 1), ("a", 2)]
    assert src.mirrors.push("m").failed  # still diverged: failed again, recorded once
    assert len(src.mirrors.get("m").failed) == 2


def test_an_unreachable_destination_is_a_typed_error_recorded_on_the_mirror(
        src: casckpt.Store, tmp_path: Path) -> None:
    commit(src, 1)
    (tmp_path / "file").write_text("not a directory")
    src.mirrors.add("bad", str(tmp_path / "file" / "store"), runs=["ft"], keep_last=1)
    src.mirrors.add("good", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    with pytest.raises(MirrorDestinationError, match="could not be opened.*casckpt mirror run bad"):
        src.mirrors.push("bad")
    with pytest.raises(MirrorDestinationError):  # the others run all the same
        src.mirrors.push_all()
    bad, good = src.mirrors.list()
    assert bad.last_error is not None and "could not be opened" in bad.last_error and bad.versions_sent == 0
    assert good.last_error is None and good.versions_sent == 1


def test_the_background_form_runs_on_wake_and_after_commits_and_stops_on_close(tmp_path: Path) -> None:
    store = casckpt.open(tmp_path / "src", **OPTS)
    commit(store, 1)
    store.mirrors.add("hot", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    worker = store.mirrors.start("hot", interval=3600, poll=None)
    wait_for(lambda: worker.runs >= 1)
    assert worker.last_error is None and worker.last_report is not None
    commit(store, 2)
    time.sleep(0.3)
    assert worker.runs == 1  # no poll: the commit alone does not wake it
    worker.wake()
    wait_for(lambda: worker.runs >= 2)
    assert [(v.step, v.status) for v in worker.last_report.versions] == [(2, "sent")]
    worker.stop()
    assert not worker.is_alive()

    polling = store.mirrors.start("hot", interval=3600, poll=0.05)
    wait_for(lambda: polling.runs >= 1)
    store.commit(state(3), run="ft", step=3, block=False)  # a background commit, no wake
    wait_for(lambda: store.mirrors.get("hot").versions_sent == 3)
    store.close()
    assert not polling.is_alive()
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1, 2, 3]


def test_adding_listing_and_removing_and_their_refusals(src: casckpt.Store, tmp_path: Path) -> None:
    src.mirrors.add("m", "relative-dst", runs=["ft"], keep_best=("loss", 1, "min"))
    info = src.mirrors.get("m")
    assert Path(info.destination).is_absolute() and info.selection.rules.keep_best == ("loss", 1, "min")
    assert info.selection.describe() == "--run ft --keep-best loss:1:min"
    with pytest.raises(InvalidArgumentError, match="exists"):
        src.mirrors.add("m", str(tmp_path / "x"), runs=["ft"], keep_last=1)
    with pytest.raises(InvalidNameError):
        src.mirrors.add("a/b", str(tmp_path / "x"), runs=["ft"], keep_last=1)
    with pytest.raises(InvalidArgumentError, match="something to send"):
        src.mirrors.add("n", str(tmp_path / "x"), runs=["ft"])
    with pytest.raises(InvalidArgumentError, match="at least one run"):
        src.mirrors.add("n", str(tmp_path / "x"), runs=[], keep_last=1)
    with pytest.raises(InvalidArgumentError, match="no rule keep_forever"):
        src.mirrors.add("n", str(tmp_path / "x"), runs=["ft"], keep_forever=1)
    with pytest.raises(InvalidArgumentError):
        src.mirrors.start("m", interval=0)
    with pytest.raises(InvalidArgumentError, match="poll"):
        src.mirrors.start("m", poll=-1)
    with pytest.raises(RefNotFoundError, match="the mirrors are m"):
        src.mirrors.push("nope")
    src.mirrors.remove("m")
    assert src.mirrors.list() == []
    with pytest.raises(RefNotFoundError, match="no mirror of that name"):
        src.mirrors.remove("m")
    assert [e.action for e in src.ops.audit(action="mirror")] == ["mirror.add", "mirror.remove"]


def test_a_selection_picks_by_tag_glob_and_rule() -> None:
    selection = make_selection(["pre-*"], ["rel-*"], keep_last=1)
    assert selection.matches_run("pre-1") and not selection.matches_run("ft")
    assert selection.to_json() == {"runs": ["pre-*"], "tags": ["rel-*"], "rules": {"keep_last": 1}}
    assert make_selection(["r"], keep_tagged=True).to_json()["rules"] == {"keep_tagged": True}


def test_a_mirror_into_a_store_keyed_otherwise_maps_ids_sends_nothing_again_and_deletes_there(
        src: casckpt.Store, tmp_path: Path) -> None:
    key = tmp_path / "dst.key"
    casckpt.generate_key_file(key)
    for step in (1, 2, 3):
        commit(src, step, tags=("best",) if step == 1 else ())
    src.mirrors.add("sealed", str(tmp_path / "dst"), runs=["ft"], tags=["best"], keep_last=1,
                    key_file=str(key), propagate_deletions=True)
    report = src.mirrors.push("sealed")  # 3 without its parent 2: committed there with none
    assert [(v.step, v.status) for v in report.versions] == [(1, "sent"), (3, "sent")]
    assert all(v.id and v.id != v.source_id for v in report.versions)
    assert src.mirrors.push("sealed").nothing_sent
    src.delete("ft@1")
    src.tag("ft@3", "best")
    after = src.mirrors.push("sealed")
    assert [(v.step, v.status) for v in after.versions] == [(3, "present"), (1, "deleted")]
    with casckpt.open(tmp_path / "dst", key_file=key, create=False) as dst:
        assert steps(dst) == [3] and dst.resolve("tag:best").step == 3
        assert_same(dst.restore("ft@3"), 3)
        assert dst.ops.check(read_data=True).ok


def test_a_mirror_recorded_in_a_postgresql_catalog(tmp_path: Path, pg_url: str) -> None:
    with casckpt.open(tmp_path / "src", catalog=pg_url, **OPTS) as store:
        for step in (1, 2):
            commit(store, step)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
        assert [v.status for v in store.mirrors.push("m").versions] == ["sent", "sent"]
        assert [v.status for v in store.mirrors.push("m").versions] == ["present", "present"]  # upserted
        info = store.mirrors.get("m")
        assert info.versions_sent == 2 and info.bytes_sent > 0 and info.last_error is None
        store.mirrors.remove("m")
        assert store.mirrors.list() == []


def test_a_version_the_destination_deleted_is_not_sent_again(src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step)
    src.mirrors.add("hot", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("hot")
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # its own retention: the last 1
        dst.retention.set("ft", keep_last=1)
        dst.gc(grace=0)
        dst.gc(grace=0)  # condemned, then swept: purged
        assert steps(dst) == [3]
    again = src.mirrors.push("hot")
    assert [(v.step, v.status) for v in again.versions] == [(1, "gone"), (2, "gone"), (3, "present")]
    assert again.nothing_sent and again.bytes == 0
    assert [v.status for v in src.mirrors.push("hot").versions] == ["gone", "gone", "present"]
    assert src.mirrors.get("hot").versions_sent == 1 and not src.mirrors.get("hot").failed
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [3] and dst.ops.check(read_data=True).ok


def test_the_source_retention_deleting_a_sent_version_sends_no_other_in_its_slot(
        src: casckpt.Store, tmp_path: Path) -> None:
    # the guide's scenario: the hot store keeps its last 2; the archive every 300th step
    src.retention.set("ft", keep_last=2)
    src.mirrors.add("archive", str(tmp_path / "arch"), runs=["ft"], keep_every=300)
    for step in range(100, 1100, 100):
        commit(src, step)
        src.gc(grace=0)
        src.mirrors.push("archive")
    assert steps(src) == [900, 1000]
    with casckpt.open(tmp_path / "arch", create=False) as arch:
        assert steps(arch) == [100, 300, 600, 900]


def test_a_wiped_destination_is_refilled_and_a_gone_version_is_checked_again(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step)
    src.mirrors.add("dr", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    src.mirrors.push("dr")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        dst.delete("ft@1")
    assert [v.status for v in src.mirrors.push("dr").versions] == ["gone", "present", "present"]
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # undeleted there: held again
        dst.undelete("ft@1")
    assert [v.status for v in src.mirrors.push("dr").versions] == ["present"] * 3
    shutil.rmtree(tmp_path / "dst")  # the disk replaced: a new store, with none of them
    again = src.mirrors.push("dr")
    assert [v.status for v in again.versions] == ["sent"] * 3 and not again.nothing_sent
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1, 2, 3]
        assert_same(dst.restore("ft@1"), 1)


def test_deletions_propagate_only_to_what_the_mirror_sent(src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2):
        commit(src, step)
    with casckpt.open(tmp_path / "dst", **OPTS) as dst:
        src.copy("ft@1", to=dst)  # someone's own copy: not the mirror's to delete
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1, propagate_deletions=True)
    assert [v.status for v in src.mirrors.push("m").versions] == ["present", "sent"]
    src.delete("ft@1")
    src.delete("ft@2")
    assert [(v.step, v.status) for v in src.mirrors.push("m").versions] == [(2, "deleted")]
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1]


def test_a_destination_on_s3_is_named_by_its_directory_and_a_url_is_refused(
        src: casckpt.Store, tmp_path: Path, s3_bucket_url: Callable[[], str], moto_endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a URL taken for a relative directory would land
    commit(src, 1)
    secret = "s3://AKIAEXAMPLE:SuperSecret123@127.0.0.1:1/bucket/prefix?X-Amz-Signature=SIGSECRET"
    for refused_by in (lambda: src.mirrors.add("m", secret, runs=["ft"], keep_last=1),
                       lambda: casckpt.open(secret)):  # casckpt copy --to opens it so
        with pytest.raises(InvalidArgumentError, match="not a URL") as refused:
            refused_by()
        assert "SuperSecret123" not in str(refused.value) and "SIGSECRET" not in str(refused.value)
    assert src.mirrors.list() == [] and not (tmp_path / "s3:").exists()
    casckpt.open(tmp_path / "dst", blobs=s3_bucket_url(), s3={"endpoint_url": moto_endpoint}, **OPTS).close()
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    assert [v.status for v in src.mirrors.push("m").versions] == ["sent"]
    assert not files(tmp_path / "dst")  # the packs went to the bucket
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert_same(dst.restore("ft@1"), 1)


def test_the_audit_rows_of_a_mirror_name_its_destination_redacted(src: casckpt.Store) -> None:
    # a URL is refused at add now; a catalog may hold one from before, and what the SQL side
    # writes must not keep its secrets either way
    from casckpt.catalog import mirrors as mirror_sql
    from casckpt.storage import redact_url

    url = "s3://AKIAEXAMPLE:SuperSecret123@127.0.0.1:1/bucket/prefix?X-Amz-Signature=SIGSECRET"
    row = mirror_sql.MirrorRow("m", url, None, make_selection(["ft"], keep_last=1).to_json(), False,
                               time.time(), None, None, None)
    mirror_sql.add(src._core.catalog, row, redact_url(url))
    src.mirrors.remove("m")
    details = [str(a.detail) for a in src.ops.audit() if a.action.startswith("mirror.")]
    assert len(details) == 2 and not any("SuperSecret123" in d or "SIGSECRET" in d for d in details)


def test_the_background_form_lives_on_after_any_error_and_runs_again(
        src: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from casckpt.store_mirrors import Mirrors

    commit(src, 1)
    src.mirrors.add("hot", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    chosen, failures = Mirrors._chosen, []

    def disk_full_once(self: Mirrors, *args: Any) -> Any:  # a full disk, not a CasckptError
        if not failures:
            failures.append(OSError(errno.ENOSPC, "No space left on device"))
            raise failures[0]
        return chosen(self, *args)

    monkeypatch.setattr(Mirrors, "_chosen", disk_full_once)
    worker = src.mirrors.start("hot", interval=0.05, poll=None)
    wait_for(lambda: worker.runs >= 2 and worker.last_error is None)
    assert worker.is_alive() and failures
    worker.stop()
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1]


def test_a_mirror_removed_while_its_worker_sends_leaves_no_rows_and_its_worker_stops(
        src: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from casckpt.mirror_sending import Sending

    for step in (1, 2, 3):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    sending, removed = threading.Event(), threading.Event()
    copy = Sending._copy

    def held(self: Sending, refs: list[str]) -> Any:  # the first version waits for the removal
        sending.set()
        assert removed.wait(30)
        return copy(self, refs)

    monkeypatch.setattr(Sending, "_copy", held)
    worker = src.mirrors.start("m", interval=3600, poll=None)
    assert sending.wait(30)
    src.mirrors.remove("m")
    src.mirrors.add("m", str(tmp_path / "other"), runs=["ft"], keep_every=1)  # the same name, anew
    removed.set()
    wait_for(lambda: not worker.is_alive())
    info = src.mirrors.get("m")
    assert info.versions_sent == 0 and info.last_run_at is None and not info.failed
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1]  # the version being sent, then it stopped
    monkeypatch.setattr(Sending, "_copy", copy)
    assert [v.status for v in src.mirrors.push("m").versions] == ["sent"] * 3


def test_a_version_undeleted_here_is_undeleted_there_after_a_propagated_deletion(
        src: casckpt.Store, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1, propagate_deletions=True)
    src.mirrors.push("m")
    src.delete("ft@2")
    assert [(v.step, v.status) for v in src.mirrors.push("m").versions][-1] == (2, "deleted")
    src.undelete("ft@2")  # a mistaken delete, undone here
    again = src.mirrors.push("m")
    assert not again.failed and [v.status for v in again.versions] == ["present"] * 3
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert steps(dst) == [1, 2, 3]
        assert_same(dst.restore("ft@2"), 2)
    src.delete("ft@2")  # and it is the mirror's to delete again
    assert [(v.step, v.status) for v in src.mirrors.push("m").versions][-1] == (2, "deleted")


def test_a_destination_is_keyed_by_the_mirrors_key_file_alone_not_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "source.key"
    casckpt.generate_key_file(key)
    monkeypatch.setenv("CASCKPT_KEY_FILE", str(key))  # the source's key, for the training job
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit(src, 1)
        src.mirrors.add("plain", str(tmp_path / "dst"), runs=["ft"], keep_last=1)  # no key file
        assert [v.status for v in src.mirrors.push("plain").versions] == ["sent"]
    monkeypatch.delenv("CASCKPT_KEY_FILE")
    with casckpt.open(tmp_path / "dst", create=False) as dst:  # not encrypted: no key needed
        assert_same(dst.restore("ft@1"), 1)


def test_a_closed_store_starts_no_mirror_worker(tmp_path: Path) -> None:
    store = casckpt.open(tmp_path / "src", **OPTS)
    commit(store, 1)
    store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    store.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        store.mirrors.start("m", interval=0.05, poll=None)
    assert not (tmp_path / "dst").exists()


def test_the_source_itself_is_refused_as_a_destination(src: casckpt.Store, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "src")
    for itself in (tmp_path / "src", tmp_path / "link", tmp_path / "src" / "."):
        with pytest.raises(InvalidArgumentError, match="this store itself"):
            src.mirrors.add("loop", str(itself), runs=["ft"], keep_last=1)
    assert src.mirrors.list() == []


def test_a_second_run_of_a_mirror_waits_for_the_first_then_sends_nothing(
        src: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from casckpt.mirror_sending import Sending

    for step in (1, 2):
        commit(src, step)
    src.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_every=1)
    inside, release, calls = threading.Event(), threading.Event(), []
    copy = Sending._copy

    def held(self: Sending, refs: list[str]) -> Any:  # the first run's copy waits for release
        calls.append(refs)
        if len(calls) == 1:
            inside.set()
            assert release.wait(30)
        return copy(self, refs)

    monkeypatch.setattr(Sending, "_copy", held)
    reports: dict[str, Any] = {}
    first = threading.Thread(target=lambda: reports.setdefault("first", src.mirrors.push("m")))
    second = threading.Thread(target=lambda: reports.setdefault("second", src.mirrors.push("m")))
    first.start()
    assert inside.wait(30)
    second.start()
    second.join(0.5)
    assert second.is_alive() and len(calls) == 1  # waiting for the first run's lock
    release.set()
    first.join(30)
    second.join(30)
    assert [v.status for v in reports["first"].versions] == ["sent", "sent"]
    assert reports["second"].nothing_sent and src.mirrors.get("m").versions_sent == 2
