"""Encrypted stores (docs/SECURITY.md): nothing readable on a location, ids that say nothing
across stores, tampering refused, keys that can be added, rotated and removed safely."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from doubles import WriteHookStore, Zygote

import casckpt
from casckpt.catalog import shards as shard_sql
from casckpt.errors import (
    CasckptError,
    CorruptPackError,
    IntegrityError,
    InvalidArgumentError,
    KeyRequiredError,
    LastKeyError,
    NotEncryptedError,
    SealedObjectError,
    StorageError,
    StoreIdentityError,
    StoreKeyError,
    WrongKeyError,
)
from casckpt.format import objectnames
from casckpt.testing.internals import internals

SECRET_NOTE = "zq-metadata-note-7d1c"
SECRET_VALUE = "zq-plain-value-93fa"
RUN = "zq-secret-run"
TAG = "zq-secret-tag"


def _pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


PATTERN = _pattern(7, 3 << 20)  # incompressible: stored as it is unless encrypted


def _state(pattern: bytes = PATTERN) -> dict[str, Any]:
    return {
        "model": {"w": torch.frombuffer(bytearray(pattern), dtype=torch.uint8).clone(),
                  "b": torch.arange(4096, dtype=torch.float32)},  # compressible, distinctive
        "note": SECRET_VALUE,
        "step": 12,
    }


def _needles() -> list[bytes]:
    out = [PATTERN[i : i + 24] for i in range(0, len(PATTERN), len(PATTERN) // 16)]
    out += [SECRET_NOTE.encode(), SECRET_VALUE.encode(), RUN.encode(), TAG.encode(),
            RUN.encode().hex().encode(), TAG.encode().hex().encode(),
            torch.arange(4096, dtype=torch.float32).numpy().tobytes()[4000:4032]]
    return out


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: size and SHA-256 (what 'unchanged' compares)."""
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "master.key"
    path.parent.mkdir()
    casckpt.generate_key_file(path)
    return path


def _key(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "keys" / name
    path.parent.mkdir(exist_ok=True)
    casckpt.generate_key_file(path)
    return path


@pytest.fixture
def split(tmp_path: Path, key_file: Path) -> Iterator[tuple[Path, Callable[..., casckpt.Store]]]:
    """An encrypted store whose location is its own directory (the catalog lives apart)."""
    loc = tmp_path / "loc"

    def open_(**kw: Any) -> casckpt.Store:
        kw.setdefault("key_file", key_file)
        return casckpt.open(tmp_path / "store", blobs=str(loc), **kw)

    yield loc, open_


def _commit_secrets(store: casckpt.Store) -> None:
    store.commit(_state(), run=RUN, step=1, metadata={"note": SECRET_NOTE}, message=SECRET_NOTE)
    store.tag(f"{RUN}@1", TAG)


# -- nothing readable on a location -----------------------------------------------------------


def test_a_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "k"
    kid = casckpt.generate_key_file(path)
    assert len(kid) == 16 and (path.stat().st_mode & 0o777) == 0o600
    before = path.read_bytes()
    with pytest.raises(StoreKeyError, match="never overwritten"):
        casckpt.generate_key_file(path)
    assert path.read_bytes() == before


def test_no_plaintext_reaches_a_local_location(split: Any) -> None:
    loc, open_ = split
    with open_() as store:
        _commit_secrets(store)
        assert torch.equal(store.restore(f"tag:{TAG}")["model"]["w"], _state()["model"]["w"])
    files = [p for p in loc.rglob("*") if p.is_file()]
    assert any(p.name == objectnames.KEYS_RECORD for p in files)
    for path in files:
        data = path.read_bytes()
        for needle in _needles():
            assert needle not in data, f"{needle[:16]!r} in {path}"
    names = " ".join(str(p.relative_to(loc)) for p in files)
    assert RUN.encode().hex() not in names and TAG.encode().hex() not in names


def test_no_plaintext_reaches_an_s3_location(tmp_path: Path, key_file: Path, s3_bucket_url: Any,
                                              moto_endpoint: str) -> None:
    import boto3

    url = s3_bucket_url()
    with casckpt.open(tmp_path / "store", blobs=url, s3={"endpoint_url": moto_endpoint},
                      key_file=key_file) as store:
        _commit_secrets(store)
        assert store.restore(f"{RUN}@1")["note"] == SECRET_VALUE
    bucket = url.removeprefix("s3://").split("/")[0]
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=bucket)["Contents"]
    assert len(listed) >= 4
    for item in listed:
        data = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        for needle in _needles():
            assert needle not in data, f"{needle[:16]!r} in {item['Key']}"
        assert RUN.encode().hex() not in item["Key"] and TAG.encode().hex() not in item["Key"]


