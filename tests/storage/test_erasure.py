"""Redundancy specs and the erasure code (pyeclib, ISA-L Reed-Solomon, Cauchy).

What pyeclib does and does not check matters to the pack layer above it (`Packs`):
its fragments carry a small header with their index and an integrity check
of that header only. A fragment whose *payload* is damaged (bit rot, a
truncated write) decodes without error to wrong bytes. That is why every
shard's payload carries a BLAKE3 in its casckpt header and in the catalog,
and why a rebuilt pack is verified against its id before use; the last
tests here check that protection end to end.
"""

from __future__ import annotations

import dataclasses
import glob
import random
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import casckpt
from casckpt import config as cfg
from casckpt.errors import CorruptPackError, InvalidArgumentError
from casckpt.format.shard import (
    SHARD_HEADER_SIZE,
    decode_shard_header,
    encode_shard_header,
    payload_checksum,
)
from casckpt.storage.erasure import DEFAULT_ALGORITHM, MAX_SHARDS, ErasureCode, Redundancy

PROPERTY = settings(max_examples=40, deadline=None)

# -- Redundancy.parse ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind", "k", "m"),
    [
        ("none", "none", 1, 0),
        ("NONE", "none", 1, 0),
        ("  none\n", "none", 1, 0),
        ("replicate:2", "replicate", 1, 1),
        ("replicate:3", "replicate", 1, 2),
        (f"replicate:{MAX_SHARDS}", "replicate", 1, MAX_SHARDS - 1),
        ("Replicate:02", "replicate", 1, 1),
        ("ec:4+2", "ec", 4, 2),
        ("EC:4+2", "ec", 4, 2),
        (" ec:10+4 ", "ec", 10, 4),
        ("ec:1+1", "ec", 1, 1),
        ("ec:16+16", "ec", 16, 16),
        (f"ec:{MAX_SHARDS - 1}+1", "ec", MAX_SHARDS - 1, 1),
        ("ec:1+31", "ec", 1, 31),
    ],
)
def test_parse_accepts(spec: str, kind: str, k: int, m: int) -> None:
    assert Redundancy.parse(spec) == Redundancy(kind, k, m)


UNKNOWN_FORMS = ["", " ", "nope", "None!", "none:1", "replicate", "replicate:", "replicate:x",
                 "replicate:+2", "replicate:-2", "replicate:2.0", "copies:2", "ec", "ec:", "ec:4",
                 "ec:4+", "ec:+2", "ec:4+2+1", "ec:4-2", "ec:4 + 2", "ec:4+2x", "ec:a+b", "ec4+2",
                 "rs:4+2", "ec:4+-1", "ec:-4+2"]
OUT_OF_RANGE = ["replicate:0", "replicate:1", f"replicate:{MAX_SHARDS + 1}", "replicate:1000",
                "ec:0+2", "ec:4+0", "ec:0+0", f"ec:{MAX_SHARDS}+1", "ec:30+3", "ec:17+16"]


