"""Azure under faults: the fault proxy between the store and Azurite, as for S3
(tests/storage/test_s3_faults.py). 500/503 answers, throttling (503 ServerBusy, 429),
connections cut mid-upload and mid-download, responses lost after Azurite acted, bytes
damaged in transit, on single puts, staged blocks, their commit and reads: the store wrapped
in RetryingBlobStore succeeds, bit-exact. Past its attempts it fails with a clean
RetryableStorageError and leaves no blob. Blobs are checked with a client bypassing the proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from casckpt.errors import RetryableStorageError
from casckpt.storage import RetryingBlobStore
from casckpt.testing.blobstore import blob
from casckpt.testing.faultproxy import FaultProxy

MiB = 1024 * 1024
ATTEMPTS = 4
N = ATTEMPTS - 1  # faults in a row that the retries must absorb
Arm = Callable[[FaultProxy], None]


@pytest.fixture
def faulty(azure_proxy: FaultProxy, container: Any) -> Iterator[RetryingBlobStore]:
    from casckpt.storage.azure import AzureBlobStore
    from casckpt.testing.azurite import connection_string

    inner = AzureBlobStore(f"az://{container.container_name}/f", sdk_attempts=1,  # every try counted here
                           connection_string=connection_string(azure_proxy.endpoint_url),
                           max_single_put_size=MiB, max_block_size=MiB // 2, max_concurrency=2)
    store = RetryingBlobStore(inner, attempts=ATTEMPTS, base_delay=0.001, max_delay=0.01)
    yield store
    store.close()


def raw(container: Any, key: str) -> bytes | None:
    client = container.get_blob_client(f"f/{key}")
    return client.download_blob().readall() if client.exists() else None  # type: ignore[no-any-return]


PUT_FAULTS: dict[str, Arm] = {
    "503-server-busy": lambda p: p.fail_next(N, status=503, code="ServerBusy", methods={"PUT"}),
    "429-throttled": lambda p: p.fail_next(N, status=429, code="TooManyRequests", methods={"PUT"}),
    "500-internal": lambda p: p.fail_next(N, status=500, code="InternalError", methods={"PUT"}),
    "cut-upload": lambda p: p.cut_next_upload(N),
    "response-lost": lambda p: p.drop_next_response(N, methods={"PUT"}),
}
BLOCK_FAULTS: dict[str, Arm] = {
    "block-503": lambda p: p.fail_next(N, methods={"PUT"}, path_contains="comp=block&"),
    "block-cut": lambda p: p.cut_next_upload(N, path_contains="comp=block&"),
    "commit-503": lambda p: p.fail_next(N, methods={"PUT"}, path_contains="comp=blocklist"),
    "commit-response-lost": lambda p: p.drop_next_response(1, path_contains="comp=blocklist"),
}
GET_FAULTS: dict[str, Arm] = {
    "503-server-busy": lambda p: p.fail_next(N, methods={"GET"}),
    "500-internal": lambda p: p.fail_next(N, status=500, code="InternalError", methods={"GET"}),
    "cut-download": lambda p: p.cut_next_download(N),
    "damaged-in-transit": lambda p: p.corrupt_next_download(N),
}


@pytest.mark.parametrize("fault", sorted(PUT_FAULTS))
def test_put_survives(fault: str, faulty: RetryingBlobStore, azure_proxy: FaultProxy,
                      container: Any) -> None:
    data = blob(300_000, seed=1)
    PUT_FAULTS[fault](azure_proxy)
    faulty.put("packs/ab/one", data)
    assert raw(container, "packs/ab/one") == data
    assert azure_proxy.pending_faults() == 0, "every programmed fault fired"


@pytest.mark.parametrize("fault", sorted(BLOCK_FAULTS))
def test_block_upload_survives(fault: str, faulty: RetryingBlobStore, azure_proxy: FaultProxy,
                               container: Any) -> None:
    data = blob(2 * MiB + 9, seed=2)  # five staged blocks
    BLOCK_FAULTS[fault](azure_proxy)
    faulty.put("packs/ab/big", data)
    assert raw(container, "packs/ab/big") == data
    assert azure_proxy.pending_faults() == 0


@pytest.mark.parametrize("fault", sorted(GET_FAULTS))
def test_reads_survive(fault: str, faulty: RetryingBlobStore, azure_proxy: FaultProxy,
                       container: Any) -> None:
    data = blob(200_000, seed=3)
    container.upload_blob("f/packs/ab/r", data)
    GET_FAULTS[fault](azure_proxy)
    assert faulty.get("packs/ab/r") == data
    GET_FAULTS[fault](azure_proxy)
    assert faulty.get_range("packs/ab/r", 1000, 50_000) == data[1000:51_000]
    assert azure_proxy.pending_faults() == 0


def test_size_list_and_delete_survive(faulty: RetryingBlobStore, azure_proxy: FaultProxy,
                                      container: Any) -> None:
    container.upload_blob("f/packs/ab/x", b"x" * 10)
    azure_proxy.fail_next(N, methods={"HEAD"})
    assert faulty.size("packs/ab/x") == 10
    azure_proxy.fail_next(N, status=500, code="InternalError", path_contains="comp=list")
    assert [i.key for i in faulty.list("packs/")] == ["packs/ab/x"]
    azure_proxy.fail_next(N, methods={"DELETE"})
    faulty.delete("packs/ab/x")
    assert raw(container, "packs/ab/x") is None
    assert azure_proxy.pending_faults() == 0


@pytest.mark.parametrize("blocks", [False, True], ids=["single", "blocks"])
def test_put_that_keeps_failing_leaves_nothing(blocks: bool, faulty: RetryingBlobStore,
                                               azure_proxy: FaultProxy, container: Any) -> None:
    data = blob(2 * MiB if blocks else 1000, seed=4)
    azure_proxy.fail_next(1000, status=503, code="ServerBusy",
                          path_contains="comp=blocklist" if blocks else None)
    with pytest.raises(RetryableStorageError):
        faulty.put("packs/ab/never", data)
    azure_proxy.clear_faults()
    assert raw(container, "packs/ab/never") is None
    assert list(container.list_blobs()) == []  # staged blocks are not a blob


def test_get_that_keeps_failing_is_a_clean_retryable_error(faulty: RetryingBlobStore,
                                                           azure_proxy: FaultProxy,
                                                           container: Any) -> None:
    container.upload_blob("f/packs/ab/g", blob(50_000))
    azure_proxy.cut_next_download(ATTEMPTS)
    with pytest.raises(RetryableStorageError) as info:
        faulty.get("packs/ab/g")
    assert "az://" in str(info.value) and "AccountKey" not in str(info.value)