def _ids(store: casckpt.Store, ref: str) -> set[str]:
    manifest = internals(store).manifest(ref)
    return {c.hex() for e in manifest.extents for c in e.chunks}


def test_the_same_tensor_has_unrelated_ids_and_names_in_two_stores(tmp_path: Path) -> None:
    stores = []
    for name, key in (("a", _key(tmp_path, "a.key")), ("b", _key(tmp_path, "b.key")), ("plain", None)):
        with casckpt.open(tmp_path / name, blobs=str(tmp_path / f"{name}-loc"), key_file=key) as store:
            version = store.commit(_state(), run="r", step=1)
            stores.append((version.id, _ids(store, "r@1"),
                           {str(p.relative_to(tmp_path / f"{name}-loc"))
                            for p in (tmp_path / f"{name}-loc").rglob("*") if p.is_file()}))
    (va, ia, na), (vb, ib, nb), (vp, ip, np_) = stores
    assert ia and ib and ip
    assert not ia & ib and not ia & ip and not ib & ip
    assert len({va, vb, vp}) == 3
    shared = {objectnames.IDENTITY, objectnames.KEYS_RECORD, "refs/locations"}
    assert not (na & nb) - shared


def test_an_unchanged_recommit_writes_no_new_bytes(split: Any) -> None:
    _, open_ = split
    with open_() as store:
        store.commit(_state(), run="r", step=1)
    with open_() as store:  # a new process would have no memo: dedup is by keyed id in the catalog
        second = store.commit(_state(), run="r", step=2)
        assert second.new_bytes == 0
        changed = _state()
        changed["model"]["b"][0] = -1.0
        third = store.commit(changed, run="r", step=3)
        assert 0 < third.new_bytes < 64 << 10


# -- keys: missing, wrong, rotated, removed -----------------------------------------------------


def test_a_missing_or_wrong_key_is_refused_before_anything_is_touched(split: Any, tmp_path: Path) -> None:
    loc, open_ = split
    with open_() as store:
        _commit_secrets(store)
    before = _tree(tmp_path)
    with pytest.raises(KeyRequiredError, match="key_file"):
        open_(key_file=None)
    with pytest.raises(WrongKeyError, match="not one of this store's keys"):
        open_(key_file=_key(tmp_path, "other.key"))
    (tmp_path / "keys" / "garbage.key").write_text("hello\n")
    with pytest.raises(StoreKeyError, match="not a casckpt key file"):
        open_(key_file=tmp_path / "keys" / "garbage.key")
    after = _tree(tmp_path)
    after.pop("keys/other.key"), after.pop("keys/garbage.key")
    assert after == before


