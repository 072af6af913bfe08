"""Every object name casckpt writes on a location, spelled in this one module (no I/O).

A location holds:

    packs/<2 hex>/<pack id>            a whole pack, or one copy of it (``none``, ``replicate``)
    packs/<2 hex>/<pack id>.s<index>   shard ``index`` of an erasure-coded pack (``ec``)
    manifests/<version id>             a version's manifest document
    refs/tags/<name key>               records of the catalog's mutable state
    refs/runs/<name key>                 (see :mod:`casckpt.engine.versions.records`)
    refs/store
    refs/locations
    casckpt-identity                   the identity record (:mod:`casckpt.format.identity`)
    casckpt-keys                       an encrypted store's key record (:mod:`casckpt.format.crypto`)

Tree nodes are chunks inside packs; they have no keys of their own. The
``<2 hex>`` fan-out keeps directories of a local location small.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from casckpt.format.chunks import object_id

PACKS = "packs/"
MANIFESTS = "manifests/"
REFS = "refs/"
TAGS = "refs/tags/"
RUNS = "refs/runs/"
MIRRORS = "refs/mirrors/"
STORE_RECORD = "refs/store"
LOCATIONS_RECORD = "refs/locations"
IDENTITY = "casckpt-identity"
KEYS_RECORD = "casckpt-keys"

_PACK_OBJECT = re.compile(r"^packs/[0-9a-f]{2}/([0-9a-f]{64})$")
_SHARD_OBJECT = re.compile(r"^packs/[0-9a-f]{2}/([0-9a-f]{64})\.s(\d+)$")
_MANIFEST_OBJECT = re.compile(r"^manifests/([0-9a-f]{64})$")
_MAX_HEX_NAME = 200  # a file name holds at most 255 bytes on most local file systems


def pack_name(pack_id: str) -> str:
    """The object name of a whole pack (or a copy of it): ``packs/<first 2 hex>/<id>``."""
    return f"{PACKS}{pack_id[:2]}/{pack_id}"


def shard_name(pack_id: str, index: int) -> str:
    """The object name of shard ``index`` of a pack: ``packs/<2 hex>/<id>.s<index>``."""
    return f"{pack_name(pack_id)}.s{index}"


def pack_of(key: str) -> tuple[str, int | None] | None:
    """``(pack id, shard index or None for a whole copy)`` an object name names, or None."""
    if (m := _PACK_OBJECT.match(key)) is not None:
        return m.group(1), None
    if (m := _SHARD_OBJECT.match(key)) is not None:
        return m.group(1), int(m.group(2))
    return None


def manifest_name(version_id: str) -> str:
    """The object name of a version's manifest: ``manifests/<version id>``."""
    return f"{MANIFESTS}{version_id}"


def version_of(key: str) -> str | None:
    """The version id a manifest name names (None: it names no manifest)."""
    m = _MANIFEST_OBJECT.match(key)
    return m.group(1) if m is not None else None


def ref_name(prefix: str, name: str, hashed: Callable[[bytes], str | None] | None = None) -> str:
    """The record name of a tag, run or mirror name under ``prefix`` (:data:`TAGS`, :data:`RUNS`,
    :data:`MIRRORS`): the name's UTF-8 in hex, or for a name too long for a file name, ``h`` and
    its BLAKE3.
    ``hashed`` (an encrypted store's keyed name hash) names every name by ``k`` and its
    keyed hash instead, so object names reveal no names."""
    keyed = hashed(name.encode("utf-8")) if hashed is not None else None
    if keyed is not None:
        return prefix + "k" + keyed
    encoded = name.encode("utf-8").hex()
    return prefix + (encoded if len(encoded) <= _MAX_HEX_NAME else "h" + object_id(name.encode("utf-8")))
