"""Copies between backends in every direction, Azure (Azurite) among them: a run travels local ->
Azure -> S3 (moto) -> local, sending only what each destination lacks, and restores bit-exact
from the last store alone, with the others deleted."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import casckpt

OPTS: dict[str, Any] = {"chunk_size": 64 * 1024, "pack_size": 256 * 1024}


def _state(step: int) -> dict[str, Any]:
    frozen = torch.Generator().manual_seed(0)
    fresh = torch.Generator().manual_seed(100 + step)
    return {"frozen": torch.randn(96, 1024, generator=frozen),
            "head": torch.randn(16, 1024, generator=fresh), "step": step}


def _same(got: dict[str, Any], step: int) -> None:
    want = _state(step)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


def test_a_run_travels_local_to_azure_to_s3_and_back(tmp_path: Path, container: Any,
                                                     s3_bucket_url: Callable[[], str],
                                                     moto_endpoint: str) -> None:
    az = f"az://{container.container_name}/hot"
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "az", blobs=az, **OPTS) as on_azure, \
            casckpt.open(tmp_path / "s3", blobs=s3_bucket_url(), s3={"endpoint_url": moto_endpoint},
                         **OPTS) as on_s3, \
            casckpt.open(tmp_path / "back", **OPTS) as back:
        for step in (1, 2, 3):
            src.commit(_state(step), run="ft", step=step, tags=["best"] if step == 2 else ())
        first = src.copy("ft@2", to=on_azure)
        assert [v.step for v in first.versions] == [1, 2]
        third = src.copy("ft@3", to=on_azure)  # the frozen tensor is on Azure already
        assert 0 < third.bytes <= 16 * 1024 * 4 * 1.1
        assert on_azure.resolve("tag:best").id == src.resolve("ft@2").id
        assert on_azure.copy("ft", to=on_s3).chunks > 0
        assert on_s3.copy("ft", to=back).chunks > 0
        assert on_s3.copy("ft", to=back).nothing_sent
        assert on_azure.ops.check(read_data=True).ok and on_s3.ops.check(read_data=True).ok
        assert [v.id for v in back.log("ft")] == [v.id for v in src.log("ft")]
    for gone in ("src", "az", "s3"):
        shutil.rmtree(tmp_path / gone)
    with casckpt.open(tmp_path / "back", create=False) as back:
        for step in (1, 2, 3):
            _same(back.restore(f"ft@{step}"), step)
        assert back.resolve("tag:best").step == 2
        assert back.ops.check(read_data=True).ok