@pytest.mark.parametrize("spec", UNKNOWN_FORMS)
def test_parse_rejects_unknown_forms_and_names_the_accepted_ones(spec: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        Redundancy.parse(spec)
    message = str(info.value)
    assert repr(spec) in message
    for form in ("'none'", "'replicate:N'", "'ec:K+M'", "ec:4+2"):
        assert form in message


@pytest.mark.parametrize("spec", OUT_OF_RANGE)
def test_parse_rejects_sizes_out_of_range_and_says_the_range(spec: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        Redundancy.parse(spec)
    message = str(info.value)
    assert str(MAX_SHARDS) in message
    assert ("N must be 2.." if spec.startswith("replicate") else "K >= 1, M >= 1") in message
    assert isinstance(info.value, ValueError)  # callers may catch it as a ValueError


@pytest.mark.parametrize(
    ("spec", "text"),
    [("none", "none"), ("NONE", "none"), ("replicate:2", "replicate:2"), ("replicate:05", "replicate:5"),
     ("ec:4+2", "ec:4+2"), ("EC:04+02", "ec:4+2"), ("ec:1+1", "ec:1+1")],
)
def test_str_is_the_canonical_spec_and_round_trips(spec: str, text: str) -> None:
    parsed = Redundancy.parse(spec)
    assert str(parsed) == text
    assert Redundancy.parse(str(parsed)) == parsed


schemes = st.one_of(
    st.just(Redundancy("none")),
    st.integers(1, MAX_SHARDS - 1).map(lambda extra: Redundancy("replicate", 1, extra)),
    st.integers(1, MAX_SHARDS - 1).flatmap(
        lambda k: st.integers(1, MAX_SHARDS - k).map(lambda m: Redundancy("ec", k, m))),
)


@PROPERTY
@given(scheme=schemes)
def test_str_round_trips_every_valid_scheme(scheme: Redundancy) -> None:
    assert Redundancy.parse(str(scheme)) == scheme


@pytest.mark.parametrize(
    ("spec", "shards", "needed", "quorum"),
    [
        ("none", 1, 1, 1),
        ("replicate:2", 2, 1, 2),
        ("replicate:3", 3, 1, 2),
        ("replicate:5", 5, 1, 2),
        ("ec:1+1", 2, 1, 2),
        ("ec:2+1", 3, 2, 3),
        ("ec:4+2", 6, 4, 5),
        ("ec:10+4", 14, 10, 11),
        ("ec:31+1", 32, 31, 32),
    ],
)
def test_shards_needed_and_default_quorum(spec: str, shards: int, needed: int, quorum: int) -> None:
    scheme = Redundancy.parse(spec)
    assert (scheme.shards, scheme.needed, scheme.default_quorum()) == (shards, needed, quorum)
    # a commit survives losing one location right after it, yet never waits for more than all
    assert scheme.needed <= scheme.default_quorum() <= scheme.shards


# -- the erasure code -----------------------------------------------------------------


sizes = st.one_of(st.integers(0, 16), st.integers(0, 4096), st.integers(0, 200 * 1024))


@PROPERTY
@given(k=st.integers(1, 6), m=st.integers(1, 3), size=sizes, seed=st.integers(0, 2**32),
       data=st.data())
def test_encode_decode_roundtrip(k: int, m: int, size: int, seed: int, data: st.DataObject) -> None:
    pack = random.Random(seed).randbytes(size)
    code = ErasureCode(k, m)
    fragments, stripe, offset = code.encode(pack)
    assert len(fragments) == k + m
    assert len({len(f) for f in fragments}) == 1, "fragments differ in length"
    assert stripe == -(-size // k)
    assert offset >= 0
    # systematic: data fragment i holds pack[i*stripe:(i+1)*stripe] from data_offset, zero-padded
    for i in range(k):
        part = pack[i * stripe : (i + 1) * stripe]
        assert fragments[i][offset : offset + len(part)] == part
        assert fragments[i][offset + len(part) :].strip(b"\0") == b"" or len(part) == stripe
    # from all of them, from exactly k in any order, as a mapping or a sequence
    assert code.decode(fragments, size, "p") == pack
    chosen = data.draw(st.permutations(range(k + m)))[:k]
    assert code.decode({i: fragments[i] for i in chosen}, size, "p") == pack
    assert code.decode([memoryview(fragments[i]) for i in chosen], size, "p") == pack


@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 4095, 4097])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (3, 2), (4, 2), (6, 3)])
def test_tiny_and_odd_sizes_from_parity_alone_where_possible(size: int, k: int, m: int) -> None:
    pack = random.Random(size).randbytes(size)
    code = ErasureCode(k, m)
    fragments, stripe, _ = code.encode(pack)
    assert stripe == -(-size // k)
    # the last k fragments: as many parity ones as there are, i.e. the hardest decode
    assert code.decode(fragments[-k:], size, "p") == pack


@pytest.mark.parametrize(("k", "m"), [(31, 1), (16, 16), (1, 31), (10, 4)])
def test_the_widest_schemes_parse_accepts_work(k: int, m: int) -> None:
    assert k + m <= MAX_SHARDS
    pack = random.Random(k).randbytes(100_003)
    code = ErasureCode(k, m)
    fragments, stripe, _ = code.encode(pack)
    assert len(fragments) == k + m and stripe == -(-len(pack) // k)
    chosen = random.Random(m).sample(range(k + m), k)
    assert code.decode({i: fragments[i] for i in chosen}, len(pack), "p") == pack


def test_data_fragments_hold_the_pack_unchanged() -> None:
    pack = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: not divisible by k
    code = ErasureCode(4, 2)
    fragments, stripe, offset = code.encode(pack)
    assert stripe == 2561
    assert b"".join(fragments[i][offset : offset + stripe] for i in range(4))[: len(pack)] == pack
    assert fragments[3][offset + len(pack) - 3 * stripe : offset + stripe] == bytes(4 * stripe - len(pack))


def test_fewer_than_k_fragments_is_a_corrupt_pack() -> None:
    code = ErasureCode(4, 2)
    pack = random.Random(1).randbytes(5000)
    fragments, _, _ = code.encode(pack)
    for n in range(4):
        with pytest.raises(CorruptPackError, match=rf"pack-x: {n} healthy shards, 4 needed"):
            code.decode(fragments[:n], len(pack), "pack-x")
    with pytest.raises(CorruptPackError):
        code.decode({}, len(pack), "pack-x")


@pytest.mark.parametrize("damage", ["duplicates", "garbage", "cut_short", "another_pack", "header"])
def test_fragments_pyeclib_refuses_are_a_corrupt_pack(damage: str) -> None:
    code = ErasureCode(4, 2)
    pack = random.Random(2).randbytes(10_000)
    fragments, _, offset = code.encode(pack)
    rng = random.Random(3)
    if damage == "duplicates":  # k copies of one fragment: not k distinct ones
        given_ = [fragments[0]] * 4
    elif damage == "garbage":
        given_ = [rng.randbytes(len(f)) for f in fragments[:4]]
    elif damage == "cut_short":  # into the fragment header
        given_ = [f[:50] for f in fragments[:4]]
    elif damage == "another_pack":  # fragments of a pack of another length mixed in
        other, _, _ = code.encode(rng.randbytes(5000))
        given_ = fragments[:2] + other[2:4]
    else:  # pyeclib checks its own fragment header (where the index and sizes are)
        bad = bytearray(fragments[1])
        bad[10] ^= 0xFF
        given_ = [fragments[0], bytes(bad), fragments[4], fragments[5]]
    assert offset > 10
    with pytest.raises(CorruptPackError, match="pack-x"):
        code.decode(given_, len(pack), "pack-x")


def test_decoded_length_must_match() -> None:
    code = ErasureCode(2, 1)
    pack = b"x" * 100
    fragments, _, _ = code.encode(pack)
    with pytest.raises(CorruptPackError, match="decoded 100 bytes, expected 101"):
        code.decode(fragments, 101, "p")


@pytest.mark.parametrize("damage", ["data_payload", "parity_payload", "truncated_payloads"])
def test_pyeclib_decodes_damaged_payloads_to_wrong_bytes_silently(damage: str) -> None:
    """Documents the gap the shard checksums and the pack-id check close (see the module doc)."""
    code = ErasureCode(4, 2)
    pack = random.Random(4).randbytes(10_000)
    fragments, _, offset = code.encode(pack)
    if damage == "data_payload":
        bad = bytearray(fragments[0])
        bad[offset + 5] ^= 1
        given_ = [bytes(bad), *fragments[1:4]]
    elif damage == "parity_payload":
        bad = bytearray(fragments[4])
        bad[offset + 5] ^= 1
        given_ = [bytes(bad), fragments[5], fragments[2], fragments[3]]
    else:
        given_ = [f[:-10] for f in fragments[:4]]
    out = code.decode(given_, len(pack), "p")  # no error...
    assert len(out) == len(pack) and out != pack  # ...and wrong bytes


def test_unavailable_algorithm_is_refused_up_front() -> None:
    with pytest.raises(InvalidArgumentError, match="no_such_code 4\\+2 is unavailable"):
        ErasureCode(4, 2, "no_such_code")
    assert ErasureCode(4, 2).algorithm == DEFAULT_ALGORITHM == "isa_l_rs_cauchy"


def test_one_code_is_usable_from_many_threads() -> None:
    code = ErasureCode(3, 2)
    packs = [random.Random(i).randbytes(20_000 + i) for i in range(8)]
    errors: list[BaseException] = []

    def work(pack: bytes) -> None:
        try:
            for _ in range(5):
                fragments, _, _ = code.encode(pack)
                assert code.decode(fragments[2:], len(pack), "p") == pack
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in packs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


# -- the pack layer's protection against damaged payloads -----------------------------


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(60_000, generator=torch.Generator().manual_seed(0))}


def _open(root: Path) -> casckpt.Store:
    return casckpt.open(root / "s", blobs=[str(root / d) for d in "abc"], redundancy="ec:2+1",
                        cache=root / "cache")


def _shard_file(root: Path, index: int) -> Path:
    (path,) = glob.glob(str(root / "*" / "packs" / "*" / f"*.s{index}"))
    return Path(path)


def _flip_payload_byte(data: bytes) -> tuple[bytes, bytes]:
    """(shard bytes with one payload bit flipped, the damaged payload)."""
    header = decode_shard_header(data, "s")
    damaged = bytearray(data)
    damaged[SHARD_HEADER_SIZE + header.data_offset + 100] ^= 1
    return bytes(damaged), bytes(damaged[SHARD_HEADER_SIZE:])


def test_bit_rot_in_a_data_shard_is_caught_and_healed_on_read(tmp_path: Path) -> None:
    state = _state()
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1)
    path = _shard_file(tmp_path, 0)
    original = path.read_bytes()
    path.write_bytes(_flip_payload_byte(original)[0])

    with _open(tmp_path) as store:
        assert torch.equal(store.restore("r@1")["w"], state["w"])
        assert path.read_bytes() == original, "the damaged shard was not written again"
        assert store.ops.check(read_data=True).ok


