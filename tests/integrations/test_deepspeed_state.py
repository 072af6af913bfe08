"""The DeepSpeed state codec: DeepSpeed's checkpoint objects through a real store, no pickle.

Fast (one process, no ranks); the 2-rank engines are in test_deepspeed.py (slow tier).
"""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

import casckpt  # noqa: E402
from casckpt.errors import CorruptManifestError, UnsupportedStateError  # noqa: E402
from casckpt.integrations.deepspeed_state import NODE, decode, encode  # noqa: E402


def optim_file() -> dict[str, object]:
    """A ZeRO-2 optimizer file as DeepSpeed 0.19 writes it (the objects it holds, tiny tensors)."""
    return {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(scale=1.0),
            "dynamic_loss_scaler": DynamicLossScaler(init_scale=2.0**16, scale_window=100, min_scale=1.0,
                                                    delayed_shift=2, consecutive_hysteresis=False),
            "zero_stage": ZeroStageEnum.gradients,
            "base_optimizer_state": {"state": {0: {"exp_avg": torch.randn(5), "step": torch.tensor(3.0)}},
                                     "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 1e-3}]},
            "single_partition_of_fp32_groups": [torch.randn(7)],
            "param_slice_mappings": [OrderedDict([("0.weight", fragment_address(numel=6, start=0)),
                                                  ("0.bias", fragment_address(numel=1, start=6))])],
        },
        "ds_version": "0.19.8",
        "param_shapes": [OrderedDict([("0.weight", torch.Size([2, 3])), ("0.bias", torch.Size([1]))])],
        "odd keys": {"a/b": 1, "": 2, NODE: 3},
    }


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return same(vars(a), vars(b))
    return a == b


def test_deepspeed_objects_round_trip_through_a_store_as_the_same_types(tmp_path: Path) -> None:
    original = optim_file()
    with casckpt.open(tmp_path / "store") as store:
        version = store.commit({"f.pt": encode(original)}, run="ds", step=1)
        back = decode(store.restore(version.id)["f.pt"])
        assert store.ops.check(read_data=True).ok
    assert same(back, original)
    assert type(back["optimizer_state_dict"]["zero_stage"]) is ZeroStageEnum
    assert type(back["param_shapes"][0]["0.weight"]) is torch.Size
    assert back["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0


def test_an_unknown_object_is_refused_with_its_key_path() -> None:
    class Custom:
        pass

    with pytest.raises(UnsupportedStateError, match=r"mp_rank_00_model_states.pt/client/step_obj.*Custom"):
        encode({"client": {"step_obj": Custom()}}, "mp_rank_00_model_states.pt")


def test_a_node_of_an_unknown_kind_is_refused_not_imported() -> None:
    with pytest.raises(CorruptManifestError, match="'os.system'"):
        decode({"x": {NODE: "os.system", "value": {}}})


def test_import_casckpt_never_imports_deepspeed() -> None:
    code = ("import sys, casckpt, casckpt.integrations, casckpt.integrations.deepspeed_state\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
