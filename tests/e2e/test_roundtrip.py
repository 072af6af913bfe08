"""Commit then restore, through the real Store, is bit-exact for every storable thing.

Every torch dtype casckpt knows, numpy arrays (byte order kept), 0-d, empty and
non-contiguous tensors, plain values; views that share storage come back
sharing storage and are written once; ``load_tensor`` agrees with a full
restore; unchanged data is never written twice.

Tensor bytes are compared through a gather from the raw storage, so dtypes
without torch copy kernels (``int4``, ``uint3``...) are compared exactly too.
"""

from __future__ import annotations

import math
import struct
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.errors import InvalidNameError, UnsupportedStateError
from casckpt.format.dtypes import torch_dtypes

CHUNK = 64
PROPERTY = settings(
    max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _viewable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
            torch.empty(2, dtype=dtype).view(torch.uint8)
    except (RuntimeError, TypeError):
        return False
    return True


def _copyable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.empty(2, 2, dtype=dtype).t().contiguous()
    except (RuntimeError, NotImplementedError):
        return False
    return True


DTYPES = sorted((n for n, d in torch_dtypes().items() if _viewable(d)), key=str)
COPYABLE = [n for n in DTYPES if _copyable(torch_dtypes()[n])]
NUMPY_DTYPES = ["<f4", ">f4", "<f8", ">f8", "<f2", "|i1", "|u1", "<i2", ">i4", "<i8", ">u2",
                "<u8", "<c8", ">c16", "|b1"]


def test_the_dtype_lists_cover_what_the_brief_promises() -> None:
    for name in ("bfloat16", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                 "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16"):
        assert name in COPYABLE
    assert set(COPYABLE) <= set(DTYPES)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as s:
        yield s
        assert s.ops.check(read_data=True).ok


# --- exact comparison ----------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The row-major bytes of ``t``'s elements, gathered from its storage (no torch copies)."""
    t = t.detach()
    itemsize = t.element_size()
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).numpy()
    offsets = np.array(t.storage_offset(), dtype=np.int64)
    for n, s in zip(t.shape, t.stride(), strict=True):
        offsets = offsets[..., None] + np.arange(n, dtype=np.int64) * s
    index = offsets.reshape(-1, 1) * itemsize + np.arange(itemsize)
    return bytes(raw[index.reshape(-1)].tobytes())


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Same structure and types; tensors and arrays byte for byte; floats bit for bit."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor, f"{path}: {type(b)}"
        assert (b.dtype, tuple(b.shape), b.device.type) == (a.dtype, tuple(a.shape), "cpu"), path
        assert not b.is_conj() and not b.is_neg(), path
        assert tensor_bytes(b) == tensor_bytes(a), f"{path}: bytes differ"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert (b.dtype.str, b.shape) == (a.dtype.str, a.shape), path
        assert b.tobytes() == a.tobytes(), f"{path}: bytes differ"
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def tensor_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tensor_leaves(v, f"{prefix}.{i}" if prefix else str(i))


