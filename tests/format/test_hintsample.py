"""Fingerprints of hinted tensors: which bytes are sampled (deterministic, in bounds, distinct
blocks), that a change inside the sample always changes the fingerprint, and the manifest's
optional ``"hinted"`` key (absent from other documents, ignored when of an unknown scheme,
refused when it names a tensor no hint could reuse)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import chunk_id, object_id
from casckpt.format.hintsample import BLOCK, BLOCKS, FINGERPRINT_BYTES, WHOLE, fingerprint, sample_spans
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, decode_manifest
from casckpt.format.merkle import NodeSource
from casckpt.format.state import encode_state
from casckpt.format.treemanifest import encode_tree_manifest


class _Dict(NodeSource):
    def __init__(self, nodes: Mapping[bytes, bytes]) -> None:
        self.nodes = nodes

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        return {i: self.nodes[i] for i in ids if i in self.nodes}


_sizes = st.one_of(st.integers(0, 3 * WHOLE), st.integers(WHOLE + 1, 1 << 34))


@settings(max_examples=300, deadline=None)
@given(run=st.text(min_size=1, max_size=8), step=st.integers(0, 2**40), path=st.text(max_size=20),
       nbytes=_sizes)
def test_spans_are_whole_or_distinct_blocks_in_bounds_and_reproducible(run: str, step: int, path: str,
                                                                       nbytes: int) -> None:
    spans = sample_spans(run, step, path, nbytes)
    assert spans == sample_spans(run, step, path, nbytes)
    if nbytes <= WHOLE:
        assert spans == ([(0, nbytes)] if nbytes else [])
        return
    assert len(spans) == BLOCKS
    starts = [s for s, _ in spans]
    assert starts == sorted(set(starts))
    for start, end in spans:
        assert start % BLOCK == 0 and 0 <= start < end <= nbytes and end - start <= BLOCK
        assert end - start == BLOCK or end == nbytes


def test_other_steps_and_paths_sample_other_blocks() -> None:
    nbytes = 1 << 30
    drawn = {tuple(sample_spans("r", step, path, nbytes)) for step in range(20) for path in ("a", "b")}
    assert len(drawn) == 40


@settings(max_examples=150, deadline=None)
@given(data=st.data(), nbytes=st.integers(1, 40 * BLOCK))
def test_a_change_inside_the_sample_changes_the_fingerprint(data: st.DataObject, nbytes: int) -> None:
    raw = bytearray(data.draw(st.binary(min_size=16, max_size=16)) * math.ceil(nbytes / 16))[:nbytes]
    spans = sample_spans("r", 7, "w", nbytes)
    start, end = data.draw(st.sampled_from(spans))
    at = data.draw(st.integers(start, end - 1))
    before = fingerprint(chunk_id, [bytes(raw[s:e]) for s, e in spans])
    raw[at] ^= data.draw(st.integers(1, 255))
    after = fingerprint(chunk_id, [bytes(raw[s:e]) for s, e in spans])
    assert len(before) == FINGERPRINT_BYTES and before != after


def test_the_miss_probability_of_k_changed_blocks_is_the_documented_one() -> None:
    """docs/ARCHITECTURE.md gives C(n-k, 16) / C(n, 16): counted over many draws here."""
    n, k, draws = 64, 4, 4000
    nbytes = n * BLOCK
    changed = set(range(k))  # any fixed k blocks: the sample is what is random
    missed = sum(not changed & {s // BLOCK for s, _ in sample_spans("r", step, "w", nbytes)}
                 for step in range(draws))
    expected = math.comb(n - k, BLOCKS) / math.comb(n, BLOCKS)  # 0.30
    assert abs(missed / draws - expected) < 0.04


def _manifest(hinted: dict[str, bytes] | None = None) -> Manifest:
    root, _ = encode_state({"w": None, "tiny": None})
    root["v"][0] = {"t": "tensor", "i": 0}
    root["v"][1] = {"t": "tensor", "i": 1}
    return Manifest(
        run="r", step=2, parent="ab" * 32, created_at=1.5, root=root,
        tensors=(TensorEntry("w", "torch", "float32", (1024,), 0),
                 TensorEntry("tiny", "torch", "float32", (4,), 1, digest=b"\x01" * 32)),
        extents=(ExtentEntry(4096, 4096, (b"\x02" * 32,)),
                 ExtentEntry(16, 16, (b"\x03" * 32,), packed=True)),
        hinted=hinted or {},
    )


def _document(data: bytes) -> dict[str, object]:
    return json.loads(zstandard.ZstdDecompressor().decompress(data))  # type: ignore[no-any-return]


def _encoded(doc: dict[str, object]) -> tuple[str, bytes]:
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return object_id(raw), zstandard.ZstdCompressor().compress(raw)


def test_hinted_fingerprints_round_trip_and_other_documents_do_not_hold_the_key() -> None:
    m = _manifest({"w": b"\x07" * FINGERPRINT_BYTES})
    version_id, data, tree = encode_tree_manifest(m)
    assert _document(data)["hinted"] == {"v": 1, "t": {"w": "07" * FINGERPRINT_BYTES}}
    assert decode_manifest(data, version_id, _Dict(tree.nodes)).hinted == {"w": b"\x07" * FINGERPRINT_BYTES}
    assert decode_manifest(data, version_id).hinted == m.hinted  # the head alone holds them
    plain_id, plain, _ = encode_tree_manifest(replace(m, hinted={}))
    assert "hinted" not in _document(plain)  # an unhinted commit's document is as it always was
    assert decode_manifest(plain, plain_id, _Dict(tree.nodes)).hinted == {}


def test_a_scheme_this_casckpt_does_not_know_is_ignored() -> None:
    _, data, tree = encode_tree_manifest(_manifest({"w": b"\x07" * FINGERPRINT_BYTES}))
    doc = _document(data)
    doc["hinted"] = {"v": 2, "t": {"w": "anything", "else": [1]}}
    version_id, newer = _encoded(doc)
    assert decode_manifest(newer, version_id, _Dict(tree.nodes)).hinted == {}


@pytest.mark.parametrize("hinted", [
    {"v": 1, "t": {"tiny": "07" * FINGERPRINT_BYTES}},  # a packed tensor: never reused on a hint
    {"v": 1, "t": {"gone": "07" * FINGERPRINT_BYTES}},  # no such tensor
    {"v": 1, "t": {"w": "07"}},
    {"v": 1, "t": {"w": 7}},
    {"v": 1, "t": ["w"]},
    {"v": 1},
    [1],
], ids=["packed", "unknown-path", "short", "not-a-string", "not-an-object", "no-tensors", "not-a-dict"])
def test_a_malformed_hinted_key_is_corrupt(hinted: object) -> None:
    _, data, tree = encode_tree_manifest(_manifest())
    doc = _document(data)
    doc["hinted"] = hinted
    version_id, bad = _encoded(doc)
    with pytest.raises(CorruptManifestError):
        decode_manifest(bad, version_id, _Dict(tree.nodes))


def test_a_document_key_a_reader_does_not_know_is_ignored() -> None:
    """Why ``"hinted"`` is a document key and not a tensor-entry field: readers ignore document
    keys they do not know (the casckpt before it read hinted documents so), while a tensor
    entry with an unknown field is refused. This pins both, so a stricter reader fails here."""
    m = _manifest()
    _, data, tree = encode_tree_manifest(m)
    doc = _document(data)
    doc["a later key"] = {"anything": [1, 2]}
    version_id, later = _encoded(doc)
    assert decode_manifest(later, version_id, _Dict(tree.nodes)).tensors == m.tensors
    from casckpt.format.treemanifest import tensor_entry

    entry = {"kind": "torch", "dtype": "float32", "shape": [4], "offset": 0, "stride": None,
             "blob": {"nbytes": 16, "chunk_size": 16, "chunks": ["02" * 32]}}
    tensor_entry("w", entry, [])
    with pytest.raises(ValueError, match="unexpected fields"):
        tensor_entry("w", {**entry, "fp": "07" * FINGERPRINT_BYTES}, [])
