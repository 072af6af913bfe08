"""Location health is measured, and a commit that could not place its shards says so.

- ``store.locations.list()`` / ``casckpt location list`` send every location a real
  request within a bound: a removed directory, a deleted bucket and an endpoint
  that stops answering are reported not reachable, with a reason and the time
  the probe took, in about the bound.
- A commit while a location is gone returns ``degraded=True`` (blocking and
  background), logs which location refused, ``check`` reports the pack, and
  ``show(ref).degraded`` turns False once ``repair`` has restored it; a normal
  commit is not degraded. ``casckpt show`` prints it.

Stores are ec:4+2 over six directories (write quorum 5: one location may be
gone), or ec:2+1 over three moto buckets with ``write_quorum = 2``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app
from casckpt.testing import s3 as s3_testing
from casckpt.testing.faultproxy import FaultProxy

CHUNK = 16 << 10
PACK = 64 << 10
BOUND = 2.0  # the probe timeout the tests ask for
SLACK = 3.0  # thread start-up and a loaded test machine


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(30_000, generator=gen), "b": torch.randn(2_000, generator=gen), "step": step}


def open_local(root: Path, n: int = 6, redundancy: str = "ec:4+2") -> Any:
    new = not (root / "casckpt.toml").exists()
    blobs = [str(root.parent / f"disk{i}") for i in range(n)] if new else None
    return casckpt.open(root, blobs=blobs, redundancy=redundancy if blobs else None, chunk_size=CHUNK,
                        pack_size=PACK, workers=2, cache=root.parent / "cache")


def cli(root: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--store", str(root), *args])


def by_name(infos: list[Any]) -> dict[str, Any]:
    return {info.name: info for info in infos}


def timed_locations(store: Any) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    infos = store.locations.list(timeout=BOUND)
    return by_name(infos), time.monotonic() - started


def check_kinds(store: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for problem in store.ops.check().problems:
        out.setdefault(problem.kind, []).append(problem)
    return out


# -- location health -----------------------------------------------------------------------


def test_a_removed_directory_is_unreachable_in_this_process_and_the_next(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_local(root, n=3, redundancy="none") as store:
        healthy, _ = timed_locations(store)
        assert all(i.reachable and i.reason is None and 0 <= i.probe_s <= BOUND for i in healthy.values())
        shutil.rmtree(tmp_path / "disk1")  # the disk is gone while the store is open
        infos, took = timed_locations(store)
        assert took < BOUND + SLACK
        gone = infos["loc1"]
        assert not gone.reachable and "no identity record" in (gone.reason or "")
        assert infos["loc0"].reachable and infos["loc2"].reachable

    listed = cli(root, "location", "list", "--json", "--timeout", str(BOUND))  # a new process view
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["loc1"]["reachable"] is False and "is gone" in rows["loc1"]["reason"]
    assert rows["loc0"]["reachable"] is True and rows["loc0"]["reason"] is None
    assert not (tmp_path / "disk1").exists()  # opening did not make it again, empty
    table = cli(root, "location", "list")
    assert table.exit_code == 0, table.output
    row = next(line for line in table.stdout.splitlines() if line.startswith("loc1 "))
    assert row.rstrip().endswith("no") and "PROBE" in table.stdout
    assert "loc1 is not reachable" in table.stdout and "is gone" in table.stdout


@pytest.fixture
def s3_client(moto_endpoint: str, aws_env: None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=moto_endpoint, region_name=s3_testing.REGION)


def delete_bucket(client: Any, url: str) -> None:
    bucket = url[len("s3://"):].split("/", 1)[0]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


def open_s3(root: Path, urls: list[str] | None, endpoint: str, redundancy: str = "ec:2+1") -> Any:
    return casckpt.open(root, blobs=urls, redundancy=redundancy if urls else None,
                        s3={"endpoint_url": endpoint}, chunk_size=CHUNK, pack_size=PACK, workers=2,
                        cache=root.parent / "cache")


def test_a_deleted_bucket_is_unreachable_with_its_reason(tmp_path: Path, s3_bucket_url: Callable[[], str],
                                                       moto_endpoint: str, s3_client: Any) -> None:
    urls = [s3_bucket_url() for _ in range(3)]
    root = tmp_path / "store"
    with open_s3(root, urls, moto_endpoint, redundancy="none") as store:
        assert all(i.reachable for i in store.locations.list(timeout=BOUND))
        delete_bucket(s3_client, urls[1])
        infos, took = timed_locations(store)
        assert took < BOUND + SLACK
        assert not infos["loc1"].reachable and "NoSuchBucket" in (infos["loc1"].reason or "")
        assert infos["loc1"].probe_s <= BOUND
        assert "AKIA" not in (infos["loc1"].reason or "") and "Signature" not in (infos["loc1"].reason or "")
        assert infos["loc0"].reachable and infos["loc2"].reachable

    listed = cli(root, "location", "list", "--json", "--timeout", str(BOUND))
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["loc1"]["reachable"] is False and "NoSuchBucket" in rows["loc1"]["reason"]
    assert rows["loc2"]["reachable"] is True


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint) as running:
        yield running


def test_an_endpoint_that_stops_answering_is_unreachable_within_the_bound(
        tmp_path: Path, s3_bucket_url: Callable[[], str], proxy: FaultProxy) -> None:
    url = s3_bucket_url()
    root = tmp_path / "store"
    blobs = [str(tmp_path / "disk0"), url]
    with casckpt.open(root, blobs=blobs, s3={"endpoint_url": proxy.endpoint_url}, chunk_size=CHUNK,
                      pack_size=PACK, workers=2, cache=tmp_path / "cache") as store:
        assert all(i.reachable for i in store.locations.list(timeout=BOUND))
        proxy.stall_next(1000, seconds=60)  # the endpoint accepts requests and never answers
        for _ in range(2):  # a second listing joins the probe still waiting, and is as quick
            infos, took = timed_locations(store)
            assert took < BOUND + SLACK
            silent = infos["loc1"]
            assert not silent.reachable and "no answer within" in (silent.reason or "")
            assert silent.probe_s == pytest.approx(BOUND)
            assert infos["loc0"].reachable


def test_before_a_catalog_rebuild_the_locations_records_are_not_held_against_them(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_local(root, n=2, redundancy="none") as store:
        store.commit(state(0), run="r", step=0)
    for file in root.glob("catalog.db*"):
        file.unlink()
    with casckpt.open(root, recover=True, cache=tmp_path / "cache2") as store:
        assert all(i.reachable for i in store.locations.list(timeout=BOUND))  # the rebuild adopts them
        store.ops.rebuild_catalog()
        assert all(i.reachable for i in store.locations.list(timeout=BOUND))


def test_probe_timeout_is_checked(tmp_path: Path) -> None:
    with open_local(tmp_path / "store", n=1, redundancy="none") as store:
        with pytest.raises(casckpt.errors.InvalidArgumentError):
            store.locations.list(timeout=-1)
    bad = cli(tmp_path / "store", "location", "list", "--timeout", "-1")
    assert bad.exit_code == 2


# -- degraded commits -----------------------------------------------------------------------


def test_a_normal_commit_is_not_degraded(tmp_path: Path) -> None:
    with open_local(tmp_path / "store") as store:
        version = store.commit(state(0), run="r", step=0)
        assert version.degraded is False
        assert store.commit(state(1), run="r", step=1, block=False).wait().degraded is False
        detail = store.show("r@0")
        assert detail.degraded is False and detail.degraded_packs == 0 and detail.degraded_detail is None
        assert store.ops.check().ok


def test_commit_while_a_directory_is_gone_is_degraded_until_repair(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    with open_local(root) as store:
        before = store.commit(state(0), run="r", step=0)
        assert not before.degraded
        shutil.rmtree(tmp_path / "disk1")
        with caplog.at_level(logging.WARNING, logger="casckpt.engine.write.commit"):
            version = store.commit(state(1), run="r", step=1)
        assert version.degraded is True
        warning = next(r.getMessage() for r in caplog.records if "is degraded" in r.getMessage())
        assert "r@1" in warning and "loc1" in warning and "refused" in warning
        waited = store.commit(state(2), run="r", step=2, block=False).wait()
        assert waited.degraded is True
        detail = store.show(version)
        assert detail.degraded and detail.degraded_packs > 0 and "loc1" in (detail.degraded_detail or "")
        shard_problems = check_kinds(store).get("shard", [])
        assert shard_problems and all("missing" in p.detail for p in shard_problems)
        assert {p.subject.split(":")[0][:12] for p in shard_problems} >= {
            part.split(":")[0].removeprefix("pack ") for part in (detail.degraded_detail or "").split("; ")
            if part.startswith("pack ")}

        # the location is declared lost: five domains left for six shards, so they double up
        store.locations.fail("loc1")
        assert store.show(before).degraded  # its shards on loc1 are gone for good now
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="casckpt.engine.write.commit"):
            doubled = store.commit(state(3), run="r", step=3)
        assert doubled.degraded and "share failure domain" in (store.show(doubled).degraded_detail or "")
        assert any("r@3" in r.getMessage() and "location add" in r.getMessage() for r in caplog.records)
        assert "redundancy" in check_kinds(store)

        store.locations.add(str(tmp_path / "disk6"))  # another takes its place
        assert store.ops.repair().ok
        for ref in ("r@0", "r@1", "r@2", "r@3"):
            assert store.show(ref).degraded is False, ref
        assert store.ops.check(read_data=True).ok
        assert store.commit(state(4), run="r", step=4).degraded is False


def test_show_prints_degraded(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_local(root) as store:
        store.commit(state(0), run="r", step=0)
        shutil.rmtree(tmp_path / "disk4")
        assert store.commit(state(1), run="r", step=1).degraded
    table = cli(root, "show", "r@1")
    assert table.exit_code == 0, table.output
    assert "DEGRADED" in table.stdout and "casckpt repair" in table.stdout
    # r@0's shards on disk4 went with it, but the catalog does not know that: show says what the
    # catalog records (check says what it cannot see), until the location is marked failed
    clean = cli(root, "show", "r@0")
    assert clean.exit_code == 0 and "DEGRADED" not in clean.stdout
    detail = json.loads(cli(root, "show", "r@1", "--json").stdout)
    assert detail["degraded"] is True and detail["degraded_packs"] > 0
    assert detail["version"]["degraded"] is False  # read back from the catalog: see show's field
    assert json.loads(cli(root, "show", "r@0", "--json").stdout)["degraded"] is False
    checked = cli(root, "check")
    assert checked.exit_code == 1 and "loc4" in checked.stdout
    assert cli(root, "location", "fail", "loc4").exit_code == 0
    assert json.loads(cli(root, "show", "r@0", "--json").stdout)["degraded"] is True


def test_commit_while_a_bucket_is_deleted_is_degraded_until_it_is_back_and_repaired(
        tmp_path: Path, s3_bucket_url: Callable[[], str], moto_endpoint: str, s3_client: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    urls = [s3_bucket_url() for _ in range(3)]
    root = tmp_path / "store"
    with open_s3(root, urls, moto_endpoint):
        pass
    config = root / "casckpt.toml"
    config.write_text(config.read_text().replace("[store]\n", "[store]\nwrite_quorum = 2\n", 1))
    with open_s3(root, None, moto_endpoint) as store:
        assert not store.commit(state(0), run="r", step=0).degraded
        delete_bucket(s3_client, urls[2])
        with caplog.at_level(logging.WARNING, logger="casckpt.engine.write.commit"):
            version = store.commit(state(1), run="r", step=1)
        assert version.degraded
        assert any("loc2" in r.getMessage() and "is degraded" in r.getMessage() for r in caplog.records)
        assert store.show("r@1").degraded and not store.show("r@0").degraded
        assert "shard" in check_kinds(store)
        assert not by_name(store.locations.list(timeout=BOUND))["loc2"].reachable

        s3_client.create_bucket(Bucket=urls[2][len("s3://"):].split("/", 1)[0])  # the bucket is back
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert store.show("r@1").degraded is False
        assert store.ops.check(read_data=True).ok
        assert by_name(store.locations.list(timeout=BOUND))["loc2"].reachable  # repair wrote its record
