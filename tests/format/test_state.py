"""States: exact round trips of plain values, and refusal of what cannot be stored.

Round trips go through JSON (``allow_nan=False``) exactly as manifests do, so
a node type that only survives in memory fails here.
"""

from __future__ import annotations

import enum
import json
import math
import os
import struct
import sys
import time
import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from doubles import ForkedPython
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.oldformats import encode_manifest
from casckpt.errors import CorruptManifestError, InvalidNameError, UnsupportedStateError
from casckpt.format.chunks import object_id
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.format.state import (
    MAX_DEPTH,
    MAX_MANIFEST_NESTING,
    _structure_nesting,
    decode_state,
    encode_state,
    iter_leaves,
    iter_values,
    json_nesting,
)

PROPERTY = settings(max_examples=100, deadline=None)


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Same structure, same types (tuple vs list, int vs bool keys), floats bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float):
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


def _through_json(root: dict[str, Any]) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(json.dumps(root, allow_nan=False))
    return decoded


def _no_tensors(i: int, path: str) -> object:
    raise AssertionError(f"no tensor expected, got {i} at {path}")


nan_payloads = st.integers(1, (1 << 52) - 1).flatmap(
    lambda m: st.sampled_from([0, 1]).map(
        lambda sign: struct.unpack(">d", struct.pack(">Q", (sign << 63) | (0x7FF << 52) | m))[0]
    )
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]),
    nan_payloads,
)
ints = st.one_of(st.integers(), st.integers(-(2**300), 2**300), st.sampled_from([2**63, -(2**63) - 1, 2**64]))
keys = st.one_of(
    st.text(min_size=1, max_size=8).filter(
        lambda k: k not in (".", "..") and not any(c in "/\\" or ord(c) < 32 or c == "\x7f" for c in k)
    ),
    ints,
)
plain = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=20), st.binary(max_size=20))
trees = st.recursive(
    plain,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=25,
)


@PROPERTY
@given(tree=trees)
def test_plain_state_roundtrip(tree: Any) -> None:
    root, leaves = encode_state(tree)
    assert leaves == []
    assert_identical(decode_state(_through_json(root), _no_tensors), tree)