def storage_of(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def assert_restores(store: casckpt.Store, version: casckpt.Version, state: Any) -> Any:
    """Full restore, restore with map_location='cpu', and load_tensor of every tensor path."""
    out = store.restore(version)
    assert_identical(state, out)
    assert_identical(state, store.restore(version.id, map_location="cpu"))
    for path, leaf in tensor_leaves(out):
        single = store.load_tensor(version, path)
        assert_identical(leaf, single, path)
        if isinstance(leaf, torch.Tensor):
            assert_identical(leaf, store.load_tensor(version, path, map_location="cpu"), path)
    return out


def random_bytes(rng: np.random.Generator, n: int, dtype_name: str) -> torch.Tensor:
    data = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dtype_name == "bool":
        data %= 2  # other byte values are not valid bools: torch may normalise them
    out = torch.empty(n, dtype=torch.uint8)  # unit stride even when empty (from_numpy: not so)
    out.numpy()[:] = data
    return out


def make_tensor(dtype_name: str, shape: tuple[int, ...], layout: str, seed: int) -> torch.Tensor:
    """A tensor of random bytes, viewed through ``layout`` (contiguous, transposed, strided...)."""
    dtype = torch_dtypes()[dtype_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(seed)

    def filled(base_shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(base_shape)
        return random_bytes(rng, n * itemsize, dtype_name).view(dtype).reshape(base_shape)

    if layout == "contiguous" or not shape:
        return filled(shape)
    if layout == "transposed":
        return filled(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    if layout == "step":
        return filled((*shape[:-1], shape[-1] * 2 + 1))[..., 1::2]
    if layout == "offset":
        return filled((shape[0] + 2, *shape[1:]))[2:]
    if layout == "expand":
        return filled((1, *shape[1:])).expand(*shape)
    raise AssertionError(layout)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "step", "offset", "expand"]))
    names = DTYPES if layout == "contiguous" else COPYABLE
    dtype_name = draw(st.sampled_from(names))
    shape = tuple(draw(st.lists(st.integers(0, 40 if layout == "contiguous" else 6), max_size=3)))
    return make_tensor(dtype_name, shape, layout, draw(st.integers(0, 2**32 - 1)))


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = math.prod(shape)
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw %= 2
    array = raw.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["c", "fortran", "reversed", "transposed", "readonly"]))
    if layout == "fortran":
        array = np.asfortranarray(array)
    elif layout == "reversed":
        array = array[::-1]
    elif layout == "transposed":
        array = array.T
    elif layout == "readonly":
        array.setflags(write=False)
    return array


plain = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.binary(max_size=10)
)
# Letters-only str keys and int keys: no two leaves can print to the same dotted path
# (that case is a known bug, tested on its own below).
keys = st.one_of(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6), st.integers(0, 99))
trees = st.recursive(
    st.one_of(tensors(), tensors(), arrays(), plain),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=8,
)


