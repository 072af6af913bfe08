"""Manifests: exact round trips, stable ids, and refusal of anything damaged or impossible."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import zstandard
from blake3 import blake3
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from benchmarks.oldformats import encode_manifest
from casckpt.errors import CorruptManifestError
from casckpt.format.dtypes import element_size, torch_dtypes
from casckpt.format.manifest import (
    ExtentEntry,
    Manifest,
    TensorEntry,
    decode_manifest,
    tensor_span,
)
from casckpt.format.state import encode_state

OBJECT_CONTEXT = "casckpt 2026-11-29 object id v1"
PROPERTY = settings(max_examples=60, deadline=None)
NUMPY_DTYPES = ["<f4", ">f4", "<f8", ">i8", "|i1", "|u1", "<u2", "<c8", ">c16", "|b1", "<f2"]


def _cid(i: int) -> bytes:
    return bytes([i]) * 32


def _manifest() -> Manifest:
    root, _ = encode_state({"model": {"w": None, "b": None}, "opt": [None], "view": None, "step": 3})
    # point the placeholders at tensors 0..3, as encode_state does for real tensors
    root["v"][0]["v"] = [{"t": "tensor", "i": 0}, {"t": "tensor", "i": 1}]
    root["v"][1]["v"] = [{"t": "tensor", "i": 2}]
    root["v"][2] = {"t": "tensor", "i": 3}
    return Manifest(
        run="run-1", step=3, parent="ab" * 32, created_at=1_700_000_000.25, root=root,
        tensors=(
            TensorEntry("model.w", "torch", "float32", (5, 5), 0),
            TensorEntry("model.b", "torch", "bfloat16", (0,), 1),
            TensorEntry("opt.0", "numpy", ">f8", (2, 3), 2),
            TensorEntry("view", "torch", "int8", (4, 2), 0, offset=4, stride=(1, 4)),
        ),
        extents=(
            ExtentEntry(100, 64, (_cid(1), _cid(2))),
            ExtentEntry(0, 64, ()),
            ExtentEntry(56, 16, (_cid(3), _cid(4), _cid(5), _cid(6))),  # 8 spare bytes
        ),
        metadata={"lr": 0.001, "nested": {"a": [1, 2]}}, metrics={"loss": 1.5},
        message="hello", tags=("best",),
    )


def _json(data: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(zstandard.ZstdDecompressor().decompress(data))
    return doc


def _pack_json(doc: Any) -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(doc).encode())


def test_roundtrip_and_id() -> None:
    m = _manifest()
    version_id, data = encode_manifest(m)
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert version_id == blake3(raw, derive_key_context=OBJECT_CONTEXT).hexdigest()
    doc = json.loads(raw)
    assert (doc["format"], doc["version"]) == ("casckpt.manifest", 1)
    assert decode_manifest(data, version_id) == m
    assert decode_manifest(data) == m
    assert m.logical_bytes == 100 + 0 + 48 + 8


def test_id_is_deterministic_and_covers_every_field() -> None:
    m = _manifest()
    version_id, _ = encode_manifest(m)
    reordered = Manifest(**{**_fields(m), "metadata": dict(reversed(list(m.metadata.items())))})
    assert encode_manifest(reordered)[0] == version_id
    changes: dict[str, Any] = {
        "step": 4, "run": "run-2", "parent": None, "created_at": 1.0, "message": None,
        "tags": (), "metrics": {"loss": 1.25}, "metadata": {},
        "tensors": m.tensors[:1] + m.tensors[2:],
        "extents": (ExtentEntry(100, 64, (_cid(1), _cid(9))), *m.extents[1:]),
        "root": {"t": "none"},
    }
    ids = {version_id}
    for name, value in changes.items():
        ids.add(encode_manifest(Manifest(**{**_fields(m), name: value}))[0])
    assert len(ids) == len(changes) + 1


def _fields(m: Manifest) -> dict[str, Any]:
    return {name: getattr(m, name) for name in Manifest.__slots__}


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    tensors: list[TensorEntry] = []
    extents: list[ExtentEntry] = []
    for i in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["torch", "numpy"]))
        dtype = draw(st.sampled_from(sorted(torch_dtypes()) if kind == "torch" else NUMPY_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        nbytes = math.prod(shape) * element_size(kind, dtype)
        chunk_size = draw(st.integers(1, 64))
        chunks = tuple(draw(st.binary(min_size=32, max_size=32)) for _ in range(-(-nbytes // chunk_size)))
        tensors.append(TensorEntry(f"t.{i}", kind, dtype, shape, len(extents)))
        extents.append(ExtentEntry(nbytes, chunk_size, chunks))
    plain = draw(st.lists(st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5)), max_size=4))
    root, _ = encode_state(plain)
    root["v"].extend({"t": "tensor", "i": i} for i in range(len(tensors)))
    json_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**60), 2**60),
                            st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
    return Manifest(
        run=draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,10}", fullmatch=True)),
        step=draw(st.integers(0, 2**62)),
        parent=draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex))),
        created_at=draw(st.floats(0, 2e9)),
        root=root, tensors=tuple(tensors), extents=tuple(extents),
        metadata=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
        metrics=draw(st.dictionaries(st.text(min_size=1, max_size=5),
                                     st.floats(allow_nan=False, allow_infinity=False), max_size=3)),
        message=draw(st.one_of(st.none(), st.text(max_size=20))),
        tags=tuple(draw(st.lists(st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True), max_size=3))),
    )


@PROPERTY
@given(m=manifests())
def test_manifest_roundtrip_property(m: Manifest) -> None:
    version_id, data = encode_manifest(m)
    assert decode_manifest(data, version_id) == m
    assert encode_manifest(decode_manifest(data))[0] == version_id


def test_tensor_span() -> None:
    assert tensor_span(TensorEntry("a", "torch", "float32", (3, 4), 0), 4) == 48
    assert tensor_span(TensorEntry("a", "torch", "float32", (3, 0), 0), 4) == 0
    assert tensor_span(TensorEntry("a", "torch", "float32", (), 0), 4) == 4
    # transposed 4x3 view of a 3x4 tensor: last element at 3*1 + 2*4 = 11
    assert tensor_span(TensorEntry("a", "torch", "float32", (4, 3), 0, stride=(1, 4)), 4) == 48
    # a broadcast (stride 0) view touches one element
    assert tensor_span(TensorEntry("a", "torch", "float64", (5, 7), 0, stride=(0, 0)), 8) == 8
    # every second element of 10
    assert tensor_span(TensorEntry("a", "torch", "int16", (5,), 0, stride=(2,)), 2) == 18


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def _append_chunk(doc: dict[str, Any]) -> None:
    doc["blobs"][0]["chunks"].append("cd" * 32)


def _drop_chunk(doc: dict[str, Any]) -> None:
    doc["blobs"][0]["chunks"].pop()


TAMPERING: dict[str, Callable[[dict[str, Any]], None]] = {
    "offset_outside_extent": _set(("tensors", 0, "offset"), 4),
    "offset_far_outside_extent": _set(("tensors", 0, "offset"), 2**40),
    "offset_negative": _set(("tensors", 0, "offset"), -4),
    "offset_misaligned": _set(("tensors", 2, "offset"), 4),  # inside the extent, but >f8 needs 8
    "shape_larger_than_extent": _set(("tensors", 0, "shape"), [5, 6]),
    "shape_negative": _set(("tensors", 0, "shape"), [-5, -5]),
    "shape_not_int": _set(("tensors", 0, "shape"), ["x"]),
    "shape_not_list": _set(("tensors", 0, "shape"), 7),
    "stride_outside_extent": _set(("tensors", 3, "stride"), [1, 400]),
    "stride_wrong_length": _set(("tensors", 3, "stride"), [1]),
    "stride_negative": _set(("tensors", 3, "stride"), [-1, 4]),
    "chunks_too_few": _drop_chunk,
    "chunks_too_many": _append_chunk,
    "chunk_id_short": _set(("blobs", 0, "chunks", 0), "ab" * 31),
    "chunk_id_long": _set(("blobs", 0, "chunks", 0), "ab" * 33),
    "chunk_id_not_hex": _set(("blobs", 0, "chunks", 0), "zz" * 32),
    "chunk_id_not_str": _set(("blobs", 0, "chunks", 0), 5),
    "nbytes_negative": _set(("blobs", 1, "nbytes"), -1),
    "nbytes_larger_than_chunks": _set(("blobs", 0, "nbytes"), 129),
    "chunk_size_zero": _set(("blobs", 1, "chunk_size"), 0),
    "chunk_size_negative": _set(("blobs", 0, "chunk_size"), -64),
    "extent_index_out_of_range": _set(("tensors", 0, "blob"), 3),
    "extent_index_negative": _set(("tensors", 0, "blob"), -1),
    "kind_unknown": _set(("tensors", 0, "kind"), "pickle"),
    "torch_dtype_os_system": _set(("tensors", 0, "dtype"), "os.system"),
    "torch_dtype_prefixed": _set(("tensors", 0, "dtype"), "torch.float32"),
    "torch_dtype_empty": _set(("tensors", 0, "dtype"), ""),
    "torch_dtype_quantized": _set(("tensors", 0, "dtype"), "qint8"),
    "torch_dtype_dunder": _set(("tensors", 0, "dtype"), "__class__"),
    "numpy_dtype_os_system": _set(("tensors", 2, "dtype"), "os.system"),
    "numpy_dtype_object": _set(("tensors", 2, "dtype"), "|O"),
    "numpy_dtype_object_short": _set(("tensors", 2, "dtype"), "O"),
    "numpy_dtype_unicode": _set(("tensors", 2, "dtype"), "<U4"),
    "numpy_dtype_void": _set(("tensors", 2, "dtype"), "|V8"),
    "numpy_dtype_datetime": _set(("tensors", 2, "dtype"), "<M8[D]"),
    "numpy_dtype_structured": _set(("tensors", 2, "dtype"), "[('a', '<i4')]"),
    "numpy_dtype_not_canonical": _set(("tensors", 2, "dtype"), "float64"),
    "numpy_dtype_torch_name": _set(("tensors", 2, "dtype"), "bfloat16"),
    "wrong_format": _set(("format",), "something.else"),
    "newer_version": _set(("version",), 3),
    "version_missing": _delete(("version",)),
    "tensors_missing": _delete(("tensors",)),
    "blobs_missing": _delete(("blobs",)),
    "tensors_not_a_list": _set(("tensors",), 5),
    "extent_not_an_object": _set(("blobs", 0), "blob"),
    "tensor_not_an_object": _set(("tensors", 0), ["model.w"]),
    "tags_not_a_list": _set(("tags",), 5),
    "step_not_int": _set(("step",), "three"),
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_tampered_manifest_is_refused(name: str) -> None:
    version_id, data = encode_manifest(_manifest())
    doc = _json(data)
    TAMPERING[name](doc)
    forged = _pack_json(doc)
    with pytest.raises(CorruptManifestError):
        decode_manifest(forged)
    with pytest.raises(CorruptManifestError):
        decode_manifest(forged, version_id)


def test_untampered_json_reencoded_is_accepted() -> None:
    # guards the tampering tests: re-encoding alone is not what they detect
    m = _manifest()
    _, data = encode_manifest(m)
    assert decode_manifest(_pack_json(_json(data))) == m


def _root_tensor(index: Any) -> Callable[[dict[str, Any]], None]:
    return _set(("root", "v", 2), {"t": "tensor", "i": index})


@pytest.mark.parametrize("raw", [b"[]", b"null", b"5", b'"manifest"'])
def test_non_object_json_is_refused(raw: bytes) -> None:
    with pytest.raises(CorruptManifestError):
        decode_manifest(zstandard.ZstdCompressor().compress(raw))


def test_deeply_nested_json_is_refused() -> None:
    raw = b'{"format": "casckpt.manifest", "version": 1, "metadata": ' + b"[" * 100_000
    raw += b"]" * 100_000 + b"}"
    data = zstandard.ZstdCompressor().compress(raw)
    assert len(data) < 1000
    with pytest.raises(CorruptManifestError):
        decode_manifest(data)


@pytest.mark.parametrize("field", ["nbytes", "chunk_size"])
def test_infinite_number_is_refused(field: str) -> None:
    _, data = encode_manifest(_manifest())
    doc = _json(data)
    doc["blobs"][0][field] = math.inf  # json.dumps writes Infinity
    with pytest.raises(CorruptManifestError):
        decode_manifest(_pack_json(doc))


@pytest.mark.parametrize("index", [4, 99, -1])
def test_root_naming_a_missing_tensor_is_refused(index: int) -> None:
    _, data = encode_manifest(_manifest())
    doc = _json(data)
    _root_tensor(index)(doc)
    with pytest.raises(CorruptManifestError):
        decode_manifest(_pack_json(doc))


@pytest.mark.parametrize("name", [",", "[']', None]", "i4,)"])
def test_numpy_dtype_names_the_parser_chokes_on_are_refused(name: str) -> None:
    _, data = encode_manifest(_manifest())
    doc = _json(data)
    doc["tensors"][2]["dtype"] = name
    with pytest.raises(CorruptManifestError):
        decode_manifest(_pack_json(doc))


@PROPERTY
@given(garbage=st.binary(max_size=300))
def test_garbage_is_refused(garbage: bytes) -> None:
    with pytest.raises(CorruptManifestError):
        decode_manifest(garbage)


@PROPERTY
@given(garbage=st.binary(max_size=300))
def test_compressed_garbage_is_refused(garbage: bytes) -> None:
    try:
        parsed = json.loads(garbage)
    except ValueError:
        pass
    else:
        assume(isinstance(parsed, dict))  # other JSON documents: test_non_object_json_is_refused
    with pytest.raises(CorruptManifestError):
        decode_manifest(zstandard.ZstdCompressor().compress(garbage))


def test_truncated_manifest_is_refused() -> None:
    version_id, data = encode_manifest(_manifest())
    for size in range(len(data)):
        with pytest.raises(CorruptManifestError):
            decode_manifest(data[:size], version_id)


def test_every_flipped_byte_is_refused_against_the_id() -> None:
    version_id, data = encode_manifest(_manifest())
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        try:
            decode_manifest(bytes(damaged), version_id)
        except CorruptManifestError:
            continue
        # zstd ignores a few bits of its frames; then the JSON is intact and must equal
        assert decode_manifest(bytes(damaged), version_id) == _manifest()


def test_wrong_id_is_refused() -> None:
    version_id, data = encode_manifest(_manifest())
    other_id, _ = encode_manifest(Manifest(**{**_fields(_manifest()), "step": 99}))
    with pytest.raises(CorruptManifestError, match="does not match"):
        decode_manifest(data, other_id)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


# finite JSON values only: non-finite numbers and non-object documents are known bugs above
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=8)),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
    max_leaves=6,
)


@PROPERTY
@given(data=st.data())
def test_fuzzed_field_is_refused_or_accepted_never_crashes(data: st.DataObject) -> None:
    _, encoded = encode_manifest(_manifest())
    doc = _json(encoded)
    # the root tree: see test_tree; a numpy dtype name: see test_numpy_dtype_names_the_parser...
    paths = [p for p in _paths(doc) if p[0] != "root" and p[:3] != ("tensors", 2, "dtype")]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    assume(value != _get(doc, path))
    forged = copy.deepcopy(doc)
    _set(path, value)(forged)
    try:
        m = decode_manifest(_pack_json(forged))
    except CorruptManifestError:
        return
    assert isinstance(m, Manifest)


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


# Found by the fuzz campaign (benchmarks/fuzz.py, target "manifest"): a field of another JSON type
# was coerced into what the decoder wanted -- str(["a"]) as a run name, int(1.5) as a step,
# tuple("best") as four tags, bool("false") as True -- and a manifest no encoder writes was accepted
# with values its bytes do not say. Every field must have the type encode_manifest gives it.
COERCED: dict[str, Callable[[dict[str, Any]], None]] = {
    "step_float": _set(("step",), 1.5),
    "step_bool": _set(("step",), True),
    "step_numeric_text": _set(("step",), "3"),
    "version_bool": _set(("version",), True),
    "run_list": _set(("run",), ["run-1"]),
    "parent_list": _set(("parent",), ["ab" * 32]),
    "created_at_text": _set(("created_at",), "1"),
    "tags_text": _set(("tags",), "best"),
    "tag_number": _set(("tags",), [-1]),
    "metadata_list": _set(("metadata",), [0, 0]),
    "metrics_list": _set(("metrics",), []),
    "metric_text": _set(("metrics", "loss"), "1.5"),
    "metric_bool": _set(("metrics", "loss"), True),
    "message_number": _set(("message",), 5),
    "nbytes_text": _set(("blobs", 0, "nbytes"), "100"),
    "chunk_size_float": _set(("blobs", 0, "chunk_size"), 64.0),
    "chunk_id_upper_case": _set(("blobs", 0, "chunks", 0), "AB" * 32),
    "chunk_id_with_spaces": _set(("blobs", 0, "chunks", 0), " ".join(["ab"] * 32)),
    "path_list": _set(("tensors", 0, "path"), ["model.w"]),
    "path_bool": _set(("tensors", 0, "path"), True),
    "offset_text": _set(("tensors", 3, "offset"), "4"),
    "offset_float": _set(("tensors", 3, "offset"), 4.0),
    "stride_item_text": _set(("tensors", 3, "stride"), [1, "4"]),
    "shape_item_float": _set(("tensors", 0, "shape"), [5.0, 5]),
    "extent_index_bool": _set(("tensors", 1, "blob"), True),
    "global_offset_alone": _set(("tensors", 0, "global_offset"), [0, 0]),
    "numpy_stride": _set(("tensors", 2, "stride"), [1, 2]),  # restore ignored it: another array
    "world_size_text": _set(("world",), {"size": "1", "api": "dcp"}),
    "bool_node_text": _set(("root", "v", 3), {"t": "bool", "v": "false"}),
    "int_node_bool": _set(("root", "v", 3), {"t": "int", "v": False}),
    "int_node_hex_not_text": _set(("root", "v", 3), {"t": "int", "h": 255}),
    "str_node_list": _set(("root", "v", 3), {"t": "str", "v": ["a"]}),
    "float_node_short": _set(("root", "v", 3), {"t": "float", "v": "3ff0"}),
    "bytes_node_list": _set(("root", "v", 3), {"t": "bytes", "v": ["AAE="]}),
    "unknown_node": _set(("root", "v", 3), {"t": "pickle", "v": "x"}),
    "dict_key_list": _set(("root", "k", 3), ["step"]),
    "dict_key_float": _set(("root", "k", 3), 1.5),
    "dict_key_int_text": _set(("root", "k", 3), {"i": "3"}),
}


@pytest.mark.parametrize("name", sorted(COERCED))
def test_field_of_another_type_is_refused_not_coerced(name: str) -> None:
    _, data = encode_manifest(_manifest())
    doc = _json(data)
    COERCED[name](doc)
    with pytest.raises(CorruptManifestError):
        decode_manifest(_pack_json(doc))


def test_frame_declaring_a_huge_size_is_refused_without_allocating_it() -> None:
    # found by the fuzz campaign: a damaged frame header declaring ~2 GiB made decode_manifest
    # allocate what it declared before finding out (a MemoryError in a small worker)
    import tracemalloc

    writer = zstandard.ZstdCompressor().compressobj(size=1 << 30)
    frame = writer.compress(b"{}" * 100) + writer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptManifestError):
            decode_manifest(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_manifest_decompressing_past_the_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.format import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_JSON", 1 << 20)
    bomb = zstandard.ZstdCompressor().compress(b" " * (3 << 20))
    with pytest.raises(CorruptManifestError, match="more than"):
        decode_manifest(bomb)
