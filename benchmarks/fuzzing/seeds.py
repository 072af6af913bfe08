"""The valid inputs every target starts from, produced by casckpt's own code.

``build_seeds(dir)`` writes, once per campaign (workers load them read-only):

- ``formats.pickle``: packs written by :class:`PackWriter` holding raw,
  zstd, byte-grouped (2/4/8) and delta-coded chunks (chains of XOR deltas,
  grouped and not), with every chunk's raw bytes; the erasure-coded shards of
  those packs (ec 2+1 and 3+2) as the pack store writes them; manifests of
  version 1 (a real store's) and version 2 (sharded tensors, per-rank trees).
- ``stores/plain``: a local store of two runs with delta chains, a fork,
  moved tags and a retention policy (so ``refs/`` records exist), and
  ``stores/ec``: an ``ec:2+1`` store over three location directories;
  ``stores/plain-empty``: the plain store's blobs with an empty catalog. Each
  with ``expected.pickle``: every version's state as committed.

Everything is deterministic from the campaign seed except the pack nonces and
timestamps a real store writes, which no target depends on.
"""

from __future__ import annotations

import io
import pickle
import random
import shutil
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import casckpt
from benchmarks.oldformats import encode_manifest
from casckpt.format.chunks import chunk_id
from casckpt.format.codecs import PLANES, CompressionPolicy, encode_chunk, encode_delta, encode_planes
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, World
from casckpt.format.merkle import node_json
from casckpt.format.pack import PackWriter
from casckpt.format.shard import ShardHeader, encode_shard_header, payload_checksum
from casckpt.storage.erasure import ErasureCode

CHUNK = 4096


@dataclass(frozen=True, slots=True)
class PackSeed:
    """A pack, its id, and the raw bytes of every chunk it holds (or whose base it holds)."""

    pack_id: str
    data: bytes
    chunks: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class ShardSeed:
    """The erasure-coded objects of one pack."""

    pack_id: str
    pack: bytes
    k: int
    m: int
    algorithm: str
    shards: dict[int, bytes]


@dataclass(frozen=True, slots=True)
class FormatSeeds:
    packs: list[PackSeed]
    shards: list[ShardSeed]
    manifests: list[tuple[str, bytes]]  # (version id, compressed manifest)
    nodes: dict[bytes, bytes] = field(default_factory=dict)  # tree nodes of those manifests: id -> JSON


def _smooth(rng: np.random.Generator, n: int, dtype: Any) -> np.ndarray:
    return (np.cumsum(rng.normal(0, 0.01, n)) + 1.0).astype(dtype)