def test_a_key_for_a_plain_store_is_refused(tmp_path: Path, key_file: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        store.commit(_state(), run="r", step=1)
    before = _tree(tmp_path / "s")
    with pytest.raises(NotEncryptedError, match="not encrypted"):
        casckpt.open(tmp_path / "s", key_file=key_file)
    with casckpt.open(tmp_path / "s") as store, pytest.raises(NotEncryptedError):
        store.keys.list()
    assert _tree(tmp_path / "s").keys() == before.keys()


def test_keys_can_be_added_rotated_and_removed_and_every_version_stays_readable(
        split: Any, tmp_path: Path, key_file: Path) -> None:
    loc, open_ = split
    second, third = _key(tmp_path, "second.key"), _key(tmp_path, "third.key")
    with open_() as store:
        for step in range(3):
            store.commit(_state(_pattern(step, 1 << 20)), run="r", step=step)
        first_id = store.keys.list()[0].id
        assert store.keys.list()[0].in_use
        added = store.keys.add(second)
        with pytest.raises(InvalidArgumentError, match="already"):
            store.keys.add(second)
    with open_(key_file=second) as store:
        assert {k.id for k in store.keys.list()} == {first_id, added.id}
        rotated = store.keys.rotate(third)  # replaces the key it was opened with
        assert {k.id for k in store.keys.list()} == {first_id, rotated.id}
    with pytest.raises(WrongKeyError):
        open_(key_file=second)
    with open_(key_file=third) as store:
        store.keys.remove(first_id)
        with pytest.raises(LastKeyError, match="only key"):
            store.keys.remove(rotated.id)
        for step in range(3):
            got = store.restore(f"r@{step}")["model"]["w"]
            assert got.numpy().tobytes() == _pattern(step, 1 << 20)
        assert store.ops.check(read_data=True).ok
        actions = [(e.action, e.detail.get("key_id")) for e in store.ops.audit(action="key")]
        assert actions == [("key.create", None), ("key.add", added.id), ("key.rotate", rotated.id),
                           ("key.remove", first_id)]
    with pytest.raises(WrongKeyError):
        open_()
    record = json.loads((loc / objectnames.KEYS_RECORD).read_text())
    assert [s["id"] for s in record["slots"]] == [rotated.id]  # the location's copy follows


def test_the_catalog_can_be_rebuilt_from_encrypted_locations_with_the_key(split: Any, tmp_path: Path) -> None:
    loc, open_ = split
    with open_() as store:
        _commit_secrets(store)
        store.commit(_state(_pattern(3, 1 << 20)), run=RUN, step=2)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(KeyRequiredError):
        casckpt.open(tmp_path / "store2", blobs=str(loc), recover=True)
    with casckpt.open(tmp_path / "store2", blobs=str(loc), recover=True,
                      key_file=tmp_path / "keys" / "master.key") as store:
        report = store.ops.rebuild_catalog()
        assert report.versions == 2
        assert store.restore(f"tag:{TAG}")["note"] == SECRET_VALUE
        assert store.ops.check(read_data=True).ok


def test_a_catalog_that_lost_its_key_record_is_refused(split: Any, tmp_path: Path, key_file: Path) -> None:
    loc, open_ = split
    with open_() as store:
        store.commit(_state(), run="r", step=1)
    import sqlite3

    with sqlite3.connect(tmp_path / "store" / "catalog.db") as db:
        db.execute("DELETE FROM store_info WHERE key = 'key_record'")
    with pytest.raises(StoreIdentityError, match="records no key"):
        open_()
    before = _tree(tmp_path)
    with pytest.raises(StoreKeyError, match="lost its key record"):  # it recorded the store encrypted
        open_(key_file=None)
    assert _tree(tmp_path) == before
    with sqlite3.connect(tmp_path / "store" / "catalog.db") as db:  # a catalog from before that record
        db.execute("DELETE FROM store_info WHERE key = 'encryption'")
    with open_(key_file=None) as store:  # a catalog with versions answers alone: a plain store's
        with pytest.raises((IntegrityError, StorageError)):  # whose sealed packs never read as data
            store.restore("r@1")


# -- tampering: typed errors, never wrong data ------------------------------------------------


def _objects(loc: Path, prefix: str) -> list[Path]:
    return sorted(p for p in (loc / prefix).rglob("*") if p.is_file())


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "extend", "swap", "plain",
                                    "swap-segment"])
