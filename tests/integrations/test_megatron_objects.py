"""The Megatron object codec: any object of the kinds Megatron saves survives the store exactly.

The value :func:`encode` makes goes the way a save and a load take it (``torch.save`` /
``torch.load(weights_only=True)``, the writer's plain-value node, the reader's rebuild), its
tensors as copies; :func:`decode` must give back the same types, shapes, dtypes and bits.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import casckpt  # noqa: E402
from casckpt.dcp import _value_node  # noqa: E402
from casckpt.errors import CorruptManifestError, InvalidNameError, UnsupportedStateError  # noqa: E402
from casckpt.format.state import decode_state, key_ok  # noqa: E402
from casckpt.integrations import megatron_objects as objects  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from exact import exact_differences  # noqa: E402


def stored(data: Any) -> Any:
    """``data`` encoded, kept as a version keeps it, and rebuilt."""
    value, tensors = objects.encode(data, "ShardedObject 'x'")
    buffer = io.BytesIO()
    torch.save(value, buffer)  # as the strategy hands it to DCP; the writer reads it back safely
    node = _value_node("x", buffer)  # what the store's DCP writer keeps of it
    kept = [t.clone() for t in tensors]
    again = decode_state(node, lambda i, path: pytest.fail(f"a tensor in the value at {path}"))
    return objects.decode(again, lambda i: kept[i])


DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.bool, torch.complex64]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    raw = bytearray(draw(st.binary(min_size=math.prod(shape) * dtype.itemsize,
                                   max_size=math.prod(shape) * dtype.itemsize)))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)  # a bool's byte is 0 or 1
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if raw else \
        torch.empty(shape, dtype=dtype)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(["uint32", "int16", "float32", "bool", "uint64"])))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    size = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=size, max_size=size))
    if dtype == np.bool_:
        raw = bytes(b & 1 for b in raw)  # a bool's byte is 0 or 1
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


@st.composite
def buffers(draw: st.DrawFn) -> io.BytesIO:
    found = io.BytesIO(draw(st.binary(max_size=40)))
    found.seek(draw(st.integers(0, len(found.getvalue()))))
    return found


LEAVES = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True)
          | st.text(max_size=8) | st.binary(max_size=8) | tensors() | arrays() | buffers())
KEYS = st.text(min_size=1, max_size=6).filter(key_ok) | st.integers(-5, 5)
OBJECTS = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                       | st.lists(inner, max_size=4).map(tuple) | st.dictionaries(KEYS, inner, max_size=4),
                       max_leaves=20)


@given(st.lists(OBJECTS, min_size=1, max_size=2))
def test_any_object_of_megatron_kinds_round_trips_exactly(data: list[Any]) -> None:
    assert exact_differences(stored(data), data) == []


def test_an_object_of_plain_values_stays_the_value_it_is() -> None:
    data = [{"epoch": 3, "betas": (0.9, 0.95), "blob": b"\x00"}]
    assert objects.encode(data, "x") == (data, [])  # as versions before tensors in objects hold them


def test_the_rng_state_of_megatron_keeps_its_tensors_apart() -> None:
    import random

    tracker = {"model-parallel-rng": torch.ones(16, dtype=torch.uint8)}
    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": tracker}]
    value, found = objects.encode(state, "x")
    assert [t.dtype for t in found] == [torch.uint32, torch.uint8, torch.uint8]
    assert value["numpy"] == [0] and exact_differences(stored(state), state) == []


@pytest.mark.parametrize("data, error, words", [
    ([{"dtype": torch.float32}], UnsupportedStateError, "torch.dtype"),
    ([{(torch.float32, torch.float32): torch.ones(1)}], UnsupportedStateError, "keys must be str or int"),
    ([io.StringIO("x")], UnsupportedStateError, "_io.StringIO"),
    ([np.zeros(2, dtype=">u4")], UnsupportedStateError, "byte order"),
    ([{"a/b": torch.ones(1)}], InvalidNameError, "a/b"),
])
def test_what_cannot_be_kept_without_pickle_is_refused(data: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(")):
        objects.encode(data, "ShardedObject 'x'")


def test_a_forged_value_is_corrupt_not_executed() -> None:
    with pytest.raises(CorruptManifestError):
        objects.decode({objects.OBJECT: 2, "node": {}, "numpy": []}, lambda i: torch.ones(1))
    forged = {objects.OBJECT: 1, "node": {"t": "bytesio", "v": "!!", "p": 0}, "numpy": []}
    with pytest.raises(CorruptManifestError):
        objects.decode(forged, lambda i: torch.ones(1))
    with pytest.raises(CorruptManifestError):
        objects.decode({objects.OBJECT: 1, "node": {"t": "global", "v": "os.system"}, "numpy": []},
                       lambda i: torch.ones(1))


def _ok_node() -> dict[str, Any]:
    return {"t": "list", "v": [{"t": "tensor", "i": 0}]}


@pytest.mark.parametrize("forged", [
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [[0]]},  # was a TypeError
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": ["0"]},
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [True]},
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [0, 0]},
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [-1]},
    {objects.OBJECT: True, "node": _ok_node(), "numpy": []},
    {objects.OBJECT: 1.0, "node": _ok_node(), "numpy": []},
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [], "extra": 1},
    {objects.OBJECT: 1, "node": {"t": "bytesio", "v": "", "p": True}, "numpy": []},
    {objects.OBJECT: 1, "node": {"t": "bytesio", "v": "", "p": -1}, "numpy": []},
    {objects.OBJECT: 1, "node": {"t": "bytesio", "v": 7, "p": 0}, "numpy": []},
    {objects.OBJECT: 1, "node": {"t": "bytesio", "v": "", "p": 0, "x": 1}, "numpy": []},
    {objects.OBJECT: 1, "node": _ok_node(), "numpy": [0]},  # a bfloat16 tensor is no array
    {"node": _ok_node(), "numpy": []},
])
def test_every_forged_wrapper_is_corrupt_and_nothing_else(forged: dict[str, Any]) -> None:
    with pytest.raises(CorruptManifestError):
        objects.decode(forged, lambda i: torch.ones(1, dtype=torch.bfloat16))


def test_a_newer_format_says_to_upgrade() -> None:
    with pytest.raises(CorruptManifestError, match="newer casckpt; upgrade"):
        objects.decode({objects.OBJECT: 2, "node": _ok_node(), "numpy": [], "more": 1},
                       lambda i: torch.ones(1))


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize("leaf", [torch.ones(1), {"a": torch.ones(1)}, io.BytesIO(b"x")])
def test_the_deepest_object_encode_accepts_is_saved_and_read_back(leaf: Any, tmp_path: Path) -> None:
    """``encode`` runs before any rank writes; what it accepts must be a version that reads back
    (was: accepted up to 63 levels and refused at the write after a pack and common.pt were
    written; then, one level too deep, saved and unreadable)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    deepest = None
    for depth in range(24, 64):
        try:
            value, tensors = objects.encode(_nested(depth, leaf), "ShardedObject 'x'")
        except UnsupportedStateError as exc:
            assert "nests too deeply" in str(exc) and "ShardedObject 'x'" in str(exc)
            assert "node" not in str(exc).split("(at ")[1].split(")")[0]  # the object's own path
            break
        deepest = (depth, value, tensors)
    assert deepest is not None and deepest[0] > 26
    depth, value, tensors = deepest
    # DCP's planner torch.saves the value, as Megatron's planner gets it torch.saved
    state = {"o": value, **{objects.tensor_key("o", i): t for i, t in enumerate(tensors)}}
    with casckpt.open(tmp_path / "s") as store:
        dcp.save(state, storage_writer=store.dcp_writer(run="r", step=1),
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
        back = store.restore("r@1")
        got = objects.decode(back["o"], lambda i: back[objects.tensor_key("o", i)])
    assert exact_differences(got, _nested(depth, leaf)) == []


def test_tensor_keys_name_their_object_and_no_other_key() -> None:
    assert objects.object_of(objects.tensor_key("rng_state%2Fshard_0_2", 12)) == "rng_state%2Fshard_0_2"
    assert objects.object_of("rng_state%2Fshard_0_2") is None
    assert objects.object_of("decoder.w%25t1") is None  # a Megatron key "decoder.w%t1", escaped
