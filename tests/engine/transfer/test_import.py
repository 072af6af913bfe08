"""Import of existing checkpoints as state versions: torch.save files (weights-only), safetensors
(headers validated), DCP directories and Hugging Face model directories; unsafe pickles and
forged headers refused with typed errors, nothing committed."""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import casckpt
from casckpt.errors import UnreadableCheckpointError, UnsafeCheckpointError, UnsupportedStateError
from casckpt.format.state import iter_leaves

MARKER_ENV = "CASCKPT_TEST_MARKER"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[casckpt.Store]:
    """One store for the tests of refused imports: each leaves it empty."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with casckpt.open(tmp_path_factory.mktemp("refusing") / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok and s.runs() == []


def assert_same(a: object, b: object, path: str = "") -> None:
    """Trees equal in structure, types and values; tensors bit for bit (dtype and shape too)."""
    same = type(a) is type(b) or all(isinstance(x, torch.Tensor) for x in (a, b))
    assert same or all(isinstance(x, dict) for x in (a, b)), path  # an OrderedDict comes back a dict
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b or (a != a and b != b), path


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
            "name": "warmup", "blob": b"\x00\xff", "none": None, "bf16": torch.randn(7).bfloat16()}


def test_torch_save_round_trips_bit_exact(store: casckpt.Store, tmp_path: Path) -> None:
    state = training_state()
    torch.save(state, tmp_path / "ckpt.pt")
    version = store.import_checkpoint(tmp_path / "ckpt.pt", run="r", step=1, metrics={"loss": 1.0})
    assert (version.run, version.step) == ("r", 1)
    assert_same(store.restore("r@1"), state)
    assert torch.equal(store.load_tensor("r@1", "model.0.weight"), state["model"]["0.weight"])
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(store.load_tensor("r@1", "optimizer.state.0.exp_avg"), exp_avg)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(target, storage_reader=store.dcp_reader("r@1"))  # the DCP load path reads it too
    assert_same(target["model"], state["model"])


@pytest.mark.parametrize("suffix", [".bin", ".ckpt", ".pth"])
def test_every_torch_suffix_and_the_legacy_format(store: casckpt.Store, tmp_path: Path, suffix: str) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 4}
    torch.save(state, tmp_path / f"new{suffix}")
    torch.save(state, tmp_path / f"old{suffix}", _use_new_zipfile_serialization=False)  # no mmap
    store.import_checkpoint(tmp_path / f"new{suffix}", run="r", step=1)
    store.import_checkpoint(tmp_path / f"old{suffix}", run="r", step=2)
    assert_same(store.restore("r@1"), state)
    assert_same(store.restore("r@2"), state)


class RunsCode:
    """Unpickling this runs a shell command (what a hostile checkpoint does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class CustomClass:
    """A class of this test module: weights_only refuses it as well."""

    def __init__(self) -> None:
        self.x = 1


def _nothing_committed(store: casckpt.Store) -> None:
    assert store.runs() == [] and store.log() == []


def test_a_pickle_that_runs_code_is_refused_and_the_code_never_runs(empty_store: casckpt.Store,
                                                                      tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "evil": RunsCode(marker)}, tmp_path / "evil.pt")
    with open(tmp_path / "raw.bin", "wb") as f:  # a bare pickle (no torch zip) too
        pickle.dump(RunsCode(marker), f)
    for name in ("evil.pt", "raw.bin"):
        with pytest.raises(UnsafeCheckpointError) as caught:
            empty_store.import_checkpoint(tmp_path / name, run="r", step=1)
        assert name in str(caught.value) and caught.value.path == str(tmp_path / name)
        assert "convert" in str(caught.value)
        assert "system" in str(caught.value) or name == "raw.bin"  # a bare pickle fails on its first opcode
    assert not marker.exists()
    _nothing_committed(empty_store)