def test_a_tampered_pack_is_refused_never_returned(split: Any, damage: str) -> None:
    loc, open_ = split
    with open_() as store:
        store.commit(_state(), run="a", step=1)
        other = _state(_pattern(11, 1 << 20))
        other["model"]["b"] += 1  # nothing shared with run a: b's packs are untouched
        store.commit(other, run="b", step=1)
        a_pack = {internals(store).catalog.find_chunks([c], live_only=False)[c].pack_id
                  for c in _ids(store, "a@1")}
    packs = _objects(loc, "packs")
    target = next(p for p in packs if p.name in a_pack)
    other = next(p for p in packs if p.name not in a_pack)
    size = target.stat().st_size
    if damage == "flip-payload":
        _flip(target, size // 2)
    elif damage == "flip-header":
        _flip(target, 20)  # inside the salt: every segment's key changes
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[: size - 100])
    elif damage == "extend":
        target.write_bytes(target.read_bytes() + b"\0" * 16)
    elif damage == "swap":
        shutil.copyfile(other, target)  # another pack's valid ciphertext under this name
    elif damage == "swap-segment":  # one sealed segment of another pack, in place of this one's
        from casckpt.format.crypto import HEADER_SIZE, SEGMENT, TAG_SIZE

        span, at = SEGMENT + TAG_SIZE, HEADER_SIZE + SEGMENT + TAG_SIZE  # the second segment
        data, theirs = bytearray(target.read_bytes()), other.read_bytes()
        assert len(data) >= at + span and len(theirs) >= at + span
        data[at : at + span] = theirs[at : at + span]
        target.write_bytes(bytes(data))
    else:
        target.write_bytes(b"CKPACK02" + bytes(size))  # plaintext where a sealed object belongs
    with open_() as store:
        if damage == "extend":  # bytes past the end are never read: a restore returns exact bytes
            assert torch.equal(store.restore("a@1")["model"]["w"], _state()["model"]["w"])
        else:
            with pytest.raises((IntegrityError, StorageError)) as caught:
                store.restore("a@1")
            assert isinstance(caught.value, CasckptError)
        assert not store.ops.check(read_data=True).ok  # check reads every object whole
        assert store.restore("b@1")["model"]["w"].numpy().tobytes() == _pattern(11, 1 << 20)