@PROPERTY
@given(tree=trees)
def test_iter_values_lists_every_plain_leaf(tree: Any) -> None:
    root, _ = encode_state(tree)
    expected = [(p, v) for p, v in iter_leaves(tree)]
    # iter_leaves yields empty containers as leaves too; iter_values does not
    expected = [(p, v) for p, v in expected if not isinstance(v, (dict, list, tuple))]
    got = list(iter_values(_through_json(root)))
    assert [p for p, _ in got] == [p for p, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert_identical(a, b)


def test_exact_types_survive() -> None:
    tree = {
        1: (True, False, 0, 1, -0.0, [None]),
        "1": [(), [], {}, b"", ""],
        -7: {2**200: "big", "x": -(2**200)},
        "nan": struct.unpack(">d", bytes.fromhex("7ff8000000000bad"))[0],
    }
    out = decode_state(_through_json(encode_state(tree)[0]), _no_tensors)
    assert_identical(out, tree)
    assert isinstance(out, dict)
    assert type(next(iter(out))) is int
    assert out[1][0] is True and type(out[1][2]) is int
    assert math.copysign(1.0, out[1][4]) == -1.0


def test_tensors_become_indexed_leaves_with_dotted_paths() -> None:
    t, a = torch.zeros(2), np.zeros(3)
    tree = {"model": {"layers": [{"w": t}, {"w": t}]}, 5: (a, "x")}
    root, leaves = encode_state(tree)
    assert [(leaf.path, leaf.kind) for leaf in leaves] == [
        ("model.layers.0.w", "torch"), ("model.layers.1.w", "torch"), ("5.0", "numpy"),
    ]
    assert leaves[0].value is t and leaves[1].value is t and leaves[2].value is a
    seen: list[tuple[int, str]] = []

    def tensor(i: int, path: str) -> object:
        seen.append((i, path))
        return leaves[i].value

    out: Any = decode_state(_through_json(root), tensor)
    assert seen == [(0, "model.layers.0.w"), (1, "model.layers.1.w"), (2, "5.0")]
    assert out["model"]["layers"][0]["w"] is t
    assert isinstance(out[5], tuple) and out[5][0] is a


def test_shared_subtree_without_a_cycle_is_fine() -> None:
    shared = [1, 2]
    out = decode_state(_through_json(encode_state({"a": shared, "b": shared, "c": [shared]})[0]), _no_tensors)
    assert out == {"a": [1, 2], "b": [1, 2], "c": [[1, 2]]}


def _cyclic() -> list[Any]:
    inner: list[Any] = [1]
    inner.append({"again": inner})
    return inner


class _Opaque:
    pass


class _Color(enum.IntEnum):
    RED = 1


class _Point(NamedTuple):
    x: int
    y: int


class _Name(str):
    pass


def _unsupported() -> list[tuple[str, Any]]:
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, but still exist
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    return [
        ("set", {1, 2}),
        ("frozenset", frozenset()),
        ("object", object()),
        ("custom", _Opaque()),
        ("lambda", lambda x: x),
        ("device", torch.device("cpu")),
        ("dtype", torch.float32),
        ("sparse", sparse),
        ("meta", torch.empty(2, device="meta")),
        ("quantized", quantized),
        ("numpy_object", np.array([object()], dtype=object)),
        ("numpy_str", np.array(["a"])),
        ("numpy_structured", np.zeros(2, dtype=[("a", "i4")])),
        ("numpy_datetime", np.array(["2020-01-01"], dtype="datetime64[D]")),
        ("float_key", {1.5: 1}),
        ("bool_key", {True: 1}),
        ("tuple_key", {(1, 2): 1}),
        ("none_key", {None: 1}),
        ("bytes_key", {b"k": 1}),
        ("complex", 1j),
        ("cycle", _cyclic()),
        ("module", torch.nn.Linear(1, 1)),
        # subclasses of plain types would come back as their base type: refused, not degraded
        ("numpy_float", np.float64(1.5)),
        ("numpy_int", np.int64(3)),
        ("numpy_bool", np.bool_(True)),
        ("int_enum", _Color.RED),
        ("namedtuple", _Point(1, 2)),
        ("str_subclass", _Name("x")),
    ]


@pytest.mark.parametrize(("name", "value"), _unsupported(), ids=[n for n, _ in _unsupported()])
@pytest.mark.parametrize("where", ["root", "nested"])
def test_unsupported_objects_are_refused_naming_their_path(name: str, value: Any, where: str) -> None:
    tree = value if where == "root" else {"model": [0, {"deep": value}]}
    with pytest.raises(UnsupportedStateError) as info:
        encode_state(tree)
    message = str(info.value)
    if where == "nested":
        # the path of the offending object (or, for a bad key, of the dict holding it)
        assert "model.1.deep" in message, message
    if name not in ("cycle", "float_key", "bool_key", "tuple_key", "none_key", "bytes_key"):
        assert type(value).__name__ in message or "tensor" in message or "dtype" in message, message


@pytest.mark.parametrize(
    "tree",
    [
        {1: torch.zeros(1), "1": torch.zeros(1)},
        {"a.b": torch.zeros(1), "a": {"b": np.zeros(1)}},
        {"x": [torch.zeros(1)], "x.0": torch.zeros(1)},
    ],
    ids=["int-and-str", "dotted-and-nested", "list-index"],
)
def test_two_tensors_with_the_same_dotted_path_are_refused(tree: Any) -> None:
    with pytest.raises(InvalidNameError) as info:
        encode_state(tree)
    assert "'1'" in str(info.value) or "'a.b'" in str(info.value) or "'x.0'" in str(info.value)


def test_plain_values_with_the_same_dotted_path_are_fine() -> None:
    # only tensors are looked up by path (load_tensor, the catalog); values keep their keys
    tree = {1: "int key", "1": "str key"}
    assert_identical(decode_state(_through_json(encode_state(tree)[0]), _no_tensors), tree)


@pytest.mark.parametrize("key", ["", ".", "..", "a/b", "/", "a\\b", "x\x00", "tab\t", "nl\n", "del\x7f"])
@pytest.mark.parametrize("where", ["root", "nested"])
def test_bad_keys_are_refused(key: str, where: str) -> None:
    tree = {key: 1} if where == "root" else {"ok": [{"fine": {key: torch.zeros(1)}}]}
    with pytest.raises(InvalidNameError) as info:
        encode_state(tree)
    assert repr(key) in str(info.value)
    if where == "nested":
        assert "ok.0.fine" in str(info.value)


@pytest.mark.parametrize("key", ["a.b", "..a", "a..", " ", "ünï", "-", "0", "a b"])
def test_unusual_but_safe_keys_are_accepted(key: str) -> None:
    out = decode_state(_through_json(encode_state({key: 1})[0]), _no_tensors)
    assert out == {key: 1}


@pytest.mark.parametrize(
    "node",
    [
        [],
        "x",
        {},
        {"t": "what"},
        {"t": "int"},
        {"t": "int", "v": "5"},
        {"t": "int", "v": 1.5},
        {"t": "float", "v": "zz"},
        {"t": "float", "v": "00"},
        {"t": "float", "v": 1.0},
        {"t": "bytes", "v": "not base64!"},
        {"t": "bytes", "v": 5},
        {"t": "str"},
        {"t": "bool"},
        {"t": "dict", "k": ["a"], "v": []},
        {"t": "dict", "k": [{"j": 1}], "v": [{"t": "none"}]},
        {"t": "dict", "k": [{"i": "x"}], "v": [{"t": "none"}]},
        {"t": "dict", "k": ["a"], "v": [5]},
        {"t": "list", "v": [{"t": "none"}, "junk"]},
        {"t": "list"},
        {"t": "tuple", "v": 5},
        {"t": "tensor"},
        {"t": "tensor", "i": "x"},
        {"t": "tensor", "i": math.nan},
        {"t": "tensor", "i": math.inf},  # json.loads reads Infinity
        {"t": "dict", "k": [{"i": -math.inf}], "v": [{"t": "none"}]},
    ],
)
def test_malformed_nodes_are_corrupt_manifests(node: Any) -> None:
    with pytest.raises(CorruptManifestError):
        decode_state(node, lambda i, path: None)


NODE_TYPES = ["dict", "list", "tuple", "int", "float", "bytes", "str", "bool", "none", "tensor"]


@PROPERTY
@given(node=st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.dictionaries(st.sampled_from(["t", "v", "k", "i", "x"]), c, max_size=3),
        st.fixed_dictionaries(
            {"t": st.sampled_from(NODE_TYPES)}, optional={"v": c, "k": c, "i": c}
        ),
    ),
    max_leaves=12,
))
def test_decode_state_fuzz_raises_only_corrupt_manifest(node: Any) -> None:
    try:
        decode_state(node, lambda i, path: ("tensor", i))
    except CorruptManifestError:
        pass


