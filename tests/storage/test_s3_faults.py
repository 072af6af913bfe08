"""S3 under faults: a fault-injecting proxy between the store and the moto server.

Every fault (500 / 503 / SlowDown answers, connections cut mid-upload and
mid-download, responses lost after the server acted, stalls past the read
timeout) on every operation: the store wrapped in RetryingBlobStore succeeds
and the data is bit-exact. With more consecutive faults than attempts it fails
with a clean RetryableStorageError and leaves no object (and no multipart
upload) behind. Objects are checked with a client that bypasses the proxy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from casckpt.errors import RetryableStorageError
from casckpt.storage import RetryingBlobStore
from casckpt.storage.s3 import S3BlobStore
from casckpt.testing.blobstore import blob
from casckpt.testing.faultproxy import FaultProxy

MiB = 1024 * 1024
ATTEMPTS = 4
BIG = 11 * MiB + 5  # three parts of 5 MiB

Arm = Callable[[FaultProxy], None]


def make_store(proxy: FaultProxy, bucket: str, session: Any, *, attempts: int = ATTEMPTS,
               **options: Any) -> RetryingBlobStore:
    options.setdefault("sdk_attempts", 1)  # count every try in the wrapper
    inner = S3BlobStore(f"s3://{bucket}/f", endpoint_url=proxy.endpoint_url, session=session,
                        multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, **options)
    return RetryingBlobStore(inner, attempts=attempts, base_delay=0.001, max_delay=0.01)


@pytest.fixture
def faulty(fault_proxy: FaultProxy, bucket: str, boto_session: Any) -> Iterator[RetryingBlobStore]:
    store = make_store(fault_proxy, bucket, boto_session)
    yield store
    store.close()


def raw(s3_admin: Any, bucket: str, key: str) -> bytes | None:
    try:
        data: bytes = s3_admin.get_object(Bucket=bucket, Key=f"f/{key}")["Body"].read()
    except s3_admin.exceptions.NoSuchKey:
        return None
    return data


def pending_multipart_uploads(s3_admin: Any, bucket: str) -> list[Any]:
    uploads: list[Any] = s3_admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return uploads


N = ATTEMPTS - 1  # faults in a row that the retries must absorb
PUT_FAULTS: dict[str, Arm] = {
    "503-slowdown": lambda p: p.fail_next(N, status=503, code="SlowDown", methods={"PUT"}),
    "503-unavailable": lambda p: p.fail_next(N, status=503, code="ServiceUnavailable",
                                             methods={"PUT"}),
    "500-internal": lambda p: p.fail_next(N, status=500, code="InternalError", methods={"PUT"}),
    "cut-upload": lambda p: p.cut_next_upload(N),
    "response-lost": lambda p: p.drop_next_response(N, methods={"PUT"}),
    "mixed": lambda p: (p.cut_next_upload(1), p.fail_next(1, methods={"PUT"}),
                        p.drop_next_response(1, methods={"PUT"})),
}
MULTIPART_FAULTS: dict[str, Arm] = {
    "part-503": lambda p: p.fail_next(N, methods={"PUT"}, path_contains="partNumber="),
    "part-cut": lambda p: p.cut_next_upload(N, path_contains="partNumber="),
    "part-response-lost": lambda p: p.drop_next_response(N, path_contains="partNumber="),
    "create-500": lambda p: p.fail_next(N, status=500, code="InternalError",
                                        path_contains="?uploads"),
    "complete-503": lambda p: p.fail_next(N, methods={"POST"}, path_contains="uploadId="),
    "complete-response-lost": lambda p: p.drop_next_response(1, methods={"POST"},
                                                             path_contains="uploadId="),
}
GET_FAULTS: dict[str, Arm] = {
    "503-slowdown": lambda p: p.fail_next(N, methods={"GET"}),
    "500-internal": lambda p: p.fail_next(N, status=500, code="InternalError", methods={"GET"}),
    "cut-download": lambda p: p.cut_next_download(N),
    "cut-download-early": lambda p: p.cut_next_download(N, fraction=0.01),
}


@pytest.mark.parametrize("fault", sorted(PUT_FAULTS))
def test_put_survives(fault: str, faulty: RetryingBlobStore, fault_proxy: FaultProxy,
                      s3_admin: Any, bucket: str) -> None:
    data = blob(300_000, seed=1)
    PUT_FAULTS[fault](fault_proxy)
    faulty.put("packs/aa/put", data)
    assert fault_proxy.pending_faults() == 0, "every programmed fault fired"
    assert raw(s3_admin, bucket, "packs/aa/put") == data


@pytest.mark.parametrize("fault", sorted(MULTIPART_FAULTS))
def test_multipart_put_file_survives(fault: str, faulty: RetryingBlobStore,
                                     fault_proxy: FaultProxy, s3_admin: Any, bucket: str,
                                     tmp_path: Path) -> None:
    data = blob(BIG, seed=2)
    path = tmp_path / "pack"
    path.write_bytes(data)
    MULTIPART_FAULTS[fault](fault_proxy)
    faulty.put_file("packs/bb/multi", path)
    assert fault_proxy.pending_faults() == 0
    assert raw(s3_admin, bucket, "packs/bb/multi") == data
    head = s3_admin.head_object(Bucket=bucket, Key="f/packs/bb/multi")
    assert head["ETag"].strip('"').endswith("-3")


@pytest.mark.parametrize("fault", sorted(GET_FAULTS))
def test_get_survives(fault: str, faulty: RetryingBlobStore, fault_proxy: FaultProxy,
                      s3_admin: Any, bucket: str) -> None:
    data = blob(2 * MiB + 1, seed=3)
    s3_admin.put_object(Bucket=bucket, Key="f/packs/cc/get", Body=data)
    GET_FAULTS[fault](fault_proxy)
    assert faulty.get("packs/cc/get") == data
    assert fault_proxy.pending_faults() == 0


@pytest.mark.parametrize("fault", sorted(GET_FAULTS))
def test_get_range_survives(fault: str, faulty: RetryingBlobStore, fault_proxy: FaultProxy,
                            s3_admin: Any, bucket: str) -> None:
    data = blob(2 * MiB + 1, seed=4)
    s3_admin.put_object(Bucket=bucket, Key="f/packs/cc/range", Body=data)
    GET_FAULTS[fault](fault_proxy)
    assert faulty.get_range("packs/cc/range", MiB - 3, MiB) == data[MiB - 3:2 * MiB - 3]
    assert fault_proxy.pending_faults() == 0


def test_reads_survive_a_stall_past_the_read_timeout(fault_proxy: FaultProxy, bucket: str,
                                                    boto_session: Any, s3_admin: Any) -> None:
    data = blob(100_000, seed=5)
    s3_admin.put_object(Bucket=bucket, Key="f/packs/cc/slow", Body=data)
    store = make_store(fault_proxy, bucket, boto_session, read_timeout=0.5)
    try:
        fault_proxy.stall_next(1, seconds=2.5, methods={"GET"})
        started = time.monotonic()
        assert store.get("packs/cc/slow") == data
        fault_proxy.stall_next(1, seconds=2.5, methods={"GET"})
        assert store.get_range("packs/cc/slow", 7, 1000) == data[7:1007]
        assert time.monotonic() - started < 2.5, "the stalled requests timed out and were retried"
        assert fault_proxy.pending_faults() == 0
    finally:
        store.close()


def test_get_catches_bytes_damaged_in_transit(faulty: RetryingBlobStore,
                                              fault_proxy: FaultProxy, s3_admin: Any,
                                              bucket: str) -> None:
    # get() asks for the stored CRC32 and botocore checks the body against it.
    # Ranged reads carry no checksum: the engine verifies their chunk ids.
    data = blob(300_000, seed=6)
    faulty.put("packs/cc/crc", data)
    fault_proxy.corrupt_next_download(N)
    assert faulty.get("packs/cc/crc") == data
    assert fault_proxy.faults_fired()["corrupt_download"] == N


def test_size_list_and_delete_survive(faulty: RetryingBlobStore, fault_proxy: FaultProxy,
                                      s3_admin: Any, bucket: str) -> None:
    s3_admin.put_object(Bucket=bucket, Key="f/packs/dd/one", Body=b"12345")
    fault_proxy.fail_next(N, methods={"HEAD"})
    assert faulty.size("packs/dd/one") == 5
    fault_proxy.fail_next(N, status=500, code="InternalError", path_contains="list-type=2")
    assert [i.key for i in faulty.list("packs/")] == ["packs/dd/one"]
    fault_proxy.cut_next_download(N, path_contains="list-type=2")
    assert [i.key for i in faulty.list("packs/")] == ["packs/dd/one"]
    fault_proxy.fail_next(N, methods={"DELETE"})
    faulty.delete("packs/dd/one")
    assert fault_proxy.pending_faults() == 0
    assert raw(s3_admin, bucket, "packs/dd/one") is None


# more faults than attempts ----------------------------------------------------

@pytest.mark.parametrize("fault", ["503-slowdown", "cut-upload"])
def test_put_that_keeps_failing_leaves_nothing(fault: str, faulty: RetryingBlobStore,
                                               fault_proxy: FaultProxy, s3_admin: Any,
                                               bucket: str) -> None:
    if fault == "cut-upload":
        fault_proxy.cut_next_upload(ATTEMPTS)
    else:
        fault_proxy.fail_next(ATTEMPTS, methods={"PUT"})
    with pytest.raises(RetryableStorageError, match="packs/ee/fail"):
        faulty.put("packs/ee/fail", blob(100_000))
    assert fault_proxy.pending_faults() == 0
    assert faulty.size("packs/ee/fail") is None
    assert raw(s3_admin, bucket, "packs/ee/fail") is None


def test_multipart_that_keeps_failing_leaves_nothing(faulty: RetryingBlobStore,
                                                     fault_proxy: FaultProxy, s3_admin: Any,
                                                     bucket: str, tmp_path: Path) -> None:
    path = tmp_path / "pack"
    path.write_bytes(blob(BIG))
    fault_proxy.cut_next_upload(1000, path_contains="partNumber=")
    with pytest.raises(RetryableStorageError):
        faulty.put_file("packs/ee/multi", path)
    fault_proxy.clear_faults()
    assert faulty.size("packs/ee/multi") is None
    assert pending_multipart_uploads(s3_admin, bucket) == [], "failed uploads are aborted"
    assert path.exists()


def test_get_that_keeps_failing_is_a_clean_retryable_error(
        faulty: RetryingBlobStore, fault_proxy: FaultProxy, s3_admin: Any, bucket: str) -> None:
    s3_admin.put_object(Bucket=bucket, Key="f/packs/ff/g", Body=blob(100_000))
    fault_proxy.cut_next_download(ATTEMPTS)
    with pytest.raises(RetryableStorageError, match="packs/ff/g"):
        faulty.get("packs/ff/g")
    fault_proxy.cut_next_download(ATTEMPTS)
    with pytest.raises(RetryableStorageError, match="packs/ff/g"):
        faulty.get_range("packs/ff/g", 10, 50_000)
    assert faulty.get("packs/ff/g") == blob(100_000)


def test_sdk_retries_absorb_a_fault_without_the_wrapper(
        fault_proxy: FaultProxy, bucket: str, boto_session: Any) -> None:
    store = make_store(fault_proxy, bucket, boto_session, attempts=1, sdk_attempts=2)
    try:
        fault_proxy.fail_next(1, methods={"PUT"})
        store.put("packs/gg/sdk", b"absorbed")
        assert fault_proxy.requests_by_method()["PUT"] == 2
        assert store.get("packs/gg/sdk") == b"absorbed"
    finally:
        store.close()


def test_nothing_is_lost_under_concurrent_faults(fault_proxy: FaultProxy, bucket: str,
                                                 boto_session: Any) -> None:
    # 16 PUT and 8 GET faults land on whichever threads' requests come first,
    # possibly all on one key: give every operation more attempts than that.
    store = make_store(fault_proxy, bucket, boto_session, attempts=17)
    objects = {f"packs/{i:02x}/obj{i}": blob(50_000 + i, seed=i) for i in range(48)}
    for _ in range(4):
        fault_proxy.fail_next(2, methods={"PUT"})
        fault_proxy.cut_next_upload(1)
        fault_proxy.drop_next_response(1, methods={"PUT"})
        fault_proxy.fail_next(1, methods={"GET"})
        fault_proxy.cut_next_download(1)
    errors: list[BaseException] = []
    keys = sorted(objects)

    def worker(mine: list[str]) -> None:
        try:
            for key in mine:
                store.put(key, objects[key])
            for key in mine:
                assert store.get(key) == objects[key]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(keys[i::8],)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert fault_proxy.pending_faults() == 0
        listed = {i.key: i.size for i in store.list("packs/")}
    finally:
        store.close()
    assert listed == {k: len(v) for k, v in objects.items()}
