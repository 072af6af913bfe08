"""The bit-exact comparer the round-trip tests share (``exact.py``) finds every difference it
promises to: a comparer that cannot fail would let every test using it pass."""

from __future__ import annotations

import collections
import io
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from exact import exact_differences  # noqa: E402

NAN = float("nan")
OTHER_NAN = -NAN  # the same NaN with its sign bit set: == says neither, bits differ


@pytest.mark.parametrize(("got", "want"), [
    (collections.OrderedDict(a=1), {"a": 1}),  # a subclass is another type
    ({"b": 1, "a": 2}, {"a": 2, "b": 1}),  # key order
    ([1, 2], (1, 2)),
    ((1, 2), (1, 2, 3)),
    (-0.0, 0.0),
    (OTHER_NAN, NAN),
    (1, 1.0),
    (torch.tensor([-0.0]), torch.tensor([0.0])),
    (torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.float16)),
    (torch.zeros(2, 3), torch.zeros(3, 2)),
    (torch.tensor([NAN]), torch.tensor([OTHER_NAN])),
    (np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int32)),
    (np.array([0.0]), np.array([-0.0])),
    (io.BytesIO(b"ab"), io.BytesIO(b"ac")),
    ({"x": [{"y": torch.ones(1)}]}, {"x": [{"y": torch.zeros(1)}]}),
])
def test_each_difference_is_found(got: Any, want: Any) -> None:
    assert exact_differences(got, want) != []


def test_subclasses_true_takes_a_subclass_for_its_base_only() -> None:
    assert exact_differences(collections.OrderedDict(a=1.0), {"a": 1.0}, subclasses=True) == []
    assert exact_differences({"a": 1.0}, collections.OrderedDict(a=1.0), subclasses=True) != []
    assert exact_differences(collections.OrderedDict(a=-0.0), {"a": 0.0}, subclasses=True) != []


def test_a_buffer_at_another_position_differs() -> None:
    moved = io.BytesIO(b"ab")
    moved.seek(1)
    assert exact_differences(moved, io.BytesIO(b"ab")) != []


def test_equal_values_have_no_difference_and_a_nested_one_is_named() -> None:
    value = {"a": [1, 2.5, NAN, b"x", None, (torch.arange(6).reshape(2, 3), np.arange(3))],
             "b": collections.Counter(x=2), "c": io.BytesIO(b"data")}
    twin = {"a": [1, 2.5, NAN, b"x", None, (torch.arange(6).reshape(2, 3), np.arange(3))],
            "b": collections.Counter(x=2), "c": io.BytesIO(b"data")}
    assert exact_differences(twin, value) == []
    assert exact_differences(torch.tensor([math.inf]).expand(3), torch.full((3,), math.inf)) == []
    twin["a"][5] = (torch.arange(6).reshape(2, 3), np.arange(1, 4))
    assert exact_differences(twin, value) == ["<root>.a.5.1: array dtype, shape or bits differ"]
