"""Bugs the campaign finds in code whose owners are fixing it now.

Keyed by ``target/kind`` (a class of mutation). ``cases`` are case indices
(campaign seed 1; case ``i`` of a kind is case ``i`` of a random run that drew
that kind) reproducing each cause found today: ``tests/test_fuzz.py`` replays
them under ``xfail(strict=True)``, so once every cause of a class is fixed the
test passes, the suite fails, and the lead removes the entry here -- from
then on the class is fuzzed in CI like every other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownOpen:
    owner: str
    what: str
    cases: tuple[int, ...]


_CONFIG = "errors (config.py)"
_HOSTILE = "hostile files (storage/local.py)"
_LEAD_9 = "lead (invariant 9: manifests bound to refs)"
_CATALOG = "outage (catalog rows -> values)"

KNOWN_OPEN: dict[str, KnownOpen] = {
    "config/bytes": KnownOpen(
        _CONFIG, "invalid UTF-8 in casckpt.toml: UnicodeDecodeError from read_config_file", (2,)),
    "config/deep": KnownOpen(
        _CONFIG, "deeply nested arrays or tables: RecursionError from tomllib in read_config_file", (4,)),
    "config/types": KnownOpen(
        _CONFIG, "a key of the wrong type (s3 = 1, locations = 1, store = 1, cache = 1): TypeError in "
        "_spec_from_file / blob_locations, AttributeError", (46, 163)),
    "records/json": KnownOpen(
        "lead (records.py, rebuild.py)", "a deeply nested record: RecursionError in read_records; values of "
        "the wrong type: TypeError/ValueError/OverflowError in _restore_tags (float(at)), _restore_runs "
        "(float(created_at)), restore_run (an int past 64 bits), Store.runs (_utc(inf))",
        (32, 189, 28, 351, 31, 123)),
    "records/new-record": KnownOpen(
        "lead (records.py, rebuild.py)", "as records/json, and a deeply nested refs/store: RecursionError "
        "in read_store_record", (100, 184, 550, 602)),
    "records/fifo": KnownOpen(_HOSTILE, "a refs record replaced by a FIFO: rebuild hangs", (0,)),
    "records/special-file": KnownOpen(
        _HOSTILE, "a refs record replaced by a symlink to /dev/zero: MemoryError in LocalBlobStore.get",
        (2,)),
    "objects/fifo": KnownOpen(_HOSTILE, "a pack replaced by a FIFO: restore hangs", (0,)),
    "objects/special-file": KnownOpen(
        _HOSTILE, "a pack replaced by a symlink to /dev/zero: MemoryError in LocalBlobStore.get", (3,)),
    "ec-objects/fifo": KnownOpen(_HOSTILE, "a shard replaced by a FIFO: restore hangs", (0,)),
    "ec-objects/special-file": KnownOpen(
        _HOSTILE, "a shard replaced by a symlink to /dev/zero: MemoryError in LocalBlobStore.get", (1,)),
    "catalog/versions.step-swap": KnownOpen(
        _LEAD_9, "steps of two versions swapped: restore('a@1') returns a@2's state", (0, 192)),
    "catalog/versions.step": KnownOpen(
        _LEAD_9, "a version's step changed (2 -> 10): restore('a@10') returns a@2's state", (208,)),
    "catalog/versions.run_id": KnownOpen(
        _LEAD_9, "a version moved to another run: restore('b@1') returns a@1's state", (228,)),
    "catalog/versions.manifest": KnownOpen(
        _CATALOG + " (catalog/catalog.py)", "versions.manifest holding text: TypeError in Catalog.manifest",
        (78,)),
    "catalog/packs.size": KnownOpen(
        _CATALOG + " (catalog/shards.py)", "packs.size of another type: ValueError in _layout", (5,)),
    "catalog/ec-packs.layout": KnownOpen(
        _CATALOG + " (catalog/shards.py) + hostile files (packstore.py, packverify.py)", "packs size, "
        "data_offset, k of another type: ValueError in _layout, TypeError in _read_striped and examine",
        (463, 692, 808)),
    "catalog/shards.size": KnownOpen(
        _CATALOG + " (catalog/shards.py)", "shards.size of another type: ValueError in layouts", (49,)),
    "catalog/shards.idx": KnownOpen(
        _CATALOG + " (catalog/shards.py) + hostile files (storage/erasure.py, packrepair.py)",
        "shards.idx of another type: TypeError in _layout; a negative idx reaches pyeclib's reconstruct "
        "and segfaults the process; idx -2**63: KeyError in packrepair._rewrite_leased", (1, 371, 395)),
    "catalog/shards.key": KnownOpen(
        _CATALOG + " + hostile files (storage/base.py)", "shards.key of another type: TypeError in check_key",
        (114,)),
    "catalog/chunks.base_id": KnownOpen(
        "lead (engine/check.py)", "chunks.base_id holding a blob: TypeError in check._check_bases (the "
        "reader refuses it: tests/test_reader.py)", (992,)),
    "catalog/contents.chunk_ids": KnownOpen(
        _CATALOG + " (engine/history.py)", "contents.chunk_ids holding text: TypeError in history._differing",
        (332,)),
    "catalog/tensors.row": KnownOpen(
        "lead (store.py) + " + _CATALOG + " (engine/history.py)", "tensors.shape of another type: TypeError "
        "in Store.show and in history", (894, 3)),
}


def known_open(target: str, kind: str) -> str | None:
    """Who is fixing bugs of this class, and what they are (None when the class is not known open)."""
    entry = KNOWN_OPEN.get(f"{target}/{kind}")
    return None if entry is None else f"{entry.owner}: {entry.what}"
