"""Faults on the S3 path, seen through whole commits and restores.

A fault-injecting proxy on 127.0.0.1 sits between the store and the moto S3
server: 500 / 503 SlowDown answers and connections cut mid-upload and
mid-download. Commits retry and succeed, or fail cleanly with nothing
visible; restores retry; nothing stored is ever lost.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import StorageError

sys.path.insert(0, str(Path(__file__).parent))
from faultproxy import FaultProxy  # noqa: E402

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
    assert store.check(read_data=True).ok


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
    assert store.check(read_data=True).ok
    assert _equal(store.restore("r@1"), before)
    after = _state(4)
    store.commit(after, run="r", step=2)  # the store works once S3 does
    assert _equal(store.restore("r@2"), after)
    assert store.check(read_data=True).ok