def test_a_custom_class_is_refused_naming_it(empty_store: casckpt.Store, tmp_path: Path) -> None:
    torch.save({"obj": CustomClass()}, tmp_path / "custom.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="CustomClass"):
        empty_store.import_checkpoint(tmp_path / "custom.ckpt", run="r", step=1)
    _nothing_committed(empty_store)


def test_a_loaded_object_the_state_cannot_hold_is_named_by_path(empty_store: casckpt.Store,
                                                               tmp_path: Path) -> None:
    torch.save({"opt": {"shape": torch.Size([2, 3])}}, tmp_path / "size.pt")  # weights_only loads it
    with pytest.raises(UnsupportedStateError, match="opt.shape"):
        empty_store.import_checkpoint(tmp_path / "size.pt", run="r", step=1)
    _nothing_committed(empty_store)


def test_safetensors_with_metadata(store: casckpt.Store, tmp_path: Path) -> None:
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "h": torch.randn(2).half(), "empty": torch.zeros(0, 3)}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt", "note": "x"})
    store.import_checkpoint(tmp_path / "m.safetensors", run="r", step=1)
    restored = store.restore("r@1")
    assert restored.pop("__metadata__") == {"format": "pt", "note": "x"}
    assert_same(dict(sorted(restored.items())), dict(sorted(tensors.items())))
    assert torch.equal(store.load_tensor("r@1", "a.weight"), tensors["a.weight"])


SAFE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
               torch.int16, torch.int32, torch.int64, torch.bool]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(SAFE_DTYPES), st.lists(st.integers(0, 5), max_size=3)),
                min_size=1, max_size=5),
       st.integers(0, 2**31))
def test_safetensors_round_trips_of_any_dtype_and_shape(store: casckpt.Store, tmp_path: Path,
                                                         specs: list[tuple[torch.dtype, list[int]]],
                                                         seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,),
                                      dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
               if dtype != torch.bool else torch.randint(0, 2, shape, generator=g).bool()
               for i, (dtype, shape) in enumerate(specs)}
    path = tmp_path / f"h{seed}.safetensors"
    save_file(tensors, str(path))
    step = len(store.log())
    store.import_checkpoint(path, run="h", step=step)
    assert_same(dict(sorted(store.restore(f"h@{step}").items())), dict(sorted(tensors.items())))


def _header(entries: dict[str, Any], data: bytes, length: int | None = None) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


FORGED = {
    "offset beyond the file": _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}},
                                      bytes(16)),
    "overlapping ranges": _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
    "length mismatch": _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
    "unknown dtype": _header({"a": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "header length > file": _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                                     bytes(8), length=10_000),
    "a gap": _header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12)),
    "bytes after the last tensor": _header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                           bytes(8)),
    "negative shape": _header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
    "not JSON": struct.pack("<Q", 5) + b"{nope" + bytes(4),
    "not an object": struct.pack("<Q", 2) + b"[]",
    "too short": b"\x01\x02",
    "duplicate names": struct.pack("<Q", 2 * 58 + 1) + (
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}' + bytes(2)),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_forged_safetensors_headers_are_refused(empty_store: casckpt.Store, tmp_path: Path,
                                                forgery: str) -> None:
    path = tmp_path / "forged.safetensors"
    path.write_bytes(FORGED[forgery])
    with pytest.raises(UnreadableCheckpointError) as caught:
        empty_store.import_checkpoint(path, run="r", step=1)
    assert str(path) in str(caught.value) and "not a valid safetensors file" in str(caught.value)
    _nothing_committed(empty_store)


def test_dcp_directory(store: casckpt.Store, tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(6, 5), "b": torch.zeros(3, dtype=torch.bfloat16)},
             "opt": {"state": {"0": {"exp_avg": torch.ones(4)}},
                     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
             "step": 7, "name": "x"}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    restored = store.restore("d@1")
    assert dict(iter_leaves(restored)).keys() == dict(iter_leaves(state)).keys()
    for path, leaf in iter_leaves(state):
        assert_same(dict(iter_leaves(restored))[path], leaf, path)
    assert torch.equal(store.load_tensor("d@1", "model.w"), state["model"]["w"])


