"""Targets over the byte formats: packs, erasure-coded shards and manifests (``casckpt.format``).

Each reads hostile bytes the way the engine does and checks what comes back:
a chunk a pack reader returns must hash to its id and equal the chunk that
was stored; a pack rebuilt from shards must be the pack; a manifest accepted
must be the one whose id was asked for, and everything the engine does with
an accepted manifest (tree decoding, rank views, catalog rows, tensor views
over extent buffers) must work or raise a CasckptError.
"""

from __future__ import annotations

import json
import math
import random
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zstandard
from blake3 import blake3

from benchmarks.fuzzing.harness import WrongData
from benchmarks.fuzzing.mutate import Field, forge_field, json_text, mutate_bytes, mutate_json, splice
from benchmarks.fuzzing.seeds import FormatSeeds, PackSeed
from casckpt.engine.read.restore import _assemble, _stored_leaves
from casckpt.engine.versions.extents import tensor_from_extent
from casckpt.engine.versions.tensorrows import tensor_rows
from casckpt.errors import CasckptError, CorruptPackError
from casckpt.format.chunks import chunk_id, object_id
from casckpt.format.manifest import Manifest, decode_manifest, rank_count, rank_view, sharding
from casckpt.format.merkle import Nodes, NodeSource
from casckpt.format.pack import (
    ENTRY_HEADER_SIZE,
    TRAILER_SIZE,
    PackEntry,
    decode_entry,
    read_index,
    scan_entries,
)
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header, payload_checksum
from casckpt.format.state import decode_state, iter_values
from casckpt.format.treeread import TreeReader
from casckpt.storage.erasure import ErasureCode

_BUFFER_LIMIT = 64 << 20  # extent bytes a case may allocate to build tensor views of an accepted manifest


def all_paths(attempts: list[Callable[[], None]]) -> None:
    """Run every read path; a CasckptError in one does not skip the others. Rejected only if
    every path rejected; any other exception propagates (a bug)."""
    first: CasckptError | None = None
    accepted = False
    for attempt in attempts:
        try:
            attempt()
            accepted = True
        except CasckptError as exc:
            first = first or exc
    if not accepted and first is not None:
        raise first


# --- packs ------------------------------------------------------------------------------------


def _entry_fix(offset: int) -> Callable[[bytearray], None]:
    def fix(buf: bytearray) -> None:
        if offset + ENTRY_HEADER_SIZE <= len(buf):
            buf[offset + 88 : offset + 92] = struct.pack("<I", zlib.crc32(bytes(buf[offset : offset + 88])))
    return fix


def _footer_fix(buf: bytearray) -> None:
    size = len(buf)
    if size < TRAILER_SIZE:
        return
    (footer_len,) = struct.unpack_from("<Q", buf, size - TRAILER_SIZE)
    if 12 <= footer_len <= size - TRAILER_SIZE:
        footer = bytes(buf[size - TRAILER_SIZE - footer_len : size - TRAILER_SIZE])
        buf[size - TRAILER_SIZE + 8 : size - TRAILER_SIZE + 24] = blake3(footer).digest()[:16]


def pack_fields(seed: PackSeed) -> tuple[list[Field], list[Field], list[Field], list[int]]:
    """(entry header fields, footer fields, trailer fields, values worth trying) of a pack."""
    entries = read_index(seed.data)
    size = len(seed.data)
    (footer_len,) = struct.unpack_from("<Q", seed.data, size - TRAILER_SIZE)
    footer_at = size - TRAILER_SIZE - footer_len
    head: list[Field] = []
    for i, e in enumerate(entries):
        fix = _entry_fix(e.offset)
        head += [Field(f"entry {i} {name}", e.offset + at, width, fix) for name, at, width in (
            ("codec", 4, 1), ("flags", 5, 1), ("reserved", 6, 2), ("chunk id", 8, 32), ("raw_len", 40, 8),
            ("stored_len", 48, 8), ("base id", 56, 32))]
    foot = [Field("footer count", footer_at + 4, 8, _footer_fix)]
    for i in range(len(entries)):
        at = footer_at + 12 + i * 90
        foot += [Field(f"footer entry {i} {name}", at + off, width, _footer_fix) for name, off, width in (
            ("chunk id", 0, 32), ("offset", 32, 8), ("stored_len", 40, 8), ("raw_len", 48, 8),
            ("codec", 56, 1), ("flags", 57, 1), ("base id", 58, 32))]
    trailer = [Field("trailer footer_len", size - TRAILER_SIZE, 8, _footer_fix),
               Field("trailer magic", size - 8, 8)]
    values = sorted({v for e in entries for v in (e.offset, e.stored_len, e.raw_len, e.offset + e.span)}
                    | set(range(10)) | {255, footer_at, footer_len})
    return head, foot, trailer, values


