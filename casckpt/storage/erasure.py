"""Redundancy schemes and the erasure code (pyeclib, ISA-L Reed-Solomon).

A scheme says how a pack is made to survive lost locations:

- ``none``: one copy of the pack.
- ``replicate:N``: N whole copies on N failure domains.
- ``ec:K+M``: K data and M parity shards on K+M failure domains; any K of
  them rebuild the pack.

The code is systematic (data shards hold the pack's bytes unchanged), which
the readers rely on: a healthy pack is read by range from its data shards,
and only a damaged one is decoded.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from casckpt.errors import CorruptPackError, InvalidArgumentError, StorageError
from casckpt.format.shard import ShardHeader, encode_shard_header, payload_checksum

DEFAULT_ALGORITHM = "isa_l_rs_cauchy"  # MDS for every k+m, unlike isa_l_rs_vand
_SPEC = re.compile(r"^(?:(none)|replicate:(\d+)|ec:(\d+)\+(\d+))$")
MAX_SHARDS = 32


@dataclass(frozen=True, slots=True)
class Redundancy:
    """A redundancy scheme: ``kind`` is ``none``, ``replicate`` or ``ec``.

    For ``replicate``, ``k`` is 1 and ``m`` the extra copies; for ``none``,
    ``k`` = 1, ``m`` = 0.
    """

    kind: str
    k: int = 1
    m: int = 0

    @classmethod
    def parse(cls, spec: str) -> Redundancy:
        """Parse ``none``, ``replicate:N`` or ``ec:K+M``.

        Raises:
            InvalidArgumentError: anything else, or sizes out of range.
        """
        match = _SPEC.match(str(spec).strip().lower())
        if match is None:
            raise InvalidArgumentError(
                f"unknown redundancy {spec!r}: use 'none', 'replicate:N' (N >= 2) or "
                "'ec:K+M' (e.g. 'ec:4+2')"
            )
        if match.group(1):
            return cls("none")
        if match.group(2):
            copies = int(match.group(2))
            if not 2 <= copies <= MAX_SHARDS:
                raise InvalidArgumentError(f"replicate:{copies}: N must be 2..{MAX_SHARDS}")
            return cls("replicate", 1, copies - 1)
        k, m = int(match.group(3)), int(match.group(4))
        if k < 1 or m < 1 or k + m > MAX_SHARDS:
            raise InvalidArgumentError(
                f"ec:{k}+{m}: need K >= 1, M >= 1 and K+M <= {MAX_SHARDS}"
            )
        return cls("ec", k, m)

    @property
    def shards(self) -> int:
        """Objects each pack is stored as (copies or shards)."""
        return self.k + self.m

    @property
    def needed(self) -> int:
        """Healthy shards (or copies) a read needs."""
        return self.k

    def default_quorum(self) -> int:
        """Shards that must be durable before a commit may become visible.

        One more than a read needs (so a commit survives losing any one
        location right after it), never more than all of them.
        """
        return min(self.shards, self.needed + 1)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "replicate":
            return f"replicate:{self.shards}"
        return f"ec:{self.k}+{self.m}"


@dataclass(frozen=True, slots=True)
class EncodedShard:
    """One shard object of an erasure-coded pack: ``header + fragment``, and the fragment's
    checksum (the one its header and the catalog record)."""

    index: int
    header: bytes
    fragment: bytes
    checksum: str

    @property
    def size(self) -> int:
        """Bytes of the shard object."""
        return len(self.header) + len(self.fragment)


class ErasureCode:
    """Encode packs into K+M fragments and decode them from any K.

    Thread-safe: pyeclib drivers are kept per thread.
    """

    def __init__(self, k: int, m: int, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self.k, self.m, self.algorithm = k, m, algorithm
        self._local = threading.local()
        self._driver()  # fail early on an unavailable backend

    def _driver(self) -> Any:
        driver = getattr(self._local, "driver", None)
        if driver is None:
            from pyeclib.ec_iface import ECDriver

            try:
                driver = ECDriver(k=self.k, m=self.m, ec_type=self.algorithm)
            except Exception as exc:  # pyeclib raises its own hierarchy (ECDriverError, ...)
                raise InvalidArgumentError(
                    f"erasure code {self.algorithm} {self.k}+{self.m} is unavailable: {exc}"
                ) from exc
            self._local.driver = driver
        return driver

    def encode(self, pack: bytes | memoryview) -> tuple[list[bytes], int, int]:
        """Return (fragments, stripe, data_offset).

        Data fragment ``i`` holds ``pack[i*stripe:(i+1)*stripe]`` from byte
        ``data_offset``; this is checked, not assumed.
        """
        data = pack if isinstance(pack, bytes) else bytes(pack)  # pyeclib takes bytes only
        try:
            fragments: list[bytes] = self._driver().encode(data)
        except Exception as exc:  # pyeclib's ECDriverError family
            raise StorageError(f"erasure encoding with {self.algorithm} failed: {exc}") from exc
        stripe = -(-len(data) // self.k)
        offset = len(fragments[0]) - stripe
        whole = memoryview(data)
        for i in range(self.k):  # startswith compares in place (memcmp), slicing would copy
            if offset < 0 or not fragments[i].startswith(whole[i * stripe : (i + 1) * stripe], offset):
                raise StorageError(
                    f"{self.algorithm} is not laid out systematically; casckpt cannot use it "
                    "(choose another pyeclib release or backend)"
                )
        return fragments, stripe, offset

    def shards(self, pack_id: str, pack: bytes | memoryview, wanted: Collection[int] | None = None,
               ) -> tuple[int, int, Iterator[EncodedShard]]:
        """Encode ``pack`` (whose id is ``pack_id``) into the shard objects it is stored as:
        (stripe, data_offset, the shards ``wanted`` (default all) in index order).

        Every shard object casckpt writes is made here, in this process or in an
        encoding worker (:mod:`casckpt.storage.ecworker`), so both give the same bytes.
        The iterator drops each fragment once its shard is yielded, bounding memory.
        """
        fragments, stripe, offset = self.encode(pack)
        keep = set(range(len(fragments))) if wanted is None else set(wanted)
        pack_len = len(pack)  # the iterator must not keep the pack alive

        def each() -> Iterator[EncodedShard]:
            for index in range(len(fragments)):
                fragment, fragments[index] = fragments[index], b""
                if index in keep:
                    checksum = payload_checksum(fragment)
                    header = encode_shard_header(ShardHeader(
                        pack_id, index, self.k, self.m, self.algorithm, pack_len, len(fragment),
                        offset, checksum))
                    yield EncodedShard(index, header, fragment, checksum)
                del fragment

        return stripe, offset, each()

    def decode(self, fragments: Mapping[int, bytes | memoryview] | Sequence[bytes | memoryview],
               pack_len: int, where: str) -> bytes:
        """Rebuild the pack from at least K fragments (index -> fragment bytes).

        Raises:
            CorruptPackError: too few fragments, or the code rejects them.
        """
        parts = list(fragments.values()) if isinstance(fragments, Mapping) else list(fragments)
        if len(parts) < self.k:
            raise CorruptPackError(f"{where}: {len(parts)} healthy shards, {self.k} needed")
        try:
            data: bytes = self._driver().decode([bytes(p) for p in parts])
        except Exception as exc:  # pyeclib's ECDriverError family
            raise CorruptPackError(f"{where}: shards do not decode ({exc})") from exc
        if len(data) != pack_len:
            raise CorruptPackError(f"{where}: decoded {len(data)} bytes, expected {pack_len}")
        return data

    def reconstruct(self, fragments: Mapping[int, bytes | memoryview], indexes: Sequence[int],
                    where: str) -> dict[int, bytes]:
        """Rebuild the fragments ``indexes`` (byte-identical to what encode made) from >= K others.

        Cheaper than decoding the pack and encoding it again; data fragments
        rebuilt this way also give the pack itself (the code is systematic).

        Raises:
            CorruptPackError: too few fragments, or the code rejects them.
        """
        if len(fragments) < self.k:
            raise CorruptPackError(f"{where}: {len(fragments)} healthy shards, {self.k} needed")
        if not indexes:
            return {}
        try:
            rebuilt: list[bytes] = self._driver().reconstruct(
                [bytes(f) for f in list(fragments.values())[: self.k]], list(indexes))
        except Exception as exc:  # pyeclib's ECDriverError family
            raise CorruptPackError(f"{where}: shards do not reconstruct ({exc})") from exc
        return dict(zip(indexes, rebuilt, strict=True))
