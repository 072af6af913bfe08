"""A store whose locations are Azure containers and local directories: commit, restore and gc
with ec:2+1 shards spread over both, bit-exact, through casckpt.open like any user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import casckpt


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 257, generator=gen), "b": torch.randint(0, 1 << 30, (999,),
                                                                          generator=gen)}


def _blob_names(container: Any, prefix: str) -> set[str]:
    return {b.name for b in container.list_blobs(name_starts_with=prefix)}


def test_ec_round_trip_and_gc_across_azure_and_local(tmp_path: Path, container: Any) -> None:
    az = f"az://{container.container_name}/team/ckpts"
    blobs = [az, str(tmp_path / "d1"), str(tmp_path / "d2")]
    with casckpt.open(tmp_path / "store", blobs=blobs, redundancy="ec:2+1", chunk_size=64 * 1024,
                      pack_size=256 * 1024) as store:
        store.commit(_state(1), run="r", step=1)
        store.commit(_state(2), run="r", step=2)
        on_azure = {n for n in _blob_names(container, "team/ckpts/packs/") if ".s" in n}
        assert on_azure, "a shard of every pack is on Azure"
        assert store.ops.check(read_data=True).ok
    with casckpt.open(tmp_path / "store", create=False) as store:  # the config file names az://
        for step in (1, 2):
            restored = store.restore(f"r@{step}")
            for name, tensor in _state(step).items():
                assert torch.equal(restored[name], tensor), name
        store.delete("r@1")
        report = store.gc(grace=0)
        assert report.packs_deleted > 0
        left = {n for n in _blob_names(container, "team/ckpts/packs/") if ".s" in n}
        assert left < on_azure, "gc deleted shards on Azure"
        restored = store.restore("r@2")
        assert all(torch.equal(restored[k], v) for k, v in _state(2).items())
        assert store.ops.check(read_data=True).ok


def test_cli_init_and_location_add_take_az_urls(tmp_path: Path, container: Any) -> None:
    import json

    from typer.testing import CliRunner

    from casckpt.cli.main import app

    root, az = tmp_path / "store", f"az://{container.container_name}/cli"
    made = CliRunner().invoke(app, ["init", str(root), "--blobs", az])
    assert made.exit_code == 0, made.output
    assert f'blobs = "{az}"' in (root / "casckpt.toml").read_text()
    added = CliRunner().invoke(app, ["--store", str(root), "location", "add", f"{az}-second",
                                     "--name", "second", "--json"])
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["url"] == f"{az}-second" and json.loads(added.stdout)["reachable"]
    with casckpt.open(root, create=False) as store:
        store.commit(_state(3), run="r", step=1)
        assert torch.equal(store.restore("r@1")["w"], _state(3)["w"])
    assert _blob_names(container, "cli/manifests/") or _blob_names(container, "cli-second/manifests/")