def test_dcp_metadata_that_runs_code_is_refused(empty_store: casckpt.Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*system"):
        empty_store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    assert not marker.exists()
    _nothing_committed(empty_store)


def test_a_refused_dcp_metadata_logs_no_traceback(empty_store: casckpt.Store, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(UnsafeCheckpointError):
        empty_store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    logging.getLogger().warning("after the import", exc_info=ValueError("still logged"))
    assert caplog.records[-1].exc_info  # the quieting ended with the import
    # what a user at a terminal sees: casckpt's one line, no traceback of DCP's loader
    store = tmp_path / "store"
    cli = [sys.executable, "-m", "casckpt.cli.main"]
    subprocess.run([*cli, "init", str(store)], check=True, capture_output=True)
    result = subprocess.run([*cli, "--store", str(store), "import", str(tmp_path / "dcp"), "--run", "d",
                             "--step", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "needs code execution" in result.stderr
    assert "Traceback" not in result.stderr and "metadata is not found" not in result.stderr, result.stderr
    assert not marker.exists()


def test_a_dcp_directory_missing_its_data_is_refused(empty_store: casckpt.Store, tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    for piece in (tmp_path / "dcp").glob("*.distcp"):
        piece.unlink()
    with pytest.raises(UnreadableCheckpointError, match="DCP could not read"):
        empty_store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    _nothing_committed(empty_store)


def test_a_dcp_value_that_runs_code_is_refused(empty_store: casckpt.Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "evil": RunsCode(marker)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="evil"):
        empty_store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    assert not marker.exists()
    _nothing_committed(empty_store)


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_hugging_face_directory(store: casckpt.Store, tmp_path: Path, shard: str | None) -> None:
    model = tiny_gpt2()
    out = tmp_path / "hf"
    model.save_pretrained(out, **({} if shard is None else {"max_shard_size": shard}))
    model.generation_config.save_pretrained(out)
    (out / "merges.txt").write_bytes(b"#version: 0.2\n\xc4\xa0 t\n")
    assert (out / "model.safetensors.index.json").is_file() == (shard is not None)
    store.import_checkpoint(out, run="hf", step=1)
    restored = store.restore("hf@1")
    assert restored["layout"] == "huggingface"
    assert restored["config"] == json.loads((out / "config.json").read_text())
    assert restored["files"] == {"generation_config.json": (out / "generation_config.json").read_bytes(),
                                 "merges.txt": (out / "merges.txt").read_bytes()}
    expected = model.state_dict()
    assert restored["model"].keys() <= expected.keys() and "transformer.wte.weight" in restored["model"]
    for name, tensor in restored["model"].items():
        assert_same(tensor, expected[name], name)
    assert torch.equal(store.load_tensor("hf@1", "model.transformer.h.1.mlp.c_fc.weight"),
                       expected["transformer.h.1.mlp.c_fc.weight"])


def test_hugging_face_directory_of_pytorch_model_bin(store: casckpt.Store, tmp_path: Path) -> None:
    model = tiny_gpt2()
    model.config.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")  # loaded weights-only
    store.import_checkpoint(tmp_path / "hf", run="bin", step=1)
    restored = store.restore("bin@1")
    assert restored["files"] == {} and restored["model"].keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert_same(restored["model"][name], tensor, name)


@pytest.mark.parametrize("name", ["notes.txt", "empty-dir", "missing.pt"])
def test_anything_else_is_refused_listing_what_is_supported(empty_store: casckpt.Store, tmp_path: Path,
                                                            name: str) -> None:
    if name == "notes.txt":
        (tmp_path / name).write_text("hi")
    elif name == "empty-dir":
        (tmp_path / name).mkdir()
    with pytest.raises(UnreadableCheckpointError, match="safetensors file, a torch.distributed.checkpoint"):
        empty_store.import_checkpoint(tmp_path / name, run="r", step=1)
    _nothing_committed(empty_store)


def test_a_bad_run_name_is_refused_before_the_file_is_read(empty_store: casckpt.Store,
                                                           tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"evil": RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(casckpt.errors.InvalidNameError):
        empty_store.import_checkpoint(tmp_path / "evil.pt", run="../x", step=1)
    assert not marker.exists()