class PackTarget:
    """Pack bytes read three ways: through the footer, through the catalog's entries (the
    restore path: byte ranges named by the catalog), and by scanning the entry headers."""

    name = "pack"
    kinds: tuple[str, ...] = (
        "bytes", "forge-entry", "forge-footer", "forge-trailer", "splice", "swap-entries")

    def __init__(self, seeds: FormatSeeds) -> None:
        self.seeds = seeds.packs
        self.fields = [pack_fields(s) for s in self.seeds]

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        which = rng.randrange(len(self.seeds))
        seed, (head, foot, trailer, values) = self.seeds[which], self.fields[which]
        if kind == "bytes":
            data, what = mutate_bytes(seed.data, rng)
        elif kind in ("forge-entry", "forge-footer", "forge-trailer"):
            fields = {"forge-entry": head, "forge-footer": foot, "forge-trailer": trailer}[kind]
            data, what = forge_field(seed.data, fields, rng, values)
        elif kind == "splice":
            other = self.seeds[1 - which].data if len(self.seeds) > 1 else seed.data
            data, what = splice(seed.data, other, rng)
        else:
            data, what = self._swap(seed, rng)
        note(f"pack seed {which}: {what}")
        _read_pack(data, seed)

    @staticmethod
    def _swap(seed: PackSeed, rng: random.Random) -> tuple[bytes, str]:
        """Two footer records exchanged (digest fixed): every entry points at another's bytes."""
        entries = read_index(seed.data)
        i, j = rng.sample(range(len(entries)), 2)
        size = len(seed.data)
        (footer_len,) = struct.unpack_from("<Q", seed.data, size - TRAILER_SIZE)
        at = size - TRAILER_SIZE - footer_len + 12
        buf = bytearray(seed.data)
        a, b = bytes(buf[at + i * 90 : at + i * 90 + 32]), bytes(buf[at + j * 90 : at + j * 90 + 32])
        buf[at + i * 90 : at + i * 90 + 32], buf[at + j * 90 : at + j * 90 + 32] = b, a
        _footer_fix(buf)
        return bytes(buf), f"swap the chunk ids of footer records {i} and {j} (digest fixed)"


def _check_chunk(seed: PackSeed, entry: PackEntry, raw: bytes | memoryview) -> None:
    if chunk_id(raw) != entry.chunk_id:
        raise WrongData(f"pack reader returned bytes that do not hash to chunk {entry.chunk_id.hex()[:12]}")
    want = seed.chunks.get(entry.chunk_id)
    if want is not None and bytes(raw) != want:
        raise WrongData(f"pack reader returned other bytes for chunk {entry.chunk_id.hex()[:12]}")


def _decode_all(data: bytes, entries: list[PackEntry], seed: PackSeed,
                bases: dict[bytes, bytes]) -> None:
    decoded = dict(bases)
    for e in entries:
        base = decoded.get(e.base_id) if e.base_id is not None else None
        raw = decode_entry(memoryview(data)[e.offset : e.offset + e.span], e, "fuzz", base)
        _check_chunk(seed, e, raw)
        decoded[e.chunk_id] = bytes(raw)


