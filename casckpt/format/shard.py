"""The shard format: one erasure-coded fragment of a pack, self-describing.

Byte format (all integers little-endian)::

    header   SHARD_HEADER_SIZE (128) bytes, CRC32-protected:
             b"CKSHRD01", pack id (32), shard index, k, m (u16 each),
             algorithm (16 bytes ASCII, zero padded), pack length (u64),
             payload length (u64), data offset (u32), payload BLAKE3 (32),
             CRC32 of the preceding bytes
    payload  the erasure code's fragment (its own small header, then the
             fragment bytes)

The code is systematic: data shard ``i`` (``i < k``) holds pack bytes
``[i * stripe, (i + 1) * stripe)`` at payload offset ``data_offset``, so a
ranged read of a healthy pack reads data shards directly, without decoding.
Because the header names its pack, index and scheme, the catalog's shard
records can be rebuilt from the objects alone.

This module reads and writes bytes; it knows nothing of where shards live.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from blake3 import blake3

from casckpt.errors import CorruptPackError

SHARD_MAGIC = b"CKSHRD01"
_HEAD = struct.Struct("<8s32sHHH16sQQI32s")
SHARD_HEADER_SIZE = 128
_PAD = SHARD_HEADER_SIZE - _HEAD.size - 4


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """What a shard object says about itself."""

    pack_id: str
    index: int
    k: int
    m: int
    algorithm: str
    pack_len: int
    payload_len: int
    data_offset: int
    checksum: str

    @property
    def stripe(self) -> int:
        """Pack bytes each data shard carries (the last may be zero-padded)."""
        return -(-self.pack_len // self.k)


def payload_checksum(payload: bytes | memoryview) -> str:
    """The BLAKE3 (hex) of a shard payload, as recorded in the header and the catalog."""
    return blake3(payload, max_threads=blake3.AUTO).hexdigest()


def payload_hasher() -> blake3:
    """A streaming hasher giving :func:`payload_checksum` of what it is fed."""
    return blake3(max_threads=blake3.AUTO)


def encode_shard_header(header: ShardHeader) -> bytes:
    """Return the fixed-size header written before a shard payload.

    Raises:
        ValueError: a field the format cannot hold, or one :func:`decode_shard_header` would refuse.
    """
    algorithm = header.algorithm.encode("ascii")
    if len(algorithm) > 16:
        raise ValueError(f"algorithm name {header.algorithm!r} is longer than 16 bytes")
    pack_id, checksum = bytes.fromhex(header.pack_id), bytes.fromhex(header.checksum)
    if len(pack_id) != 32 or len(checksum) != 32:  # struct would pad or cut them silently
        raise ValueError("shard pack id and checksum must be 32 bytes (64 hex digits)")
    if not 0 < header.k or header.index >= header.k + header.m or header.data_offset > header.payload_len:
        raise ValueError(f"inconsistent shard header {header!r}")  # decode would refuse it
    head = _HEAD.pack(
        SHARD_MAGIC, pack_id, header.index, header.k, header.m,
        algorithm.ljust(16, b"\0"), header.pack_len, header.payload_len, header.data_offset,
        checksum,
    ) + bytes(_PAD)
    return head + struct.pack("<I", zlib.crc32(head))


def decode_shard_header(data: bytes | memoryview, where: str) -> ShardHeader:
    """Parse and check a shard header.

    Raises:
        CorruptPackError: the bytes are not a shard header, or fail their CRC.
    """
    raw = bytes(data[:SHARD_HEADER_SIZE])
    if len(raw) < SHARD_HEADER_SIZE or raw[:8] != SHARD_MAGIC:
        raise CorruptPackError(f"{where} is not a casckpt shard (bad magic or truncated header)")
    (crc,) = struct.unpack_from("<I", raw, SHARD_HEADER_SIZE - 4)
    if zlib.crc32(raw[: SHARD_HEADER_SIZE - 4]) != crc:
        raise CorruptPackError(f"{where}: shard header fails its CRC (damaged); run `casckpt repair`")
    _, pack_id, index, k, m, algorithm, pack_len, payload_len, data_offset, checksum = (
        _HEAD.unpack_from(raw)
    )
    if not 0 < k or index >= k + m or data_offset > payload_len:
        raise CorruptPackError(f"{where}: shard header is inconsistent (index {index} of {k}+{m})")
    return ShardHeader(pack_id.hex(), index, k, m, algorithm.rstrip(b"\0").decode("ascii", "replace"),
                       pack_len, payload_len, data_offset, checksum.hex())