# -- depth (issue 13) ----------------------------------------------------------------------


def _chain(depth: int, kind: str = "dict", leaf: Any = 1) -> Any:
    tree = leaf
    for _ in range(depth):
        tree = {"k": tree} if kind == "dict" else [tree] if kind == "list" else (tree,)
    return tree


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_encode_takes_max_depth_and_refuses_one_more_naming_the_path(kind: str) -> None:
    at_limit = _chain(MAX_DEPTH, kind, torch.ones(1))
    root, leaves = encode_state(at_limit)
    assert len(leaves) == 1 and json_nesting(json.dumps(root).encode()) <= MAX_MANIFEST_NESTING
    with pytest.raises(UnsupportedStateError) as info:
        encode_state(_chain(MAX_DEPTH + 1, kind, torch.ones(1)))
    key = "k" if kind == "dict" else "0"
    assert repr(".".join([key] * MAX_DEPTH)) in str(info.value)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)


def test_encode_refuses_a_state_deeper_than_the_recursion_limit() -> None:
    with pytest.raises(UnsupportedStateError):  # used to be a RecursionError
        encode_state(_chain(sys.getrecursionlimit() + 10))


@pytest.mark.parametrize(("text", "depth"), [
    (b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4), (b'["[[[[", "]]", {"x": "{\\"}"}]', 2),
    (b'["\\\"[[[["]', 1), (b'[[["]]]"]]]', 3),
])
def test_json_nesting_skips_brackets_in_strings(text: bytes, depth: int) -> None:
    assert json_nesting(text) == depth
    assert json_nesting(json.dumps(json.loads(text)).encode()) == depth


def _json_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_json_depth(v) for v in value), default=0)
    return 0


tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\ab\n'), max_size=12)
json_values = st.recursive(
    st.one_of(st.none(), st.integers(), tricky_text),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(tricky_text, c, max_size=3)),
    max_leaves=30,
)