def _read_pack(data: bytes, seed: PackSeed) -> None:
    """Decode every chunk through the footer, through the catalog's entries, and by scanning."""
    catalog = read_index(seed.data)

    def through_catalog() -> None:  # the catalog knows every entry and every base's raw bytes
        first: CasckptError | None = None
        for e in catalog:
            try:
                _decode_all(data, [e], seed, seed.chunks)
            except CasckptError as exc:
                first = first or exc
        if first is not None:
            raise first

    all_paths([
        lambda: _decode_all(data, read_index(data), seed, {}),
        through_catalog,
        lambda: _decode_all(data, list(scan_entries(data)), seed, {}),
    ])


# --- shards -----------------------------------------------------------------------------------


def _shard_fix(buf: bytearray) -> None:
    if len(buf) >= SHARD_HEADER_SIZE:
        buf[SHARD_HEADER_SIZE - 4 : SHARD_HEADER_SIZE] = struct.pack(
            "<I", zlib.crc32(bytes(buf[: SHARD_HEADER_SIZE - 4])))


SHARD_FIELDS = [Field(name, at, width, _shard_fix) for name, at, width in (
    ("pack id", 8, 32), ("index", 40, 2), ("k", 42, 2), ("m", 44, 2), ("algorithm", 46, 16),
    ("pack_len", 62, 8), ("payload_len", 70, 8), ("data_offset", 78, 4), ("checksum", 82, 32))]


class ShardTarget:
    """Shard objects of one pack (one or two of them hostile) read as a catalog rebuild does:
    headers parsed and checked, payloads checked against their checksums, the pack decoded
    from the survivors with the code the headers name, and checked against its id."""

    name = "shard"
    kinds: tuple[str, ...] = ("bytes", "forge-header", "forge-two", "splice", "swap", "truncate")

    def __init__(self, seeds: FormatSeeds) -> None:
        self.seeds = seeds.shards

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        which = rng.randrange(len(self.seeds))
        seed = self.seeds[which]
        shards = dict(seed.shards)
        index = rng.choice(sorted(shards))
        if kind == "bytes":
            shards[index], what = mutate_bytes(shards[index], rng)
        elif kind in ("forge-header", "forge-two"):
            values = [seed.k, seed.m, len(seed.pack), SHARD_HEADER_SIZE, len(shards[index])]
            shards[index], what = forge_field(shards[index], SHARD_FIELDS, rng, values)
            if kind == "forge-two":
                other = rng.choice([i for i in sorted(shards) if i != index])
                shards[other], more = forge_field(shards[other], SHARD_FIELDS, rng, values)
                what += f"; shard {other}: {more}"
        elif kind == "splice":
            donor = self.seeds[1 - which] if len(self.seeds) > 1 else seed
            shards[index], what = splice(shards[index], rng.choice(list(donor.shards.values())), rng)
        elif kind == "swap":
            other = rng.choice([i for i in sorted(shards) if i != index])
            shards[index], shards[other] = shards[other], shards[index]
            what = f"swap shards {index} and {other}"
        else:
            cut = rng.choice((0, SHARD_HEADER_SIZE - 1, SHARD_HEADER_SIZE, len(shards[index]) - 1))
            shards[index] = shards[index][:cut]
            what = f"truncate to {cut}"
        if rng.random() < 0.3:  # only K shards at hand: the hostile one is needed
            keep = {index, *rng.sample([i for i in sorted(shards) if i != index], seed.k - 1)}
            shards = {i: data for i, data in shards.items() if i in keep}
        note(f"ec {seed.k}+{seed.m} seed {which}, shard {index}: {what} (shards at hand {sorted(shards)})")
        pack = _read_shards(seed.pack_id, shards)
        if pack != seed.pack:
            raise WrongData("shards decoded to another pack that still hashed to the pack id")


