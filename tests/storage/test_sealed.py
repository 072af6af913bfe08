"""SealedBlobStore (an encrypted store's locations): passes the BlobStore conformance suite,
returns exactly the plaintext of any range, and refuses every altered byte."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from casckpt.errors import SealedObjectError
from casckpt.format import objectnames
from casckpt.format.crypto import HEADER_SIZE, SEGMENT, TAG_SIZE, StoreCrypto, plain_size, sealed_size
from casckpt.storage import BlobStore, LocalBlobStore
from casckpt.storage.sealed import SealedBlobStore
from casckpt.testing import BlobStoreConformance

CRYPTO = StoreCrypto(bytes(range(32)))


class TestSealedLocalBlobStore(BlobStoreConformance):
    def make_store(self, tmp_path: Path) -> BlobStore:
        return SealedBlobStore(LocalBlobStore(tmp_path / "blobs"), CRYPTO)


# lengths around segment boundaries, where off-by-ones live
LENGTHS = st.one_of(st.integers(0, 3 * SEGMENT + 7),
                    st.sampled_from([0, 1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 2 * SEGMENT]))


@settings(max_examples=40, deadline=None)
@given(length=LENGTHS, data=st.data())
def test_seal_open_and_any_range_round_trip(length: int, data: st.DataObject) -> None:
    plain = os.urandom(length)
    sealed = CRYPTO.seal("packs/ab/x", plain)
    assert len(sealed) == sealed_size(length) and plain_size(len(sealed)) == length
    assert CRYPTO.open("packs/ab/x", sealed) == plain
    offset = data.draw(st.integers(0, length + 2))
    count = data.draw(st.integers(0, length + 2))
    head = CRYPTO.head("packs/ab/x", sealed)
    if count and offset < length:
        first, start, stop = CRYPTO.segment_span(offset, count, length)
        want = min(count, length - offset)
        cuts = sorted(data.draw(st.lists(st.integers(0, want), max_size=4)))
        edges = [0, *cuts, want]
        out = bytearray(want)
        buffers = [memoryview(out)[a:b] for a, b in zip(edges, edges[1:], strict=False)]  # some empty
        skip = offset - first * SEGMENT
        got = CRYPTO.open_segments_into("packs/ab/x", head, first, memoryview(sealed)[start:stop],
                                        buffers, skip)
        assert got == want and bytes(out) == plain[offset : offset + want]


@settings(max_examples=40, deadline=None)
@given(length=st.integers(0, 2 * SEGMENT + 5), data=st.data())
def test_any_flipped_byte_or_cut_is_refused(length: int, data: st.DataObject) -> None:
    sealed = bytearray(CRYPTO.seal("manifests/m", os.urandom(length)))
    at = data.draw(st.integers(0, len(sealed) - 1))
    flipped = bytearray(sealed)
    flipped[at] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(SealedObjectError):
        CRYPTO.open("manifests/m", flipped)
    cut = data.draw(st.integers(0, len(sealed) - 1))
    with pytest.raises(SealedObjectError):
        CRYPTO.open("manifests/m", sealed[:cut])


def test_an_object_opens_only_under_its_own_name_and_key() -> None:
    sealed = CRYPTO.seal("refs/tags/ka", b"record")
    with pytest.raises(SealedObjectError, match="fails authentication"):
        CRYPTO.open("refs/tags/kb", sealed)
    with pytest.raises(SealedObjectError):
        StoreCrypto(bytes(32)).open("refs/tags/ka", sealed)
    assert CRYPTO.seal("refs/tags/ka", b"record") != sealed  # a fresh salt every time


def test_ranges_through_the_store_and_a_rewritten_object(tmp_path: Path) -> None:
    inner = LocalBlobStore(tmp_path / "blobs")
    store = SealedBlobStore(inner, CRYPTO)
    first, second = os.urandom(3 * SEGMENT + 11), os.urandom(3 * SEGMENT + 11)
    store.put("packs/aa/p.s0", first)
    assert store.get_range("packs/aa/p.s0", SEGMENT - 3, 10) == first[SEGMENT - 3 : SEGMENT + 7]
    assert store.size("packs/aa/p.s0") == len(first)
    assert [i.size for i in store.list("packs/")] == [len(first)]
    other = SealedBlobStore(inner, CRYPTO)  # another process heals the shard: same key, new salt
    other.put("packs/aa/p.s0", second)
    assert store.get_range("packs/aa/p.s0", 5, SEGMENT) == second[5 : SEGMENT + 5]  # header re-read
    assert store.get_range("packs/aa/p.s0", len(second) - 4, 100) == second[-4:]
    assert store.get_range("packs/aa/p.s0", len(second) + 1, 5) == b""
    raw = (tmp_path / "blobs" / "packs" / "aa" / "p.s0").read_bytes()
    assert second[:64] not in raw and len(raw) == HEADER_SIZE + len(second) + 4 * TAG_SIZE


def test_the_identity_and_key_records_stay_readable_without_the_key(tmp_path: Path) -> None:
    inner = LocalBlobStore(tmp_path / "blobs")
    store = SealedBlobStore(inner, CRYPTO)
    for key in (objectnames.IDENTITY, objectnames.KEYS_RECORD):
        store.put(key, b'{"clear": true}')
        assert inner.get(key) == b'{"clear": true}' == store.get(key)


@pytest.mark.parametrize("length", [0, 1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT + 7])
def test_a_file_sealed_segment_by_segment_is_a_sealed_object(tmp_path: Path, length: int) -> None:
    """put_file seals a pack file in reused segment buffers (no whole pack in memory): what it
    stores opens to the file's bytes, through the location and through the store."""
    data = os.urandom(length)
    src = tmp_path / "pack.staging"
    src.write_bytes(data)
    inner = LocalBlobStore(tmp_path / "loc")
    store = SealedBlobStore(inner, CRYPTO)
    key = objectnames.pack_name("ab" * 32)
    store.put_file(key, src)
    assert not src.exists() and not list(tmp_path.glob("*.sealed"))
    raw = inner.get(key)
    assert len(raw) == sealed_size(length)
    assert length < 64 or data[:64] not in raw
    assert bytes(CRYPTO.open(key, raw)) == data
    assert store.get(key) == data
    assert store.get_range(key, length // 3, SEGMENT) == data[length // 3 : length // 3 + SEGMENT]


def test_a_file_that_ends_early_while_sealed_is_refused(tmp_path: Path) -> None:
    class Short:
        def readinto(self, buf: memoryview) -> int:
            return 0

    with open(os.devnull, "wb") as sink, pytest.raises(OSError, match="ended after 0 of its 10 bytes"):
        CRYPTO.seal_file("k", Short(), 10, sink)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 3 * SEGMENT + 9), data=st.data())