def test_a_self_consistent_wrong_shard_never_yields_wrong_bytes(tmp_path: Path) -> None:
    """A shard whose payload is wrong yet matches its header and catalog checksums
    (damage before the checksum was taken) passes every per-shard check and
    makes pyeclib decode garbage: only the pack-id check stands between it and
    the caller. The rebuild then tries subsets of K shards, finds the pack in
    the others, blames only the inconsistent shard and heals it.
    """
    state = _state()
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1)
    path = _shard_file(tmp_path, 0)
    original = path.read_bytes()
    _, payload = _flip_payload_byte(original)
    header = dataclasses.replace(decode_shard_header(original, "s"), checksum=payload_checksum(payload))
    path.write_bytes(encode_shard_header(header) + payload)
    with sqlite3.connect(tmp_path / "s" / cfg.CATALOG_FILE) as conn:
        conn.execute("UPDATE shards SET checksum = ? WHERE idx = 0", (header.checksum,))
    conn.close()

    with _open(tmp_path) as store:
        assert torch.equal(store.restore("r@1")["w"], state["w"])
        assert path.read_bytes() == original, "heal on read rewrote the inconsistent shard"
        assert store.ops.check(read_data=True).ok


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 3), size=st.integers(1, 64 << 10),
       seed=st.integers(0, 2**32 - 1))
def test_reconstruct_rebuilds_lost_fragments_byte_identical(k: int, m: int, size: int, seed: int) -> None:
    """Heal writes reconstructed fragments where encode's were: they must be the same bytes."""
    rng = random.Random(seed)
    data = rng.randbytes(size)
    code = ErasureCode(k, m)
    fragments, stripe, offset = code.encode(data)
    lost = sorted(rng.sample(range(k + m), rng.randint(1, m)))
    kept = {i: f for i, f in enumerate(fragments) if i not in lost}
    rebuilt = code.reconstruct(kept, lost, "test")
    assert rebuilt == {i: fragments[i] for i in lost}
    assert code.reconstruct(kept, [], "test") == {}
    with pytest.raises(CorruptPackError):
        code.reconstruct(dict(list(kept.items())[: k - 1]), lost, "test")