def _read_shards(pack_id: str, objects: dict[int, bytes]) -> bytes:
    headers = {}
    for index, data in sorted(objects.items()):
        try:
            header = decode_shard_header(data, f"shard {index}")
        except CorruptPackError:
            continue
        if header.pack_id == pack_id and header.index == index:
            headers[index] = header
    if not headers:
        raise CorruptPackError("no shard header names the pack")
    first = next(iter(headers.values()))
    payloads = {}
    for index, header in headers.items():
        if (header.k, header.m, header.algorithm, header.pack_len) != (
                first.k, first.m, first.algorithm, first.pack_len):
            continue
        payload = memoryview(objects[index])[SHARD_HEADER_SIZE:]
        if len(payload) == header.payload_len and payload_checksum(payload) == header.checksum:
            payloads[index] = bytes(payload)
    code = ErasureCode(first.k, first.m, first.algorithm)
    data = code.decode(payloads, first.pack_len, f"pack {pack_id[:12]}")
    if object_id(data) != pack_id:  # what every caller of decode checks
        raise CorruptPackError("shards decoded to bytes that are not the pack")
    return data


# --- manifests --------------------------------------------------------------------------------


def _raw(data: bytes) -> bytes:
    """Every frame of ``data`` decompressed (what the manifest decoder reads)."""
    raw: bytes = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
    return raw


class _SeedNodes(NodeSource):
    def __init__(self, nodes: dict[bytes, bytes]) -> None:
        self.nodes = nodes

    def get_many(self, ids: Sequence[bytes]) -> dict[bytes, bytes]:
        return {i: self.nodes[i] for i in ids if i in self.nodes}


class ManifestTarget:
    """Manifests decoded against an id (the original, or the forged bytes' own id, as a catalog
    written by a forger would hold), then used as restore, rebuild and history use them."""

    name = "manifest"
    kinds: tuple[str, ...] = ("bytes", "json-bytes", "json", "json-original-id", "zstd", "node")
    weights = {"json": 3.0, "json-bytes": 2.0, "node": 2.0}  # the kinds that reach past the id checks

    def __init__(self, seeds: FormatSeeds) -> None:
        self.seeds = seeds.manifests
        self.docs = [json.loads(_raw(data)) for _, data in self.seeds]
        self.nodes = _SeedNodes(seeds.nodes)  # a tree manifest is read whole, its nodes verified

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        which = rng.randrange(len(self.seeds))
        version_id, data = self.seeds[which]
        expected: str | None = version_id
        nodes = self.nodes
        if kind == "node" and "tree" not in self.docs[which]:
            kind = "json"  # a manifest of format 1 or 2 has no nodes
        if kind == "node":  # a forged node, and every node above it re-hashed, as a forger would
            data, expected, nodes, what = self._forged_node(self.docs[which], rng)
        elif kind == "bytes":
            data, what = mutate_bytes(data, rng)
        elif kind == "json-bytes":
            raw, what = mutate_bytes(_raw(data), rng)
            data, expected = zstandard.ZstdCompressor().compress(raw), object_id(raw)
        elif kind in ("json", "json-original-id"):
            doc, what = mutate_json(self.docs[which], rng)
            text, trick = json_text(doc, rng)
            what += f"; {trick}" if trick else ""
            raw = text.encode("utf-8", "surrogatepass")
            data = zstandard.ZstdCompressor().compress(raw)
            expected = object_id(raw) if kind == "json" else version_id
        else:
            data, expected, what = _zstd_trick(_raw(data), rng)
        if rng.random() < 0.1:
            expected = None
        note(f"manifest seed {which}: {what} (expected id {'none' if expected is None else expected[:12]})")
        manifest = decode_manifest(data, expected, nodes)
        raw = _raw(data)
        if expected is not None and object_id(raw) != expected:
            raise WrongData(f"a manifest that does not hash to {expected[:12]} was accepted")
        violation = schema_violation(json.loads(raw))
        if violation is not None:
            raise WrongData(f"accepted a manifest the encoder could not have written: {violation}")
        use_manifest(manifest, expected or "0" * 64)

    def _forged_node(self, doc: dict[str, Any], rng: random.Random
                     ) -> tuple[bytes, str, _SeedNodes, str]:
        """One node of ``doc``'s tree mutated; its parents (up to the root, and the document)
        rewritten to name the forged ids, so every id check passes."""
        reader = TreeReader(Nodes(self.nodes))
        reader.expand(bytes.fromhex(doc["tree"]["root"]))
        victim = rng.choice(sorted(reader.visited))
        forged, what = mutate_json(json.loads(self.nodes.nodes[victim]), rng)
        text, _ = json_text(forged, rng)
        raw = text.encode("utf-8", "surrogatepass")
        nodes = dict(self.nodes.nodes)
        renamed = {victim.hex(): chunk_id(raw).hex()}
        nodes[chunk_id(raw)] = raw
        while True:  # parents naming a renamed node are renamed in turn
            fresh = {}
            for node_id in reader.visited:
                body = nodes.get(node_id, b"")
                if node_id.hex() in renamed:
                    continue
                if any(old.encode() in body for old in renamed):
                    for old, new in renamed.items():
                        body = body.replace(old.encode(), new.encode())
                    nodes[chunk_id(body)] = body
                    fresh[node_id.hex()] = chunk_id(body).hex()
            if not fresh:
                break
            renamed.update(fresh)
        top = json.loads(json.dumps(doc))
        top["tree"]["root"] = renamed.get(top["tree"]["root"], top["tree"]["root"])
        doc_raw = json.dumps(top, sort_keys=True, separators=(",", ":")).encode()
        return (zstandard.ZstdCompressor().compress(doc_raw), object_id(doc_raw), _SeedNodes(nodes),
                f"node {victim.hex()[:12]}: {what}")