@PROPERTY
@given(state=trees)
def test_any_state_tree_roundtrips_bit_exact(state: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp, casckpt.open(tmp, chunk_size=CHUNK) as store:
        version = store.commit(state, run="r", step=0)
        out = assert_restores(store, version, state)
        # separately stored tensors never come back aliased, even with equal bytes
        pointers = [storage_of(t) for _, t in tensor_leaves(out)
                    if isinstance(t, torch.Tensor) and t.numel() > 0]
        assert len(pointers) == len(set(pointers))
        assert store.ops.check(read_data=True).ok


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_dtype_roundtrips(store: casckpt.Store, dtype_name: str) -> None:
    layouts = ["contiguous"] + (["transposed", "step", "offset", "expand"] if dtype_name in COPYABLE else [])
    state: dict[str, Any] = {
        layout: make_tensor(dtype_name, (5, 37), layout, seed) for seed, layout in enumerate(layouts)
    }
    state["scalar"] = make_tensor(dtype_name, (), "contiguous", 99)
    state["empty"] = make_tensor(dtype_name, (3, 0, 2), "contiguous", 98)
    version = store.commit(state, run="dtypes", step=0)
    assert_restores(store, version, state)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_keep_dtype_and_byte_order(store: casckpt.Store, dtype: str) -> None:
    raw = np.random.default_rng(1).integers(0, 256, size=60 * np.dtype(dtype).itemsize, dtype=np.uint8)
    base = (raw % 2 if dtype == "|b1" else raw).view(dtype)
    state = {"c": base.reshape(6, 10), "f": np.asfortranarray(base.reshape(6, 10)),
             "rev": base[::-1], "empty": base[:0].reshape(0, 3)}
    out = assert_restores(store, store.commit(state, run="np", step=0), state)
    assert out["c"].dtype.str == dtype
    assert out["c"].flags.writeable


def test_plain_values_keep_their_exact_types(store: casckpt.Store) -> None:
    state = {
        "none": None, "t": True, "f": False, "zero": 0, "big": 2**200, "neg": -(2**70),
        "nan": struct.unpack(">d", bytes.fromhex("7ff80000deadbeef"))[0], "-0": -0.0,
        "inf": math.inf, "-inf": -math.inf, "s": "ünïcödé ✓", "b": b"\x00\xff", "empty": "",
        3: (1, [2, (3,)]), "tuple": (), "list": [], "dict": {},
    }
    assert_restores(store, store.commit(state, run="plain", step=0), state)


# --- views that share storage ----------------------------------------------------------------


def _views(draw: st.DrawFn, base: torch.Tensor) -> list[torch.Tensor]:
    n = base.numel()
    views = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from([
            "same", "narrow", "step", "int32", "uint8", "bfloat16", "float64", "complex64",
            "matrix_t", "expand",
        ]))
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        if kind == "same":
            views.append(base)
        elif kind == "narrow":
            views.append(base[a:b])
        elif kind == "step":
            views.append(base[a:b:draw(st.integers(2, 5))])
        elif kind == "int32":
            views.append(base.view(torch.int32)[a:b])
        elif kind == "uint8":
            views.append(base.view(torch.uint8)[draw(st.integers(0, 4 * n - 1)):])
        elif kind == "bfloat16":
            views.append(base.view(torch.bfloat16)[2 * a : 2 * b : 3])
        elif kind in ("float64", "complex64"):
            even = a - a % 2
            views.append(base[even : even + 2 * ((b - even) // 2)].view(getattr(torch, kind)))
        elif kind == "matrix_t":
            rows = draw(st.integers(1, max(1, (n - a) // 2)))
            cols = (n - a) // rows
            views.append(base[a : a + rows * cols].view(rows, cols).t())
        else:
            views.append(base[a : a + 1].expand(3, 4))
    return views


@st.composite
def shared_states(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n = draw(st.integers(2, 120))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = random_bytes(rng, 4 * n, "float32").view(torch.float32)
    members = [base, *_views(draw, base)]
    order = draw(st.permutations(range(len(members))))
    return {f"v{i}": members[i] for i in order}, base


def assert_shared_like(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], base_key: str) -> None:
    """Restored views share one storage, at the same byte offsets and strides as the originals.

    Views with no elements use no bytes, so they need not share anything.
    """
    origin = out[base_key].storage_offset() * out[base_key].element_size()
    assert len({storage_of(out[k]) for k, t in state.items() if t.numel()}) == 1
    for key, t in state.items():
        if not t.numel():
            continue
        r = out[key]
        assert r.stride() == t.stride(), key
        assert r.storage_offset() * r.element_size() - origin == t.storage_offset() * t.element_size(), key


@settings(PROPERTY, max_examples=20)
@given(sample=shared_states())
def test_views_of_one_storage_are_stored_once_and_restored_shared(
    sample: tuple[dict[str, torch.Tensor], torch.Tensor],
) -> None:
    state, base = sample
    with tempfile.TemporaryDirectory() as tmp, casckpt.open(tmp, chunk_size=CHUNK) as store:
        version = store.commit(state, run="views", step=0)
        assert version.new_bytes == base.untyped_storage().nbytes()
        assert version.logical_bytes == sum(t.numel() * t.element_size() for t in state.values())
        base_key = next(k for k, t in state.items() if t is base)
        out = assert_restores(store, version, state)
        assert_shared_like(state, out, base_key)
        assert_shared_like(state, store.restore(version, map_location="cpu"), base_key)
        # the restored storage is live, shared memory: a write through one view shows in the others
        out[base_key].view(torch.uint8).bitwise_not_()
        for key, t in state.items():
            assert tensor_bytes(out[key]) == bytes(255 - x for x in tensor_bytes(t)), key
        assert store.ops.check(read_data=True).ok


def test_tied_weights(store: casckpt.Store) -> None:
    w = torch.randn(50, 8)
    state = {"embed": {"weight": w}, "head": {"weight": w}, "other": w.clone()}
    version = store.commit(state, run="tied", step=0)
    assert version.new_bytes == w.numel() * 4  # "other" has the same bytes: deduplicated too
    assert version.logical_bytes == 3 * w.numel() * 4
    out = assert_restores(store, version, state)
    assert storage_of(out["embed"]["weight"]) == storage_of(out["head"]["weight"])
    assert storage_of(out["other"]) != storage_of(out["embed"]["weight"])


def test_overlapping_slices_without_their_base_store_the_union(store: casckpt.Store) -> None:
    base = torch.randn(100)
    state = {"a": base[4:60], "b": base[20:100], "c": base.view(torch.int32)[30:40]}
    version = store.commit(state, run="overlap", step=0)
    assert version.new_bytes == (100 - 4) * 4  # bytes 16..400 of the storage, once
    out = assert_restores(store, version, state)
    assert len({storage_of(t) for t in out.values()}) == 1
    assert out["a"][16:].data_ptr() == out["b"].data_ptr()


def test_numel_zero_views_of_a_shared_storage(store: casckpt.Store) -> None:
    base = torch.randn(10)
    state = {"base": base, "empty": base[5:5], "empty2d": base[:0].view(0, 3)}
    assert_restores(store, store.commit(state, run="empty-views", step=0), state)


# --- incremental: only new chunks are written ---------------------------------------------------


def test_unchanged_recommit_writes_nothing(store: casckpt.Store) -> None:
    state = {"w": torch.randn(40, 40), "a": np.arange(300, dtype=">i8"), "x": [1, "two"]}
    first = store.commit(state, run="inc", step=1)
    assert first.new_bytes == 40 * 40 * 4 + 300 * 8
    again = store.commit(state, run="inc", step=2)
    assert (again.new_bytes, again.stored_bytes) == (0, 0)
    assert again.logical_bytes == first.logical_bytes
    assert again.parent == first.id
    assert_restores(store, again, state)


@pytest.mark.parametrize("index", [0, 7, 15, 16, 399, 1599])
def test_changing_one_element_writes_one_chunk(store: casckpt.Store, index: int) -> None:
    w = torch.randn(40, 40)  # 6400 bytes = 100 chunks of 64
    store.commit({"w": w, "b": torch.ones(10)}, run="one", step=1)
    changed = w.clone()
    changed.view(-1)[index] += 1.0
    version = store.commit({"w": changed, "b": torch.ones(10)}, run="one", step=2)
    assert version.new_bytes == CHUNK
    assert 0 < version.stored_bytes <= CHUNK
    assert_restores(store, version, {"w": changed, "b": torch.ones(10)})
    assert_identical(w, store.restore("one@1")["w"])


def test_chunk_size_rounds_down_to_whole_elements(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s", chunk_size=100) as store:
        w = torch.randn(100, dtype=torch.float64)  # 800 bytes; chunks of 96 (12 elements)
        store.commit({"w": w}, run="r", step=1)
        changed = w.clone()
        changed[50] = 0.0
        version = store.commit({"w": changed}, run="r", step=2)
        assert version.new_bytes == 96
        assert_restores(store, version, {"w": changed})
        assert store.ops.check(read_data=True).ok


def test_tensor_seen_in_another_run_is_not_written_again(store: casckpt.Store) -> None:
    shared = torch.randn(33, 7, dtype=torch.float64)
    store.commit({"x": shared, "y": torch.zeros(3)}, run="first", step=0)
    version = store.commit({"copy": shared.clone(), "new": torch.full((5,), 2.0)}, run="second", step=0)
    assert version.new_bytes == 5 * 4
    assert_restores(store, version, {"copy": shared, "new": torch.full((5,), 2.0)})


def test_non_contiguous_view_dedups_against_its_contiguous_copy(store: casckpt.Store) -> None:
    m = torch.randn(20, 30)
    store.commit({"t": m.t().contiguous()}, run="r", step=0)
    version = store.commit({"t": m.t()}, run="r", step=1)
    assert version.new_bytes == 0


def test_parameters_restore_as_tensors(store: casckpt.Store) -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    out = store.restore(store.commit({"p": p}, run="param", step=0))
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert tensor_bytes(out["p"]) == tensor_bytes(p)


def test_restored_numpy_and_torch_leaves_are_independent_of_the_originals(store: casckpt.Store) -> None:
    state: dict[str, Any] = {"t": torch.arange(10.0), "a": np.arange(10.0)}
    out: Any = store.restore(store.commit(state, run="indep", step=0))
    out["t"] += 1
    out["a"] += 1
    assert torch.equal(state["t"], torch.arange(10.0))
    assert np.array_equal(state["a"], np.arange(10.0))


@pytest.mark.parametrize(
    "state",
    [{1: torch.ones(3), "1": torch.zeros(3)}, {"a.b": torch.ones(3), "a": {"b": np.zeros(3)}}],
    ids=["int-and-str", "dotted-and-nested"],
)
def test_tensors_whose_paths_print_alike_are_refused_before_writing(
    store: casckpt.Store, state: Any
) -> None:
    with pytest.raises(InvalidNameError):
        store.commit(state, run="collide", step=0)
    assert store.log() == []
    assert store.ops.stats().chunks == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(10)[::2],
        lambda: torch.randn(4, 10)[:, ::2],
        lambda: torch.randn(4, 4).diagonal(),
        lambda: torch.randn(6, dtype=torch.float64)[1::3],
        lambda: torch.randn(4)[4::2],
        lambda: torch.randn(1).expand(5),
        lambda: torch.randn(3, 1).expand(3, 4)[:, :1],
        lambda: torch.randn(3)[1::2],  # one element: torch deems it contiguous, stride 2
        lambda: torch.randn(3, 5)[1:2, 4::2],
    ],
    ids=["every-other", "every-other-column", "diagonal", "float64-step", "empty", "broadcast",
         "broadcast-column", "one-element", "one-element-2d"],
)
def test_strided_views_that_flatten_without_a_copy(store: casckpt.Store, make: Any) -> None:
    state = {"t": make(), "u8": torch.arange(20, dtype=torch.uint8)[::3]}
    assert_restores(store, store.commit(state, run="step", step=0), state)


# --- known bugs ---------------------------------------------------------------------------------
# These use ``bug_store``: the store fixture's closing check would turn some of them into errors.


@pytest.fixture
def bug_store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as s:
        yield s


def test_zero_dim_numpy_array_keeps_its_shape(bug_store: casckpt.Store) -> None:
    state = {"x": np.array(3.5), "y": np.array(7, dtype=">i4")}
    assert_restores(bug_store, bug_store.commit(state, run="np0d", step=0), state)
    assert bug_store.ops.check(read_data=True).ok


def test_conjugate_view_sharing_storage_restores_conjugated(bug_store: casckpt.Store) -> None:
    c = torch.randn(6, dtype=torch.complex64)
    state = {"c": c, "conj": c.conj()}
    try:
        version = bug_store.commit(state, run="conj", step=0)
    except UnsupportedStateError:
        assert bug_store.ops.check(read_data=True).ok
        return  # refusing is acceptable (a lone conj view is refused the same way)
    out = bug_store.restore(version)
    assert torch.equal(out["conj"].resolve_conj(), c.conj().resolve_conj())
    assert bug_store.ops.check(read_data=True).ok


def test_tensors_from_overlapping_numpy_memory(bug_store: casckpt.Store) -> None:
    backing = np.arange(10, dtype=np.float64)
    state = {"head": torch.from_numpy(backing[:4]), "all": torch.from_numpy(backing)}
    version = bug_store.commit(state, run="from-numpy", step=0)
    assert_restores(bug_store, version, state)
    assert bug_store.ops.check(read_data=True).ok


def test_huge_int_roundtrips_or_is_refused_up_front(bug_store: casckpt.Store) -> None:
    state = {"w": torch.ones(3), "x": 10**5000}
    try:
        version = bug_store.commit(state, run="huge", step=0)
    except UnsupportedStateError as exc:
        assert "'x'" in str(exc)
        assert bug_store.ops.check(read_data=True).ok
        return
    assert_identical(state, bug_store.restore(version))
    assert bug_store.ops.check(read_data=True).ok


def test_surrogate_key_roundtrips_or_is_refused(bug_store: casckpt.Store) -> None:
    state = {"\ud800": torch.ones(2)}
    try:
        version = bug_store.commit(state, run="surrogate", step=0)
    except InvalidNameError:
        assert bug_store.ops.check(read_data=True).ok
        return
    assert_identical(state, bug_store.restore(version))
    assert bug_store.ops.check(read_data=True).ok


def test_non_contiguous_sub_byte_dtype(bug_store: casckpt.Store) -> None:
    t = make_tensor("int4", (3, 4), "transposed", 0)
    try:
        version = bug_store.commit({"t": t}, run="int4", step=0)
    except UnsupportedStateError as exc:
        assert "'t'" in str(exc)
        assert bug_store.ops.check(read_data=True).ok
        return
    assert_identical({"t": t}, bug_store.restore(version))
    assert bug_store.ops.check(read_data=True).ok
