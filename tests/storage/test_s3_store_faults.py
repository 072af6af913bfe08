"""Faults on the S3 path, seen through whole commits and restores.

A fault-injecting proxy on 127.0.0.1 sits between the store and the moto S3
server: 500 / 503 SlowDown answers and connections cut mid-upload and
mid-download. Commits retry and succeed, or fail cleanly with nothing
visible; restores retry; nothing stored is ever lost. An outage longer than
the storage retry budget is a typed StoreUnavailableError, never missing data.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.cli.shared import EXIT_DENIED, EXIT_UNAVAILABLE, exit_code_for
from casckpt.errors import AccessDeniedError, IntegrityError, StorageError, StoreUnavailableError

sys.path.insert(0, str(Path(__file__).parent))
from casckpt.testing.faultproxy import FaultProxy

CHUNK = 4096


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint) as running:
        yield running


@pytest.fixture
def store(tmp_path: Path, proxy: FaultProxy, s3_bucket_url: Any) -> Iterator[casckpt.Store]:
    s3 = {"endpoint_url": proxy.endpoint_url, "multipart_threshold": 5 << 20,
          "multipart_chunksize": 5 << 20, "sdk_attempts": 2, "retry_attempts": 4}
    with casckpt.open(tmp_path / "store", blobs=s3_bucket_url(), s3=s3, chunk_size=CHUNK,
                      pack_size=64 << 10) as opened:
        yield opened


def _state(seed: int, n: int = 40_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(n // 10, generator=g)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fault", ["503-slowdown", "500", "cut-upload", "dropped-response"])
def test_commit_retries_through_faults(store: casckpt.Store, proxy: FaultProxy, fault: str) -> None:
    state = _state(1)
    if fault == "503-slowdown":
        proxy.fail_next(3, status=503, code="SlowDown", methods={"PUT"})
    elif fault == "500":
        proxy.fail_next(3, status=500, code="InternalError", methods={"PUT"})
    elif fault == "cut-upload":
        proxy.cut_next_upload(2)
    else:
        proxy.drop_next_response(2, methods={"PUT"})
    version = store.commit(state, run="r", step=1)
    assert proxy.pending_faults() == 0  # every fault really fired
    assert _equal(store.restore(version.id), state)
    assert store.ops.check(read_data=True).ok


@pytest.mark.parametrize("fault", ["cut-download", "503", "500"])
def test_restore_retries_through_faults(store: casckpt.Store, proxy: FaultProxy, fault: str) -> None:
    state = _state(2)
    store.commit(state, run="r", step=1)
    if fault == "cut-download":
        proxy.cut_next_download(3, path_contains="packs/")
    else:
        proxy.fail_next(3, status=int(fault), code="SlowDown" if fault == "503" else "InternalError",
                        methods={"GET"}, path_contains="packs/")
    assert _equal(store.restore("r@1"), state)
    assert proxy.pending_faults() == 0
    assert _equal({"w": store.load_tensor("r@1", "w")}, {"w": state["w"]})


def test_commit_that_cannot_get_through_fails_cleanly(store: casckpt.Store, proxy: FaultProxy) -> None:
    before = _state(3)
    store.commit(before, run="r", step=1)
    proxy.fail_next(1000, status=503, code="SlowDown", methods={"PUT", "POST"})
    with pytest.raises(StorageError) as err:
        store.commit(_state(4), run="r", step=2)
    assert "SlowDown" in str(err.value) or "503" in str(err.value)
    proxy.clear_faults()
    assert [v.step for v in store.log("r")] == [1]  # nothing half-visible
    assert store.ops.check(read_data=True).ok
    assert _equal(store.restore("r@1"), before)
    after = _state(4)
    store.commit(after, run="r", step=2)  # the store works once S3 does
    assert _equal(store.restore("r@2"), after)
    assert store.ops.check(read_data=True).ok


# -- an outage is not data loss (issue 35): ec:4+2 on six buckets behind the proxy ----------

EC_RETRY_S = "1.5"  # the storage retry budget in these tests: short, so a window outlasts it


@pytest.fixture
def ec_store(tmp_path: Path, proxy: FaultProxy, s3_bucket_url: Any, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> Iterator[casckpt.Store]:
    monkeypatch.setenv("CASCKPT_STORAGE_RETRY_S", getattr(request, "param", EC_RETRY_S))
    s3 = {"endpoint_url": proxy.endpoint_url, "sdk_attempts": 1, "retry_attempts": 2}
    with casckpt.open(tmp_path / "store", blobs=[s3_bucket_url() for _ in range(6)], s3=s3,
                      redundancy="ec:4+2", chunk_size=CHUNK, pack_size=64 << 10) as opened:
        yield opened


def _outage(proxy: FaultProxy, fault: str) -> None:
    """Every read of the six buckets fails, the way ``fault`` fails, until clear_faults()."""
    reads = {"GET", "HEAD"}
    if fault == "connection-drop":
        proxy.drop_next_response(1_000_000, methods=reads)
    elif fault == "503-slowdown":
        proxy.fail_next(1_000_000, status=503, code="SlowDown", methods=reads)
    else:
        proxy.fail_next(1_000_000, status=403, code="AccessDenied", methods=reads)


def _damaged(store: casckpt.Store) -> int:
    return sum(loc.damaged for loc in store.locations.list())


@pytest.mark.parametrize("fault", ["connection-drop", "503-slowdown"])
def test_outage_is_unavailable_not_missing(ec_store: casckpt.Store, proxy: FaultProxy, fault: str) -> None:
    state = _state(5)
    ec_store.commit(state, run="r", step=1)
    _outage(proxy, fault)
    with pytest.raises(StoreUnavailableError) as err:  # typed, retryable, and no integrity error
        ec_store.restore("r@1")
    assert not isinstance(err.value, IntegrityError)
    assert exit_code_for(err.value) == EXIT_UNAVAILABLE == 9
    assert "nothing was marked" in str(err.value)
    during = ec_store.ops.check()
    assert not during.ok  # it could not verify ...
    said = " ".join(p.detail for p in during.problems)
    assert "could not be verified" in said
    assert {p.kind for p in during.problems} == {"location"}  # ... and never that data is lost
    assert "missing" not in said.replace("nothing was found missing", "")
    assert "cannot be restored" not in said
    mended = ec_store.ops.repair()
    assert mended.shards_rewritten == 0 and not mended.ok
    assert "left alone" in " ".join(mended.unrepaired)
    proxy.clear_faults()
    assert _damaged(ec_store) == 0  # no shard was marked missing or damaged
    assert ec_store.ops.check().ok
    assert ec_store.ops.repair().shards_rewritten == 0
    assert _equal(ec_store.restore("r@1"), state)
    assert ec_store.ops.check(read_data=True).ok


def test_a_denial_stops_restore_check_and_repair_and_marks_nothing(ec_store: casckpt.Store,
                                                                   proxy: FaultProxy) -> None:
    state = _state(5)
    ec_store.commit(state, run="r", step=1)
    _outage(proxy, "access-denied")
    for call in (lambda: ec_store.restore("r@1"), lambda: ec_store.ops.check(read_data=True),
                 ec_store.ops.repair):
        with pytest.raises(AccessDeniedError) as err:  # refused: neither unavailable nor lost
            call()
        assert exit_code_for(err.value) == EXIT_DENIED
    proxy.clear_faults()
    assert _damaged(ec_store) == 0  # no shard was marked missing or damaged
    assert ec_store.ops.check(read_data=True).ok
    assert ec_store.ops.repair().shards_rewritten == 0
    assert _equal(ec_store.restore("r@1"), state)


def test_outage_during_read_data_check_loses_nothing(ec_store: casckpt.Store, proxy: FaultProxy) -> None:
    ec_store.commit(_state(6), run="r", step=1)
    proxy.drop_next_response(1_000_000, methods={"GET"}, path_contains="packs/")  # listings work
    during = ec_store.ops.check(read_data=True)
    said = " ".join(p.detail for p in during.problems)
    assert not during.ok and "could not be" in said and "cannot be restored" not in said
    assert "cannot be reconstructed" not in said
    proxy.clear_faults()
    assert _damaged(ec_store) == 0
    assert ec_store.ops.check(read_data=True).ok
    assert ec_store.ops.repair().shards_rewritten == 0


@pytest.mark.parametrize("ec_store", ["20"], indirect=True)  # a budget the outage ends well inside
def test_restore_waits_out_a_short_outage(ec_store: casckpt.Store, proxy: FaultProxy,
                                          caplog: pytest.LogCaptureFixture) -> None:
    state = _state(7)
    ec_store.commit(state, run="r", step=1)
    _outage(proxy, "connection-drop")
    threading.Timer(2.5, proxy.clear_faults).start()  # the outage ends inside the budget
    phases: list[tuple[str, int, int]] = []
    with caplog.at_level(logging.WARNING, logger="casckpt"):
        restored = ec_store.restore("r@1", progress=lambda *call: phases.append(call))
    assert _equal(restored, state)
    assert "waiting for storage" in caplog.text
    assert ("wait", 20) in {(phase, total) for phase, _, total in phases}  # progress says so too
    assert _damaged(ec_store) == 0


def test_a_404_shard_is_still_missing_and_repaired(ec_store: casckpt.Store, moto_endpoint: str) -> None:
    import boto3

    state = _state(8)
    ec_store.commit(state, run="r", step=1)
    url = ec_store.locations.list()[0].url
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/packs/")
            .get("Contents", [])]
    assert keys
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    found = ec_store.ops.check()
    assert not found.ok and any("missing" in p.detail for p in found.problems if p.kind == "shard")
    mended = ec_store.ops.repair()
    assert mended.shards_rewritten == len(keys) and mended.ok
    assert ec_store.ops.check(read_data=True).ok
    assert _equal(ec_store.restore("r@1"), state)
