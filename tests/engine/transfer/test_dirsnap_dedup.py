"""Directory snapshots: format-aware segments dedup what did not change; forged listings never
write outside the target; the ``add`` / ``checkout`` commands.

Dedup is asserted through ``Version.new_bytes`` (bytes of chunks the store did not hold): an
unchanged tensor inside a rewritten safetensors file or ``torch.save`` archive, and the
unchanged stretches of a file of unknown format with bytes inserted, are not written again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import CorruptManifestError, FileHashMismatchError
from casckpt.format.segments import CDC_MAX, SMALL_RUN, plan_segments

TENSOR = 64 << 10  # float32 elements: 256 KiB a tensor
N = 8


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.weight": torch.randn(TENSOR // 256, 256, generator=gen) for i in range(N)}
    state["layers.0.bias"] = torch.randn(16, generator=gen)
    state["step"] = torch.tensor(7)
    return state


def files_equal(a: Path, b: Path) -> bool:
    return all((a / p.relative_to(b)).read_bytes() == p.read_bytes() for p in b.rglob("*") if p.is_file())


def test_safetensors_an_unchanged_tensor_writes_no_new_chunk(store: casckpt.Store, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = weights()
    save_file(state, ckpt / "model.safetensors")
    size = (ckpt / "model.safetensors").stat().st_size
    first = store.add_dir(ckpt, run="st", step=1)
    assert first.new_bytes >= N * TENSOR * 4
    state["layers.3.weight"] = state["layers.3.weight"] + 1  # one of eight tensors changes
    save_file(state, ckpt / "model.safetensors")
    second = store.add_dir(ckpt, run="st", step=2)
    assert second.new_bytes <= TENSOR * 4 + SMALL_RUN  # the changed tensor (and the header run)
    assert second.new_bytes * 6 < size
    assert files_equal(store.checkout("st@2", tmp_path / "out"), ckpt)


def test_torch_zip_an_unchanged_tensor_writes_no_new_chunk(store: casckpt.Store, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state: dict[str, Any] = {"model": weights(), "optimizer": {"lr": 0.1, "betas": (0.9, 0.99)}}
    torch.save(state, ckpt / "optimizer.pt")
    size = (ckpt / "optimizer.pt").stat().st_size
    store.add_dir(ckpt, run="pt", step=1)
    state["model"]["layers.5.weight"].mul_(2)  # one tensor of the state dict changes
    torch.save(state, ckpt / "optimizer.pt")
    second = store.add_dir(ckpt, run="pt", step=2)
    assert second.new_bytes <= TENSOR * 4 + 2 * SMALL_RUN  # the tensor, data.pkl and zip headers
    assert second.new_bytes * 6 < size
    out = store.checkout("pt@2", tmp_path / "out")
    assert (out / "optimizer.pt").read_bytes() == (ckpt / "optimizer.pt").read_bytes()
    loaded = torch.load(out / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["model"]["layers.5.weight"], state["model"]["layers.5.weight"])


def test_unknown_format_an_insertion_rewrites_only_nearby_segments(store: casckpt.Store,
                                                                    tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    blob = np.random.default_rng(1).bytes(12 << 20)
    (ckpt / "data.bin").write_bytes(blob)
    store.add_dir(ckpt, run="cdc", step=1)
    middle = len(blob) // 2
    (ckpt / "data.bin").write_bytes(blob[:middle] + b"inserted!" + blob[middle:])
    second = store.add_dir(ckpt, run="cdc", step=2)
    assert second.new_bytes <= 2 * CDC_MAX  # the segment holding the insertion (maybe its neighbour)
    assert second.new_bytes * 3 < len(blob)
    assert files_equal(store.checkout("cdc@2", tmp_path / "out"), ckpt)


def test_a_file_that_only_looks_like_safetensors_is_chunked_by_content() -> None:
    forged = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,99]}}'
    segments = plan_segments("x.safetensors", memoryview(forged))
    assert [(s.start, s.end, s.shape) for s in segments] == [(0, len(forged), None)]


# -- forged listings ---------------------------------------------------------------------


def _file(path: str, data: bytes, *, digest: str | None = None) -> dict[str, Any]:
    return {"path": path, "kind": "file", "mode": 0o644, "size": len(data),
            "blake3": digest or blake3.blake3(data).hexdigest(), "target": None,
            "parts": [np.frombuffer(data, dtype=np.uint8)] if data else []}


def _dir(path: str) -> dict[str, Any]:
    return {"path": path, "kind": "dir", "mode": 0o755, "size": 0, "blake3": None, "target": None,
            "parts": []}


def _link(path: str, target: str) -> dict[str, Any]:
    return {"path": path, "kind": "link", "mode": 0, "size": 0, "blake3": None, "target": target, "parts": []}


@pytest.mark.parametrize("files", [
    [_file("../escape", b"x")],
    [_dir("a"), _file("a/../../escape", b"x")],
    [_file("/abs/escape", b"x")],
    [_link("l", "/tmp"), _file("l/escape", b"x")],  # through a link
    [_file("a/escape", b"x")],  # parent not listed
    [_file("escape", b"x"), _file("escape", b"y")],  # twice
    [{**_file("escape", b"xy"), "size": 3}],  # parts do not add up
    [_file("./escape", b"x")],
    [{**_file("escape", b"xy"), "size": 1, "parts": [np.frombuffer(b"xy", np.uint8), "not a part"]}],
])
def test_forged_listings_are_refused_before_anything_is_written(
        store: casckpt.Store, tmp_path: Path, files: list[dict[str, Any]]) -> None:
    store.commit({"casckpt.dir": 1, "files": files}, run="forged", step=1)
    target = tmp_path / "inner" / "out"
    with pytest.raises(CorruptManifestError, match="refused"):
        store.checkout("forged@1", target)
    assert not (tmp_path / "inner").exists()  # not even the target's parent was created
    assert not (tmp_path / "escape").exists() and not Path("/abs").exists()


def test_a_file_not_matching_its_recorded_hash_leaves_nothing(store: casckpt.Store, tmp_path: Path) -> None:
    files = [_dir("d"), _file("d/ok", b"fine"), _file("d/bad", b"bytes", digest="0" * 64)]
    store.commit({"casckpt.dir": 1, "files": files}, run="forged", step=1)
    with pytest.raises(FileHashMismatchError, match="d/bad"):
        store.checkout("forged@1", tmp_path / "out")
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]


# -- the command line --------------------------------------------------------------------


def test_cli_add_and_checkout_round_trip_with_json(tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-10"
    (src / "sub").mkdir(parents=True)
    save_file(weights(), src / "model.safetensors")
    (src / "sub" / "trainer_state.json").write_text('{"global_step": 10}')
    os.symlink("model.safetensors", src / "alias")
    store = str(tmp_path / "store")
    runner = CliRunner()
    assert runner.invoke(app, ["init", store]).exit_code == 0
    added = runner.invoke(app, ["--store", store, "add", str(src), "--run", "ft", "--step", "10",
                                "--metric", "loss=0.5", "--tag", "best", "--message", "hi", "--json"])
    assert added.exit_code == 0, added.output
    version = json.loads(added.stdout)
    assert version["metadata"]["casckpt.dir"]["files"] == 2
    assert version["metrics"] == {"loss": 0.5} and version["tags"] == ["best"]
    plain = runner.invoke(app, ["--store", store, "add", str(src), "--run", "ft", "--step", "20"])
    assert plain.exit_code == 0 and "2 file(s)" in plain.stdout and "0 B new" in plain.stdout
    out = runner.invoke(app, ["--store", store, "checkout", "tag:best", str(tmp_path / "out"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["path"] == str(tmp_path / "out")
    assert files_equal(tmp_path / "out", src)
    assert os.readlink(tmp_path / "out" / "alias") == "model.safetensors"
    again = runner.invoke(app, ["--store", store, "checkout", "ft@10", str(tmp_path / "out")])
    assert again.exit_code == 2 and "not empty" in again.output
    shown = runner.invoke(app, ["--store", store, "show", "ft@10"])
    assert shown.exit_code == 0 and "directory snapshot: 2 file(s)" in shown.stdout
    bad = runner.invoke(app, ["--store", store, "add", str(src), "--run", "ft", "--step", "30",
                              "--metric", "loss"])
    assert bad.exit_code == 2 and "NAME=NUMBER" in bad.output


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_an_unchanged_tensor_writes_no_new_chunk(store: casckpt.Store, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {**weights(), "extra": {"lr": 0.1}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    size = sum(p.stat().st_size for p in (tmp_path / "dcp").iterdir())
    store.add_dir(tmp_path / "dcp", run="dcp", step=1)
    state["layers.6.weight"] = state["layers.6.weight"] * 3
    for p in (tmp_path / "dcp").iterdir():
        p.unlink()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    second = store.add_dir(tmp_path / "dcp", run="dcp", step=2)
    assert second.new_bytes <= TENSOR * 4 + 2 * SMALL_RUN
    assert second.new_bytes * 6 < size
    out = store.checkout("dcp@2", tmp_path / "out")
    assert files_equal(out, tmp_path / "dcp")
    loaded = {k: torch.empty_like(v) for k, v in weights().items()} | {"extra": {"lr": 0.0}}
    dcp.load(loaded, checkpoint_id=str(out))
    assert torch.equal(loaded["layers.6.weight"], state["layers.6.weight"])


class _Planted:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (PLANTED,))


PLANTED = ""


def test_dcp_metadata_that_names_other_code_is_never_run(store: casckpt.Store, tmp_path: Path) -> None:
    import pickle

    global PLANTED
    PLANTED = str(tmp_path / "planted")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Planted()))
    (ckpt / "__0_0.distcp").write_bytes(np.random.default_rng(2).bytes(1 << 20))
    store.add_dir(ckpt, run="hostile", step=1)
    assert not (tmp_path / "planted").exists()
    assert files_equal(store.checkout("hostile@1", tmp_path / "out"), ckpt)
