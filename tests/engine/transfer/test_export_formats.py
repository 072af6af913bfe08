"""Export of a version into a directory (safetensors, DCP, torch.save), each re-imported bit-exact;
a Hugging Face import exported back loads with transformers; the CLI's import and export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_import import RunsCode, assert_same, tiny_gpt2, training_state
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import InvalidArgumentError, RestoreTargetError
from casckpt.format.state import iter_leaves


def _leaves(tree: object) -> dict[str, object]:
    return dict(iter_leaves(tree))


def _state() -> dict[str, Any]:
    state = training_state()
    state["optimizer"]["state"] = {str(k): v for k, v in state["optimizer"]["state"].items()}  # DCP: str keys
    return state


@pytest.mark.parametrize("fmt", ["safetensors", "dcp", "pt"])
def test_each_format_re_imports_bit_exact(store: casckpt.Store, tmp_path: Path, fmt: str) -> None:
    state = _state()
    version = store.commit(state, run="r", step=1)
    result = store.export("r@1", tmp_path / "out", format=fmt)
    assert result.directory == tmp_path / "out" and result.format == fmt and not result.huggingface
    source = {"safetensors": "model.safetensors", "dcp": "", "pt": "checkpoint.pt"}[fmt]
    store.import_checkpoint(tmp_path / "out" / source, run="back", step=1)
    back = store.restore("back@1")
    if fmt == "pt":
        assert_same(back, store.restore("r@1"))
        return
    tensors = {p: v for p, v in _leaves(state).items() if isinstance(v, torch.Tensor)}
    if fmt == "safetensors":  # tensors by dotted path; the plain values in the metadata
        metadata = back.pop("__metadata__")
        assert metadata["casckpt.version"] == version.id
        assert json.loads(metadata["casckpt.values"])["name"] == "warmup"
        assert_same(dict(sorted(back.items())), dict(sorted(tensors.items())))
    else:
        assert_same(_leaves(back), _leaves(state))


@pytest.mark.parametrize("fmt", ["dcp", "pt"])
def test_numpy_arrays_export_as_tensors_that_load_weights_only(store: casckpt.Store, tmp_path: Path,
                                                               fmt: str) -> None:
    import numpy as np

    store.commit({"counts": np.arange(5, dtype=np.int16), "nested": [np.ones((2, 2))]}, run="np", step=1)
    store.export("np@1", tmp_path / "out", format=fmt)
    store.import_checkpoint(tmp_path / "out" / ("checkpoint.pt" if fmt == "pt" else ""), run="np", step=2)
    back = _leaves(store.restore("np@2"))
    assert torch.equal(back["counts"], torch.arange(5, dtype=torch.int16))  # type: ignore[arg-type]
    assert torch.equal(back["nested.0"], torch.ones((2, 2), dtype=torch.float64))  # type: ignore[arg-type]


def test_safetensors_metadata_survives_a_round_trip(store: casckpt.Store, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "in.safetensors"), metadata={"format": "pt"})
    store.import_checkpoint(tmp_path / "in.safetensors", run="s", step=1)
    store.export("s@1", tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and "casckpt.version" in f.metadata()


def test_a_hugging_face_import_exports_as_a_model_directory(store: casckpt.Store, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded: merged on import
    (tmp_path / "hf" / "vocab.json").write_text('{"a": 0, "/": 1}')
    store.import_checkpoint(tmp_path / "hf", run="hf", step=1)
    result = store.export("hf@1", tmp_path / "out")
    assert result.huggingface
    assert result.files == ("config.json", "generation_config.json", "model.safetensors", "vocab.json")
    assert (tmp_path / "out" / "vocab.json").read_bytes() == (tmp_path / "hf" / "vocab.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert_same(tensor, expected[name], name)
    again = store.import_checkpoint(tmp_path / "out", run="hf", step=2)  # and back again, unchanged
    assert not store.diff("hf@1", "hf@2").changed and again.new_bytes == 0


def test_export_refuses_a_non_empty_directory_and_unknown_formats(store: casckpt.Store,
                                                                  tmp_path: Path) -> None:
    store.commit({"w": torch.ones(3)}, run="r", step=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(RestoreTargetError, match="not empty"):
        store.export("r@1", tmp_path / "full")
    with pytest.raises(InvalidArgumentError, match="safetensors, dcp, pt"):
        store.export("r@1", tmp_path / "new", format="onnx")
    store.export("r@1", tmp_path / "full", format="pt", overwrite=True)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert torch.equal(torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no leftovers


def test_cli_import_and_export_with_json(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "ckpt.pt")
    root = tmp_path / "store"
    casckpt.open(root).close()
    runner = CliRunner()
    done = runner.invoke(app, ["--store", str(root), "import", str(tmp_path / "ckpt.pt"), "--run", "r",
                               "--step", "3", "--json"])
    assert done.exit_code == 0, done.output
    imported = json.loads(done.stdout)
    assert imported["version"]["run"] == "r" and imported["version"]["step"] == 3
    done = runner.invoke(app, ["--store", str(root), "export", "r@3", "--to", str(tmp_path / "out"),
                               "--format", "dcp", "--json"])
    assert done.exit_code == 0, done.output
    exported = json.loads(done.stdout)
    assert exported["format"] == "dcp" and ".metadata" in exported["files"]
    assert exported["version"]["id"] == imported["version"]["id"]
    done = runner.invoke(app, ["--store", str(root), "export", "r@3", "--to", str(tmp_path / "out")])
    assert done.exit_code == 2 and "--force" in done.output
    with casckpt.open(root, create=False) as s:
        assert_same(s.restore("r@3"), state)


def test_cli_refuses_an_unsafe_pickle_with_exit_code_2(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"evil": RunsCode(marker)}, tmp_path / "evil.pt")
    root = tmp_path / "store"
    casckpt.open(root).close()
    done = CliRunner().invoke(app, ["--store", str(root), "import", str(tmp_path / "evil.pt"),
                                    "--run", "r", "--step", "1"])
    assert done.exit_code == 2 and "evil.pt" in done.output and not marker.exists()
