"""Mirror definitions survive a catalog rebuild: each mirror is a ``refs/mirrors/`` record on
every location, written when it is added, removed with it, restored by ``catalog rebuild``
(what its runs recorded is not: the first run after the rebuild finds what the destination
holds and sends nothing again). In an encrypted store the record is sealed and its object
name shows no mirror name; ``check`` reports a missing record and ``repair`` writes it.

Real stores throughout: SQLite catalogs, local directories as locations.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from alembic import command
from sqlalchemy import create_engine

import casckpt
from casckpt.catalog import migrate
from casckpt.format import objectnames

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}
DISKS = ("d0", "d1", "d2")


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(2048, generator=gen), "step": step}


def open_store(root: Path, **kwargs: Any) -> casckpt.Store:
    blobs = [casckpt.BlobLocation(str(root / "blobs" / d), domain=d, name=d) for d in DISKS]
    return casckpt.open(root, blobs=blobs, **OPTS, **kwargs)


def mirror_records(root: Path) -> dict[str, dict[str, bytes]]:
    """Every ``refs/mirrors/`` object of each location directory, by location and key."""
    out = {}
    for disk in DISKS:
        folder = root / "blobs" / disk / objectnames.MIRRORS
        out[disk] = {objectnames.MIRRORS + p.name: p.read_bytes()
                     for p in (folder.iterdir() if folder.is_dir() else ())}
    return out


def definitions(store: casckpt.Store) -> list[tuple[Any, ...]]:
    return [(m.name, m.destination, m.key_file, m.selection, m.propagate_deletions, m.created_at)
            for m in store.mirrors.list()]


def lose_catalog(root: Path) -> None:
    for file in root.glob("catalog.db*"):
        file.unlink()


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "src"


def test_a_mirror_added_is_a_record_on_every_location_and_removed_with_it(root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("arch", str(tmp_path / "dst"), runs=["f*"], tags=["best"], keep_every=3,
                          key_file=str(tmp_path / "dst.key"), propagate_deletions=True)
        store.mirrors.add("other", str(tmp_path / "dst2"), runs=["ft"], keep_last=1)
        found = mirror_records(root)
        key = objectnames.ref_name(objectnames.MIRRORS, "arch")
        assert all(set(records) == {key, objectnames.ref_name(objectnames.MIRRORS, "other")}
                   for records in found.values()), found
        doc = json.loads(found["d1"][key])
        fields = ("name", "destination", "key_file", "selection", "propagate_deletions")
        assert {k: doc[k] for k in fields} == {
            "name": "arch", "destination": str(tmp_path / "dst"), "key_file": str(tmp_path / "dst.key"),
            "selection": {"runs": ["f*"], "tags": ["best"], "rules": {"keep_every": 3}},
            "propagate_deletions": True}
        assert doc["created_at"] == pytest.approx(store.mirrors.get("arch").created_at.timestamp(), abs=1e-5)
        assert store.ops.check().ok

        store.mirrors.remove("arch")
        assert all(set(records) == {objectnames.ref_name(objectnames.MIRRORS, "other")}
                   for records in mirror_records(root).values())
        assert store.ops.check().ok


def test_a_rebuild_restores_the_mirrors_and_their_next_run_sends_only_what_is_new(
        root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        for step in (1, 2, 3):
            store.commit(state(step), run="ft", step=step, tags=["best"] if step == 2 else [])
        store.mirrors.add("arch", str(tmp_path / "dst"), runs=["ft"], tags=["best"], keep_last=1,
                          propagate_deletions=True)
        store.mirrors.add("gone", str(tmp_path / "dst2"), runs=["ft"], keep_last=1)
        store.mirrors.remove("gone")
        assert [v.step for v in store.mirrors.push("arch").versions] == [2, 3]
        before = definitions(store)
    lose_catalog(root)
    with open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert definitions(store) == before  # "gone" stays gone
        info = store.mirrors.get("arch")
        assert info.last_run_at is None and info.versions_sent == 0  # run state is not recorded
        assert store.ops.check().ok
        again = store.mirrors.push("arch")
        assert again.nothing_sent and [(v.step, v.status) for v in again.versions] == [(2, "present"),
                                                                                       (3, "present")]
        store.commit(state(4), run="ft", step=4)
        assert [(v.step, v.status) for v in store.mirrors.push("arch").versions] == [
            (2, "present"), (4, "sent")]
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert sorted(v.step for v in dst.log("ft")) == [2, 3, 4]
        assert torch.equal(dst.restore("ft@4")["w"], state(4)["w"])


def test_an_encrypted_stores_mirror_record_is_sealed_and_names_no_mirror(root: Path, tmp_path: Path) -> None:
    key = tmp_path / "src.key"
    casckpt.generate_key_file(key)
    destination = str(tmp_path / "secret-project-dst")
    with open_store(root, key_file=key) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("secret-project", destination, runs=["ft"], keep_last=1)
        before = definitions(store)
    found = mirror_records(root)
    for records in found.values():
        [(name, data)] = records.items()
        assert name.startswith(objectnames.MIRRORS + "k") and b"secret-project".hex() not in name
        assert b"secret-project" not in data and b"keep_last" not in data
    lose_catalog(root)
    with open_store(root, key_file=key, recover=True) as store:
        store.ops.rebuild_catalog()
        assert definitions(store) == before
        assert [v.status for v in store.mirrors.push("secret-project").versions] == ["sent"]


def test_check_reports_a_missing_mirror_record_and_repair_writes_it(root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("arch", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
        key = objectnames.ref_name(objectnames.MIRRORS, "arch")
        (root / "blobs" / "d2" / key).unlink()  # as on a store whose mirror was added before records
        problems = store.ops.check().problems
        assert [(p.kind, p.subject) for p in problems] == [("record", key)], problems
        assert store.ops.repair().ok
        assert store.ops.check().ok and key in mirror_records(root)["d2"]


def test_a_damaged_mirror_record_is_skipped_by_a_rebuild_with_a_warning(
        root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("arch", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
        store.mirrors.add("bad", str(tmp_path / "dst2"), runs=["ft"], keep_last=1)
    key = objectnames.ref_name(objectnames.MIRRORS, "bad")
    for disk in DISKS:
        path = root / "blobs" / disk / key
        doc = json.loads(path.read_bytes())
        path.write_text(json.dumps({**doc, "selection": {"runs": ["ft"], "rules": {"keep_all_of_it": 1}}}))
    lose_catalog(root)
    with caplog.at_level(logging.WARNING), open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert [m.name for m in store.mirrors.list()] == ["arch"]
    assert any("skipping mirror record" in r.getMessage() for r in caplog.records)


def test_a_removed_mirrors_record_left_on_a_location_is_a_check_problem_repair_deletes(
        root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("arch", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
        key = objectnames.ref_name(objectnames.MIRRORS, "arch")
        kept = (root / "blobs" / "d1" / key).read_bytes()
        store.mirrors.remove("arch")
        (root / "blobs" / "d1" / key).write_bytes(kept)  # as if d1 refused the deletion
        problems = store.ops.check().problems
        assert [(p.kind, p.subject) for p in problems] == [("record", key)], problems
        assert "would bring the mirror back" in problems[0].detail
        assert store.ops.repair().records_written == 1
        assert store.ops.check().ok and mirror_records(root)["d1"] == {}


def test_a_destination_that_looks_like_it_holds_a_credential_is_recorded_redacted_and_not_restored(
        root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("odd", str(tmp_path / "token=s3cr3t" / "dst"), runs=["ft"], keep_last=1)
        assert store.ops.check().ok
    assert any("will not restore the mirror" in r.getMessage() for r in caplog.records)
    caplog.clear()
    written = [data for records in mirror_records(root).values() for data in records.values()]
    assert len(written) == len(DISKS) and all(b"s3cr3t" not in data for data in written)
    lose_catalog(root)
    with caplog.at_level(logging.WARNING), open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert store.mirrors.list() == []  # never a mirror into a directory nobody named
    assert any("recorded redacted" in r.getMessage() for r in caplog.records)


def test_a_damaged_newest_copy_falls_back_to_an_older_good_one_and_repair_keeps_every_copy(
        root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
        before = definitions(store)
    key = objectnames.ref_name(objectnames.MIRRORS, "m")
    path = root / "blobs" / "d0" / key
    doc = json.loads(path.read_bytes())  # newest by far, and a rule this casckpt cannot run
    path.write_text(json.dumps({**doc, "seq": doc["seq"] + 100,
                                "selection": {"runs": ["ft"], "rules": {"bogus": 1}}}))
    lose_catalog(root)
    with open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert definitions(store) == before  # from d1 or d2's good copy
        store.ops.repair()
        assert store.ops.check().ok
    assert all(key in records for records in mirror_records(root).values())


def test_repair_never_deletes_a_mirror_record_whose_removal_the_catalog_never_logged(
        root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    key = objectnames.ref_name(objectnames.MIRRORS, "m")
    for disk in DISKS:  # every copy unusable: the rebuild cannot restore the mirror
        path = root / "blobs" / disk / key
        path.write_text(json.dumps({**json.loads(path.read_bytes()), "propagate_deletions": "no"}))
    lose_catalog(root)
    with open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert store.mirrors.list() == []
        problems = store.ops.check().problems
        assert {p.subject for p in problems} == {key}
        assert all("repair keeps it" in p.detail for p in problems)
        assert store.ops.repair().records_written == 0
    assert all(key in records for records in mirror_records(root).values())


@pytest.mark.parametrize("destination", ["relative/dst", "s3://bucket/dst"])
def test_a_record_naming_what_mirrors_add_refuses_is_not_restored(
        root: Path, tmp_path: Path, destination: str, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    key = objectnames.ref_name(objectnames.MIRRORS, "m")
    for disk in DISKS:
        path = root / "blobs" / disk / key
        path.write_text(json.dumps({**json.loads(path.read_bytes()), "destination": destination}))
    lose_catalog(root)
    with caplog.at_level(logging.WARNING), open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert store.mirrors.list() == []
    assert any("skipping mirror record" in r.getMessage() for r in caplog.records)


def test_upgrading_a_store_whose_mirrors_predate_their_records_writes_them(
        root: Path, tmp_path: Path) -> None:
    with open_store(root) as store:
        store.commit(state(1), run="ft", step=1)
        store.mirrors.add("m", str(tmp_path / "dst"), runs=["ft"], keep_last=1)
    for disk in DISKS:  # as a casckpt before mirror records left it, at schema 0017
        for record in (root / "blobs" / disk / objectnames.MIRRORS).iterdir():
            record.unlink()
    engine = create_engine(f"sqlite:///{root / 'catalog.db'}")
    with engine.connect() as conn:
        command.downgrade(migrate._config(conn), "0017")
        conn.commit()
    engine.dispose()
    with open_store(root, create=False) as store:
        assert store.ops.check().ok
    assert all(len(records) == 1 for records in mirror_records(root).values())