def test_a_tampered_sealed_pack_is_reported_damaged_not_missing(split: Any) -> None:
    loc, open_ = split
    with open_() as store:
        store.commit(_state(), run="a", step=1)
    (pack,) = _objects(loc, "packs")
    _flip(pack, pack.stat().st_size // 2)  # one byte: the segment fails authentication
    with open_() as store:
        with pytest.raises(CorruptPackError, match="is damaged") as caught:
            store.restore("a@1")
        assert "missing" not in str(caught.value)
        (found, *_versions) = store.ops.check(read_data=True).problems
        assert found.subject == pack.name and "is damaged" in found.detail
        assert "cannot be read" not in found.detail


def test_a_tampered_sealed_copy_is_marked_corrupt_and_repaired(tmp_path: Path, key_file: Path) -> None:
    locs = [str(tmp_path / f"d{i}") for i in range(2)]
    with casckpt.open(tmp_path / "s", blobs=locs, redundancy="replicate:2", key_file=key_file) as store:
        store.commit(_state(), run="r", step=1)
    (pack,) = _objects(Path(locs[1]), "packs")
    _flip(pack, pack.stat().st_size // 2)
    with casckpt.open(tmp_path / "s", key_file=key_file) as store:
        report = store.ops.check(read_data=True)
        layout = shard_sql.layouts(internals(store).catalog, [pack.name])[pack.name]
        assert sorted(sh.state for sh in layout.shards) == ["corrupt", "ok"]  # not "missing"
        (bad,) = [sh.index for sh in layout.shards if sh.state == "corrupt"]
        assert [p.subject for p in report.problems] == [f"{pack.name}:{bad}"]
        assert "is damaged" in report.problems[0].detail
        store.ops.repair()
        assert store.ops.check(read_data=True).ok


def test_a_damaged_shard_of_an_encrypted_ec_store_is_reconstructed_and_healed(
        tmp_path: Path, key_file: Path) -> None:
    locs = [str(tmp_path / f"d{i}") for i in range(3)]
    with casckpt.open(tmp_path / "s", blobs=locs, redundancy="ec:2+1", key_file=key_file) as store:
        store.commit(_state(), run="r", step=1)
    # a data shard (index 0): a restore reads data shards first, so it meets the damage (one
    # of the parity shard would be found by check --read-data only: the test was flaky)
    shard = sorted(p for d in locs for p in (Path(d) / "packs").rglob("*.s0"))[0]
    _flip(shard, shard.stat().st_size // 2)
    with casckpt.open(tmp_path / "s", key_file=key_file) as store:
        assert torch.equal(store.restore("r@1")["model"]["w"], _state()["model"]["w"])
        store.ops.repair()
        assert store.ops.check(read_data=True).ok


def test_a_record_or_manifest_swapped_between_names_fails_authentication(split: Any) -> None:
    loc, open_ = split
    with open_() as store:
        store.commit(_state(), run="r", step=1)
        store.commit(_state(_pattern(5, 1 << 20)), run="r", step=2)
        store.tag("r@1", "one")
        store.tag("r@2", "two")
    manifests = _objects(loc, "manifests")
    shutil.copyfile(manifests[0], manifests[1])
    blobs = internals(open_()).locations.all[0].blobs
    with pytest.raises(SealedObjectError, match="fails authentication"):
        blobs.get(f"manifests/{manifests[1].name}")
    assert len(blobs.get(f"manifests/{manifests[0].name}")) > 0
    tags = _objects(loc, "refs/tags")
    shutil.copyfile(tags[0], tags[1])
    with pytest.raises(SealedObjectError):
        blobs.get(str(tags[1].relative_to(loc)))


def test_a_deleted_key_record_on_a_location_is_written_again_at_open(split: Any) -> None:
    loc, open_ = split
    with open_() as store:
        store.commit(_state(), run="r", step=1)
    record = (loc / objectnames.KEYS_RECORD).read_bytes()
    (loc / objectnames.KEYS_RECORD).unlink()
    with open_() as store:
        assert store.restore("r@1")["note"] == SECRET_VALUE
    assert (loc / objectnames.KEYS_RECORD).read_bytes() == record


def test_the_cli_creates_and_opens_an_encrypted_store(tmp_path: Path, key_file: Path) -> None:
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    runner = CliRunner()
    made = runner.invoke(app, ["init", str(tmp_path / "s"), "--encrypt", "--key-file", str(key_file)])
    assert made.exit_code == 0, made.output
    assert "encrypted" in made.output
    refused = runner.invoke(app, ["init", str(tmp_path / "t"), "--encrypt"], env={"CASCKPT_KEY_FILE": ""})
    assert refused.exit_code == 2 and not (tmp_path / "t").exists()
    no_key = runner.invoke(app, ["--store", str(tmp_path / "s"), "log"], env={"CASCKPT_KEY_FILE": ""})
    assert no_key.exit_code != 0 and "encrypted" in no_key.output
    listed = runner.invoke(app, ["--store", str(tmp_path / "s"), "--key-file", str(key_file),
                                 "key", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)[0]["in_use"] is True
    env = {"CASCKPT_KEY_FILE": str(key_file)}
    second = tmp_path / "keys" / "second.key"
    assert runner.invoke(app, ["key", "generate", str(second)]).exit_code == 0
    added = runner.invoke(app, ["--store", str(tmp_path / "s"), "key", "add", str(second)], env=env)
    assert added.exit_code == 0, added.output
    kid = json.loads(runner.invoke(app, ["--store", str(tmp_path / "s"), "key", "list", "--json"],
                                   env=env).output)
    assert len(kid) == 2
    gone = runner.invoke(app, ["--store", str(tmp_path / "s"), "key", "remove", kid[0]["id"]], env=env)
    assert gone.exit_code == 0, gone.output
    last = runner.invoke(app, ["--store", str(tmp_path / "s"), "--key-file", str(second),
                               "key", "remove", kid[1]["id"]])
    assert last.exit_code == 2 and "only key" in last.output


# -- the rest of the store works the same encrypted -------------------------------------------


def test_gc_delta_coding_and_a_new_location_work_encrypted(split: Any, tmp_path: Path) -> None:
    loc, open_ = split
    with open_() as store:
        store.ops.set_delta_chain(4)
        base = torch.randn(256, 1024)
        for step in range(4):
            state = {"w": base.clone(), "step": step}
            state["w"][step] += 1.0  # one row changes: delta-coded against the previous chunk
            store.commit(state, run="r", step=step)
        for step in range(4):
            got = store.restore(f"r@{step}")["w"]
            want = base.clone()
            want[step] += 1.0
            assert torch.equal(got, want)
        store.commit(_state(), run="gone", step=1)
        store.delete("gone@1")
        report = store.gc(grace=0)
        assert report.bytes_freed > 0
        assert (loc / objectnames.KEYS_RECORD).exists()  # gc never takes the key record
        added = store.locations.add(str(tmp_path / "second"))
        assert (tmp_path / "second" / objectnames.KEYS_RECORD).exists()
        store.locations.retire("loc0")
        store.ops.repair()
        assert store.restore("r@3")["step"] == 3
        assert store.ops.check(read_data=True).ok
        assert added.name != "loc0"
    for path in (tmp_path / "second").rglob("*"):
        if path.is_file():
            assert PATTERN[:24] not in path.read_bytes()


def test_dcp_saves_and_loads_an_encrypted_store(tmp_path: Path, key_file: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {"model": {"w": torch.randn(70, 33), "h": torch.randn(9, 5).half()}, "step": 3}
    with casckpt.open(tmp_path / "s", blobs=str(tmp_path / "loc"), key_file=key_file) as store:
        dcp.save(state, storage_writer=store.dcp_writer(run="r", step=3))
        target = {"model": {"w": torch.zeros(70, 33), "h": torch.zeros(9, 5).half()}, "step": 0}
        dcp.load(target, storage_reader=store.dcp_reader("r@3"))
        assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["step"] == 3
        assert store.ops.check(read_data=True).ok
    raw = b"".join(p.read_bytes() for p in (tmp_path / "loc").rglob("*") if p.is_file())
    assert state["model"]["w"].numpy().tobytes()[:32] not in raw


def test_threads_creating_one_encrypted_store_at_once_all_get_the_same_key(tmp_path: Path,
                                                                            key_file: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def make(i: int) -> str:
        with casckpt.open(tmp_path / "s", key_file=key_file) as store:
            return store.commit({"w": torch.full((1024,), float(i))}, run=f"r{i}", step=1).id

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(make, range(4)))
    with casckpt.open(tmp_path / "s", key_file=key_file) as store:
        assert len(store.keys.list()) == 1
        for i in range(4):
            assert store.restore(f"r{i}@1")["w"][0] == float(i)
        assert store.ops.check(read_data=True).ok


# -- openers with different keys, or none, racing to create one store ------------------------

CREATOR = Path(__file__).parents[1] / "helpers" / "creator.py"
RACE_KEYS = ("a", "b", "a", "b", None)  # the key each racing process holds (worker w commits step w)


def _error_class(traceback_text: str) -> str:
    """The class name of the exception a creator process reported (its traceback's last line)."""
    return traceback_text.strip().splitlines()[-1].split(":")[0].rsplit(".", 1)[-1]


def _race_round(zygote: Zygote, root: Path, loc: Path, scratch: Path,
                keys: dict[str, Path]) -> list[dict[str, Any]]:
    """One forked process per key of :data:`RACE_KEYS` opens the new store at ``root`` as soon
    as the go file appears, once every one of them exists, and commits; returns the replies."""
    scratch.mkdir()
    go = scratch / "go"
    children = []
    for w, held in enumerate(RACE_KEYS):
        job = {"root": str(root), "go": str(go), "threads": 1, "how": "open",
               "kwargs": {"blobs": str(loc), "key_file": str(keys[held]) if held else None}}
        out = scratch / f"w{w}.out"
        children.append((zygote.ask({"op": "spawn", "args": [json.dumps(job), str(w)],
                                     "stdout": str(out), "stderr": str(out) + ".err"})["pid"], out))
    go.touch()
    replies = []
    for pid, out in children:
        assert zygote.ask({"op": "wait", "pid": pid}) == {"status": 0}, Path(f"{out}.err").read_text()
        replies.append(json.loads(out.read_text().splitlines()[-1]))
    return replies


def _assert_one_encryption(root: Path, loc: Path, replies: list[dict[str, Any]],
                           keys: dict[str, Path]) -> None:
    """Exactly one opener class won; every other opener got the typed refusal its key (or lack
    of one) deserves; the location holds only the winner's kind of objects; every commit that
    returned reads back with the winner's key (or none, if the keyless process won)."""
    outcome = [_error_class(reply["errors"][0]) if reply["errors"] else "committed" for reply in replies]
    won = {RACE_KEYS[w] for w, reply in enumerate(replies) if reply["commits"]}
    assert len(won) == 1, f"commits returned under more than one encryption: {outcome}"
    winner = won.pop()
    expected = ["committed" if held == winner else "NotEncryptedError" if winner is None
                else "KeyRequiredError" if held is None else "WrongKeyError" for held in RACE_KEYS]
    assert outcome == expected, [e for reply in replies for e in reply["errors"]]
    objects = [p for p in loc.rglob("*") if p.is_file() and p.name not in
               (objectnames.IDENTITY, objectnames.KEYS_RECORD)]
    assert objects
    for path in objects:
        sealed = path.read_bytes()[:8] == b"CKSEAL01"
        assert sealed == (winner is not None), f"{path.relative_to(loc)} sealed={sealed}, winner {winner}"
    with casckpt.open(root, create=False, blobs=str(loc),
                      key_file=keys[winner] if winner else None) as store:
        committed = {step: vid for reply in replies for step, vid in reply["commits"]}
        assert {v.step: v.id for v in store.log("r")} == committed
        for step in committed:
            assert torch.equal(store.restore(f"r@{step}")["step"], torch.full((64,), float(step)))
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems[:5]


@pytest.mark.parametrize("rounds", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_processes_with_two_keys_and_none_creating_one_store_at_once_fix_one_encryption(
        tmp_path: Path, rounds: int) -> None:
    """Four processes holding one of two keys and one holding none open one new path at once
    and commit: the store's encryption is the first creator's, fixed once, and every other
    opener is refused with a typed error; no plaintext object lands beside sealed ones, nor
    one sealed under a losing key."""
    keys = {"a": _key(tmp_path, "a.key"), "b": _key(tmp_path, "b.key")}
    zygote = Zygote(CREATOR)  # imports torch once: the racers are forked, each its own process
    try:
        for i in range(rounds):  # which creator wins is the race's: any one is right, two never
            root, loc = tmp_path / f"s{i}", tmp_path / f"loc{i}"
            _assert_one_encryption(root, loc, _race_round(zygote, root, loc, tmp_path / f"r{i}", keys), keys)
    finally:
        zygote.close()

def test_a_writer_whose_store_encryption_changed_is_refused_before_its_first_object_and_at_publish(
        tmp_path: Path) -> None:
    """The catalog's record of the store's encryption is re-read when a commit begins writing
    objects and in the transaction that publishes it: a writer that no longer matches it gets
    a typed error and nothing is acknowledged (here the row is edited under a keyless writer,
    as an older casckpt racing a key holder would have left it)."""
    import sqlite3

    def set_state(value: str) -> None:
        with sqlite3.connect(tmp_path / "store" / "catalog.db") as db:
            db.execute("UPDATE store_info SET value = ? WHERE key = 'encryption'", (value,))

    sealed = "sealed:" + "0" * 32
    flip: list[str] = []

    class Flipping(WriteHookStore):
        def before_write(self, key: str) -> None:
            if flip and key.startswith(objectnames.MANIFESTS):  # packs written, not yet published
                set_state(flip.pop())

    loc = tmp_path / "loc"
    with casckpt.open(tmp_path / "store", blobs=Flipping(loc), key_file=None) as store:
        store.commit({"w": torch.full((1024,), 1.0)}, run="r", step=1)
        flip.append(sealed)
        with pytest.raises(StoreKeyError, match="records this store as encrypted .* opened it as not"):
            store.commit({"w": torch.full((1024,), 2.0)}, run="r", step=2)
        assert [v.step for v in store.log("r")] == [1]
        before = _tree(loc)
        with pytest.raises(StoreKeyError, match="nothing of this write was published"):
            store.commit({"w": torch.full((1024,), 3.0)}, run="r", step=3)
        assert _tree(loc) == before  # refused before its first object
        set_state("plain")
        store.commit({"w": torch.full((1024,), 3.0)}, run="r", step=3)
        assert [v.step for v in store.log("r")] == [3, 1]
        assert store.ops.check(read_data=True).ok


# -- hostile key files and a failed init ------------------------------------------------------


@pytest.fixture(params=["fifo", "dev-zero", "directory"])
def hostile_key(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A path given as a key file that is no regular file: a FIFO nobody writes (it blocks a
    plain open), /dev/zero (it never ends), a directory."""
    if request.param == "fifo":
        path = tmp_path / "key.fifo"
        os.mkfifo(path)
        return path
    if request.param == "directory":
        path = tmp_path / "key.d"
        path.mkdir()
        return path
    return Path("/dev/zero")


def test_a_key_file_that_is_no_regular_file_is_refused_at_once(tmp_path: Path, hostile_key: Path) -> None:
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    # a reader of /dev/zero or a FIFO would never return: the bound only tells a hang from a
    # refusal (it is no timing of the refusal, which a loaded CI machine can slow past 1 s)
    started = time.monotonic()
    with pytest.raises(StoreKeyError, match="not a regular file"):
        casckpt.open(tmp_path / "api", create=True, key_file=hostile_key)
    assert time.monotonic() - started < 30.0
    assert not (tmp_path / "api").exists()  # nothing was created before the key was read
    started = time.monotonic()
    result = CliRunner().invoke(app, ["init", str(tmp_path / "cli"), "--encrypt", "--key-file",
                                      str(hostile_key)])
    assert time.monotonic() - started < 30.0
    if hostile_key.is_dir():  # the option refuses a directory itself: a usage error
        assert result.exit_code == 2 and "--key-file" in result.output, result.output
    else:
        assert result.exit_code == 8 and "not a regular file" in result.output, result.output
    assert not (tmp_path / "cli").exists()


def test_an_oversized_or_binary_key_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.key"
    big.write_bytes(b"casckpt-key-v1:" + b"A" * 100_000)
    with pytest.raises(StoreKeyError, match="over 4096 bytes"):
        casckpt.open(tmp_path / "s", create=True, key_file=big)
    binary = tmp_path / "binary.key"
    binary.write_bytes(b"\xff\xfe" * 8)
    with pytest.raises(StoreKeyError, match="not ASCII"):
        casckpt.open(tmp_path / "s", create=True, key_file=binary)
    assert not (tmp_path / "s").exists()


def test_a_failed_init_then_a_good_one_makes_a_working_encrypted_store(tmp_path: Path,
                                                                        key_file: Path) -> None:
    from typer.testing import CliRunner

    from casckpt.cli.main import app

    runner, target = CliRunner(), tmp_path / "s"
    failed = runner.invoke(app, ["init", str(target), "--encrypt", "--key-file", str(tmp_path / "missing")])
    assert failed.exit_code == 8 and "cannot read the key file" in failed.output, failed.output
    assert not target.exists()
    made = runner.invoke(app, ["init", str(target), "--encrypt", "--key-file", str(key_file)])
    assert made.exit_code == 0 and "Created an empty encrypted casckpt store" in made.output, made.output
    again = runner.invoke(app, ["init", str(target), "--encrypt", "--key-file", str(key_file)])
    assert again.exit_code == 0, again.output
    assert "already exists" in again.output and "(encrypted, 0 versions)" in again.output
    with casckpt.open(target, key_file=key_file) as store:
        store.commit(_state(), run=RUN, step=1)
        assert [k.in_use for k in store.keys.list()] == [True]
    with pytest.raises(KeyRequiredError):
        casckpt.open(target, key_file=None).close()