@PROPERTY
@given(value=json_values, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_json_nesting_agrees_with_the_parsed_depth(value: Any, ascii_only: bool, indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert json_nesting(text) == _json_depth(value)


def _nesting_by_numpy(text: bytes) -> int:
    """The vectorised count json_nesting made before it dropped numpy: the reference."""
    codes = np.frombuffer(text, dtype=np.uint8)
    quotes = np.flatnonzero(codes == ord('"'))
    after_backslash = quotes[(quotes > 0) & (codes[quotes - 1] == ord("\\"))]
    if len(after_backslash):
        slashes = np.flatnonzero(codes == ord("\\"))
        run_starts = slashes[np.r_[True, np.diff(slashes) != 1]]
        starts = run_starts[np.searchsorted(run_starts, after_backslash, side="right") - 1]
        escaped = after_backslash[(after_backslash - starts) % 2 == 1]
        keep = np.ones(len(quotes), dtype=bool)
        keep[np.searchsorted(quotes, escaped)] = False
        quotes = quotes[keep]
    table = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
    steps = np.frombuffer(table, dtype=np.int8)[codes]
    brackets = np.flatnonzero(steps)
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    if not len(brackets):
        return 0
    return int(np.cumsum(steps[brackets], dtype=np.int64).max())


@PROPERTY
@given(text=st.binary(max_size=40) | st.text(alphabet=st.sampled_from('[]{}"\\a \n'), max_size=40)
       .map(str.encode))
def test_json_nesting_of_any_bytes_matches_the_vectorised_count(text: bytes) -> None:
    """Forged documents included (unterminated strings, stray backslashes, unbalanced brackets)."""
    assert json_nesting(text) == _nesting_by_numpy(text)


@PROPERTY
@given(text=st.text(alphabet=st.sampled_from('[]{}"'), max_size=60).map(str.encode),
       window=st.integers(1, 8))
def test_json_nesting_a_window_at_a_time_matches_the_vectorised_count(text: bytes, window: int) -> None:
    """Strings and bracket runs that cross the windows' edges (a document's quotes and brackets
    are split a window at a time, to bound memory on forged ones)."""
    assert _structure_nesting(text, window) == _nesting_by_numpy(text)


def test_json_nesting_is_linear_on_a_forged_run_of_escaped_quotes() -> None:
    text = b'"' + b'\\"' * 200_000 + b"[" * 10
    assert json_nesting(text) == _nesting_by_numpy(text) == 0
    assert json_nesting(b"[" * 100_000 + b'"\\') == 100_000


def _manifest_json(root: str, metadata: str = "{}") -> bytes:
    head = {"format": "casckpt.manifest", "version": 1, "run": "r", "step": 0, "parent": None,
            "created_at": 0.0, "metrics": {}, "message": None, "tags": [], "blobs": [], "tensors": []}
    text = json.dumps({**head, "root": "ROOT", "metadata": "META"})
    return text.replace('"ROOT"', root).replace('"META"', metadata).encode()


def _deep_list_node(depth: int) -> str:
    return '{"t":"list","v":[' * depth + '{"t":"none"}' + "]}" * depth


def _compressed(raw: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(raw)


def test_manifest_deeper_than_any_commit_is_corrupt() -> None:
    # deep enough for decode_state to recurse past the limit on restore, shallow enough that
    # json.loads itself does not fail: used to decode as a valid manifest
    raw = _manifest_json(_deep_list_node(400))
    with pytest.raises(CorruptManifestError) as info:
        decode_manifest(_compressed(raw), object_id(raw))
    assert "deeper" in str(info.value)


def test_manifest_at_the_limit_decodes() -> None:
    # the deepest tree a group commit can store (a ranks root over trees MAX_DEPTH deep, with a
    # sharded leaf) and the deepest metadata, in one manifest
    root, _ = encode_state(_chain(MAX_DEPTH - 1, "list", {"k": b"x"}))
    deepest = json.dumps({"t": "ranks", "v": [root]})
    deepest = deepest.replace('{"t": "bytes", "v": "eA=="}', '{"t": "sharded", "i": [0]}')
    assert '"sharded"' in deepest and json.loads(deepest)
    meta = json.dumps(_chain(MAX_DEPTH, "dict"))
    raw = _manifest_json(deepest, meta)
    assert json_nesting(raw) <= MAX_MANIFEST_NESTING
    m = Manifest("r", 0, None, 0.0, encode_state(_chain(MAX_DEPTH, "list"))[0], (), (),
                 metadata=_chain(MAX_DEPTH, "dict"))
    version, data = encode_manifest(m)
    assert decode_manifest(data, version).root == m.root


HOSTILE = """
import sys, time, json, zstandard
from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import object_id
from casckpt.format.manifest import decode_manifest
sys.setrecursionlimit(10**6)  # as some training scripts do; the stack cannot hold that much
depth = 100_000
root = '{"t":"list","v":[' * depth + '{"t":"none"}' + ']}' * depth
raw = sys.stdin.buffer.read().replace(b'"ROOT"', root.encode())
start = time.monotonic()
try:
    decode_manifest(zstandard.ZstdCompressor().compress(raw), object_id(raw))
except CorruptManifestError as exc:
    print("CorruptManifestError", round(time.monotonic() - start, 3), exc)
"""


def test_hostile_manifest_100000_deep_is_corrupt_quickly(forked_python: ForkedPython) -> None:
    # used to crash the interpreter (json.loads recursed until the C stack overflowed) in a
    # process that had raised the recursion limit; with the default limit it was caught late
    started = time.monotonic()
    result = forked_python.run(["-c", HOSTILE], input=_manifest_json('"ROOT"'), timeout=120, text=False,
                               env={**os.environ, "PYTHONFAULTHANDLER": "0"})
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    out = result.stdout.decode()
    assert out.startswith("CorruptManifestError"), out
    assert float(out.split()[1]) < 2.0, out  # the decode itself, not the interpreter's start
    assert time.monotonic() - started < 120