def test_a_scatter_read_fills_any_buffers_with_exactly_the_plaintext(
        tmp_path_factory: pytest.TempPathFactory, length: int, data: st.DataObject) -> None:
    store = SealedBlobStore(LocalBlobStore(tmp_path_factory.mktemp("blobs")), CRYPTO)
    plain = os.urandom(length)
    store.put("packs/ab/p", plain)
    offset = data.draw(st.integers(0, length - 1))
    sizes = data.draw(st.lists(st.integers(0, SEGMENT + 300), min_size=1, max_size=6))
    buffers = [memoryview(bytearray(n)) for n in sizes]
    got = store.read_into("packs/ab/p", offset, buffers)
    want = plain[offset : offset + sum(sizes)]
    assert got == len(want)
    assert b"".join(bytes(b) for b in buffers)[:got] == want


def test_a_scatter_read_of_a_damaged_segment_raises(tmp_path: Path) -> None:
    inner = LocalBlobStore(tmp_path / "blobs")
    store = SealedBlobStore(inner, CRYPTO)
    store.put("packs/ab/p", os.urandom(2 * SEGMENT))
    path = tmp_path / "blobs" / "packs" / "ab" / "p"
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + SEGMENT + TAG_SIZE + 5] ^= 1  # inside the second segment
    path.write_bytes(bytes(raw))
    with pytest.raises(SealedObjectError, match="segment 1"):
        store.read_into("packs/ab/p", 0, [memoryview(bytearray(2 * SEGMENT))])


def test_a_segment_that_fails_authentication_leaves_no_byte_in_the_buffer(tmp_path: Path) -> None:
    """Segments are decrypted straight into the caller's buffer: one whose tag does not match
    is wiped there before the error, so no unauthenticated plaintext is left behind."""
    inner = LocalBlobStore(tmp_path / "blobs")
    store = SealedBlobStore(inner, CRYPTO)
    plain = os.urandom(3 * SEGMENT)
    store.put("packs/aa/p", plain)
    path = tmp_path / "blobs" / "packs" / "aa" / "p"
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + (SEGMENT + TAG_SIZE) + 1000] ^= 0x10  # inside the second segment
    path.chmod(0o644)
    path.write_bytes(raw)
    out = bytearray(b"\xaa" * len(plain))
    with pytest.raises(SealedObjectError, match="fails authentication"):
        store.read_into("packs/aa/p", 0, [memoryview(out)])
    assert out[:SEGMENT] == plain[:SEGMENT]  # authenticated before the damage was met
    assert out[SEGMENT : 2 * SEGMENT] == bytes(SEGMENT)