def _zstd_trick(raw: bytes, rng: random.Random) -> tuple[bytes, str | None, str]:
    trick = rng.choice(("bomb", "two-frames", "skippable", "no-size", "checksum", "empty"))
    if trick == "bomb":  # a frame declaring 4 GiB of zeros after the document
        frame = zstandard.ZstdCompressor().compress(raw + bytes(rng.choice((1 << 20, 64 << 20))))
        return frame, object_id(raw), "the document followed by many zero bytes in one frame"
    if trick == "two-frames":
        c = zstandard.ZstdCompressor()
        return c.compress(raw) + c.compress(raw), object_id(raw), "two frames of the document"
    if trick == "skippable":
        skip = struct.pack("<II", 0x184D2A50, 16) + bytes(16)
        return skip + zstandard.ZstdCompressor().compress(raw), object_id(raw), "a skippable frame first"
    if trick == "no-size":
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
        return frame, object_id(raw), "a frame without a content size"
    if trick == "checksum":
        damaged = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(raw))
        damaged[-1] ^= 1
        return bytes(damaged), object_id(raw), "a frame whose checksum is wrong"
    return zstandard.ZstdCompressor().compress(b""), object_id(b""), "an empty document"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _is_hex_id(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


_TOP = {  # what encode_manifest (benchmarks/oldformats.py) writes, field by field
    "format": lambda v: v == "casckpt.manifest", "version": lambda v: _is_int(v) and v in (1, 2, 3),
    "run": lambda v: isinstance(v, str), "step": _is_int, "parent": lambda v: v is None or isinstance(v, str),
    "created_at": _is_number, "message": lambda v: v is None or isinstance(v, str),
    "metadata": lambda v: isinstance(v, dict),
    "metrics": lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
    "tags": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "root": lambda v: isinstance(v, dict), "blobs": lambda v: isinstance(v, list),
    "tensors": lambda v: isinstance(v, list),
    "world": lambda v: v is None or (isinstance(v, dict) and _is_int(v.get("size"))
                                     and isinstance(v.get("api"), str)),
    "tree": lambda v: isinstance(v, dict) and _is_hex_id(v.get("root")) and _is_int(v.get("n"))
    and _is_int(v.get("b")) and isinstance(v.get("shared"), list),
}
_EXTENT = {"nbytes": _is_int, "chunk_size": _is_int, "phase": _is_int, "packed": lambda v: v is True,
           "chunks": lambda v: isinstance(v, list) and all(_is_hex_id(c) for c in v)}
_TENSOR = {"path": lambda v: isinstance(v, str), "kind": lambda v: isinstance(v, str),
           "dtype": lambda v: isinstance(v, str), "shape": _ints, "blob": _is_int, "offset": _is_int,
           "stride": lambda v: v is None or _ints(v), "global_shape": _ints, "global_offset": _ints,
           "rank": lambda v: v is None or _is_int(v)}
_LEAF: dict[str, Callable[[dict[str, Any]], bool]] = {
         "none": lambda n: True, "bool": lambda n: isinstance(n.get("v"), bool),
         "int": lambda n: _is_int(n.get("v")) or isinstance(n.get("h"), str),
         "float": lambda n: isinstance(n.get("v"), str), "str": lambda n: isinstance(n.get("v"), str),
         "bytes": lambda n: isinstance(n.get("v"), str)}


def _fields(doc: Any, rules: dict[str, Callable[[Any], bool]], what: str) -> str | None:
    if not isinstance(doc, dict):
        return f"{what} is a {type(doc).__name__}"
    for key, value in doc.items():
        if key in rules and not rules[key](value):
            return f"{what} field {key!r} is {value!r:.60}"
    return None


def schema_violation(doc: Any) -> str | None:
    """Where a manifest document departs from what
    :func:`benchmarks.oldformats.encode_manifest` writes (None: nowhere).

    Field types only: a decoder that accepts a departure has coerced or ignored something
    (``"step": 1.5`` read as 1, ``"tags": "ab"`` as two tags, ``{"t": "bool", "v": "false"}``
    as True) and returned a value the bytes do not say.
    """
    found = _fields(doc, _TOP, "manifest")
    if found is not None:
        return found
    tree = doc.get("tree")
    shared = tree.get("shared", ()) if isinstance(tree, dict) else ()
    for i, extent in enumerate([*doc.get("blobs", ()), *shared]):
        found = found or _fields(extent, _EXTENT, f"extent {i}")
    for i, tensor in enumerate(doc.get("tensors", ())):
        found = found or _fields(tensor, _TENSOR, f"tensor {i}")
        if found is None and ("global_shape" in tensor) != ("global_offset" in tensor):
            found = f"tensor {i} has one of global_shape and global_offset"
    if found is not None:
        return found
    stack = [doc.get("root")]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # the decoder's own structure checks refuse these
        kind = node.get("t")
        if isinstance(kind, str) and kind in _LEAF and not _LEAF[kind](node):
            return f"tree node {node!r:.60} holds a value of the wrong type"
        if kind == "dict" and isinstance(node.get("k"), list):
            for key in node["k"]:
                if not (isinstance(key, str) or (isinstance(key, dict) and _is_int(key.get("i")))):
                    return f"tree dict key {key!r:.60} is neither a str nor an int"
        if kind in ("dict", "list", "tuple", "ranks") and isinstance(node.get("v"), list):
            stack.extend(node["v"])
    return None


def use_manifest(m: Manifest, version_id: str) -> None:
    """Everything the engine does with a decoded manifest without reading chunks."""
    _ = m.logical_bytes, sharding(m), _stored_leaves(m)
    list(iter_values(m.root))
    tensor_rows(version_id, m.tensors, m.extents)
    for b in m.extents:
        b.spans()
        b.covering(0, b.nbytes)
    views = [m] if rank_count(m) is None else [rank_view(m, r) for r in range(rank_count(m) or 0)]
    for view in views:
        _materialize(view)


def _materialize(m: Manifest) -> None:
    """Build the state over zero-filled extent buffers, as restore does over filled ones."""
    if sum(b.nbytes for b in m.extents) > _BUFFER_LIMIT:
        decode_state(m.root, lambda i, p: None, lambda i, p: None)
        return
    buffers: dict[int, Any] = {}
    for t in m.tensors:
        nbytes = m.extents[t.extent].nbytes
        buffers.setdefault(t.extent, np.zeros(nbytes, np.uint8) if t.kind == "numpy"
                           else torch.zeros(nbytes, dtype=torch.uint8))

    def tensor(i: int, path: str) -> object:
        entry = m.tensors[i]
        return tensor_from_extent(entry, buffers[entry.extent])

    def sharded(indices: list[int], path: str) -> object:
        return _assemble([m.tensors[i] for i in indices], buffers)

    decode_state(m.root, tensor, sharded)