def _pack(seed: int, variant: int) -> PackSeed:
    """A pack with one chunk of every codec: raw, zstd, grouped 2/4/8, planes, and delta chains."""
    rng = np.random.default_rng(seed * 10 + variant)
    policy = CompressionPolicy()
    plain = [
        (rng.bytes(700 + variant), 1),  # incompressible: raw
        (bytes(range(256)) * 12, 1),  # zstd
        (torch.from_numpy(_smooth(rng, 1024, np.float32)).to(torch.bfloat16).view(torch.uint8).numpy()
         .tobytes(), 2),
        (_smooth(rng, 1024, np.float32).tobytes(), 4),
        (np.arange(512, dtype=np.int64).tobytes(), 8),
    ]
    buffer = io.BytesIO()
    writer = PackWriter(buffer, nonce=bytes([seed % 256, variant]) * 8)
    chunks: dict[bytes, bytes] = {}
    for raw, width in plain:
        codec, payload = encode_chunk(raw, width, policy)
        cid = chunk_id(raw)
        chunks[cid] = raw
        writer.add(cid, codec.id, len(raw), payload)
    for width, mask in ((4, 0b1000), (2, 0b10)):  # planes: fp32 with its exponent plane, bf16's
        raw = (rng.standard_normal(1024) * 0.02).astype(np.float32).tobytes()
        cid = chunk_id(raw)
        chunks[cid] = raw
        writer.add(cid, PLANES.id, len(raw), encode_planes(raw, width, mask, 1))
    for width in (1, 2, 4, 8):  # a keyframe, then two deltas on it
        base = _smooth(rng, 2048 // 4, np.float32).tobytes()
        codec, payload = encode_chunk(base, width, policy)
        prev_id = chunk_id(base)
        chunks[prev_id] = base
        writer.add(prev_id, codec.id, len(base), payload)
        prev = base
        for _ in range(2):
            array = np.frombuffer(prev, dtype=np.float32).copy()
            array[:: 7] *= np.float32(1.0001)
            raw = array.tobytes()
            codec, payload = encode_delta(raw, prev, width, 1)
            assert codec.is_delta
            cid = chunk_id(raw)
            chunks[cid] = raw
            writer.add(cid, codec.id, len(raw), payload, base_id=prev_id)
            prev, prev_id = raw, cid
    pack_id = writer.finish()
    return PackSeed(pack_id, buffer.getvalue(), chunks)


def _shards(pack: PackSeed, k: int, m: int) -> ShardSeed:
    """The pack's shard objects, as the pack store writes them (header + fragment)."""
    code = ErasureCode(k, m)
    fragments, _stripe, offset = code.encode(pack.data)
    shards = {}
    for index, fragment in enumerate(fragments):
        header = ShardHeader(pack.pack_id, index, k, m, code.algorithm, len(pack.data), len(fragment),
                             offset, payload_checksum(fragment))
        shards[index] = encode_shard_header(header) + fragment
    return ShardSeed(pack.pack_id, pack.data, k, m, code.algorithm, shards)


def _cid(i: int) -> bytes:
    return chunk_id(bytes([i]))


def _v2_manifests() -> list[Manifest]:
    """A DCP-style version with a tensor in two shards, and a group commit with per-rank trees."""
    sharded = Manifest(
        run="dist", step=5, parent=None, created_at=1.5,
        root={"t": "dict", "k": ["w", "step", {"i": 3}],
              "v": [{"t": "sharded", "i": [0, 1]}, {"t": "int", "v": 7},
                    {"t": "float", "v": "3ff0000000000000"}]},
        tensors=(
            TensorEntry("w", "torch", "float32", (6, 4), 0, global_shape=(10, 4), global_offset=(0, 0)),
            TensorEntry("w", "torch", "float32", (4, 4), 1, global_shape=(10, 4), global_offset=(6, 0)),
        ),
        extents=(ExtentEntry(96, 64, (_cid(1), _cid(2))), ExtentEntry(64, 64, (_cid(2), _cid(3)), phase=32)),
        metadata={"note": "v2"}, metrics={"loss": 0.5}, world=World(2, "dcp"),
    )
    tree = {"t": "dict", "k": ["x", "pos"], "v": [{"t": "tensor", "i": 0}, {"t": "int", "v": 0}]}
    other = {"t": "dict", "k": ["x", "pos"], "v": [{"t": "tensor", "i": 1}, {"t": "bytes", "v": "AAE="}]}
    ranks = Manifest(
        run="group", step=2, parent="ab" * 32, created_at=2.0, root={"t": "ranks", "v": [tree, other]},
        tensors=(TensorEntry("x", "torch", "int8", (3,), 0, rank=0),
                 TensorEntry("x", "numpy", "<i4", (2, 2), 1, stride=(2, 1), rank=1)),
        extents=(ExtentEntry(3, 64, (_cid(4),)), ExtentEntry(16, 64, (_cid(5),))), tags=("t1",),
        world=World(2, "group"),
    )
    return [sharded, ranks]


def _state(seed: int, step: int) -> dict[str, Any]:
    """A state exercising every codec and node type; later steps nudge the weights a little."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6000, generator=g)
    emb = torch.linspace(-1, 1, 4096).to(torch.bfloat16)
    ids = torch.arange(3000, dtype=torch.int64)
    for s in range(1, step):
        w = w * (1 + 1e-4 * torch.randn(6000, generator=g))
        ids = ids + s
    shared = torch.arange(64, dtype=torch.float32)
    return {
        "model": {"w": w, "emb": emb, "ids": ids, "shared": shared, "view": shared[8:24].view(4, 4)},
        "arr": np.arange(step, step + 700, dtype=np.int32),
        "meta": {"lr": 0.1 * step, "name": f"step {step}", "raw": b"\x00\x01\xff", "tuple": (1, None, True),
                 3: -0.0, "nan": float("nan")},
        "step": step,
    }


def _build_plain(root: Path, seed: int) -> dict[str, Any]:
    expected = {}
    with casckpt.open(root, chunk_size=CHUNK, pack_size=48 << 10, workers=2) as store:
        for step in (1, 2, 3):
            expected[f"a@{step}"] = _state(seed, step)
            store.commit(expected[f"a@{step}"], run="a", step=step, metrics={"loss": 1.0 / step},
                         metadata={"host": "fuzz"}, message=f"step {step}")
        store.tag("a@1", "first")
        store.tag("a@2", "best")
        store.tag("a@3", "best")  # moved: the newest record wins on rebuild
        store.fork("a@2", "b")
        expected["b@10"] = _state(seed + 1, 1)
        store.commit(expected["b@10"], run="b", step=10)
        store.retention.set("a", keep_last=5, keep_best=("loss", 1, "min"))
        assert store.ops.check(read_data=True).ok
    return expected


def _build_ec(root: Path, seed: int) -> dict[str, Any]:
    expected = {}
    with casckpt.open(root, blobs=["l0", "l1", "l2"], redundancy="ec:2+1", chunk_size=CHUNK,
                      pack_size=32 << 10, workers=2) as store:
        for step in (1, 2):
            expected[f"a@{step}"] = _state(seed + 7, step)
            store.commit(expected[f"a@{step}"], run="a", step=step)
        assert store.ops.check(read_data=True).ok
    return expected


def build_seeds(directory: Path, seed: int) -> None:
    """Write every seed the targets need under ``directory`` (which must not exist yet)."""
    directory.mkdir(parents=True)
    random.seed(seed)
    torch.manual_seed(seed)
    stores = directory / "stores"
    for name, build in (("plain", _build_plain), ("ec", _build_ec)):
        expected = build(stores / name / "store", seed)
        (stores / name / "expected.pickle").write_bytes(pickle.dumps(expected))
    empty = stores / "plain-empty"  # the plain store's blobs with an empty catalog: to rebuild
    shutil.copytree(stores / "plain" / "store", empty / "store")
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (empty / "store" / name).unlink(missing_ok=True)
    casckpt.open(empty / "store", create=False, recover=True).close()
    shutil.copy(stores / "plain" / "expected.pickle", empty / "expected.pickle")
    packs = [_pack(seed, variant) for variant in range(2)]
    shards = [_shards(packs[0], 2, 1), _shards(packs[1], 3, 2)]
    manifests = [encode_manifest(m) for m in _v2_manifests()]
    for path in sorted((stores / "plain" / "store" / "manifests").iterdir()):
        manifests.append((path.name, path.read_bytes()))
    with closing(sqlite3.connect(stores / "plain" / "store" / "catalog.db")) as db:
        rows = db.execute("SELECT id, body FROM tree_nodes").fetchall()
    nodes = {bytes.fromhex(i): node_json(body) for i, body in rows}
    (directory / "formats.pickle").write_bytes(pickle.dumps(FormatSeeds(packs, shards, manifests, nodes)))


def load_format_seeds(directory: Path) -> FormatSeeds:
    """The pack, shard and manifest seeds :func:`build_seeds` wrote."""
    seeds: FormatSeeds = pickle.loads((directory / "formats.pickle").read_bytes())
    return seeds


def load_expected(directory: Path, store: str) -> dict[str, Any]:
    """Every version's state as committed to a template store, by ref."""
    expected: dict[str, Any] = pickle.loads((directory / "stores" / store / "expected.pickle").read_bytes())
    return expected
