"""Blob locations: placement over failure domains, read order, replicated small objects.

The locations here hold in-memory fake blob stores (a URL, a dict, a switch
that makes every call fail), so what each method touched can be asserted.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from casckpt.errors import BlobNotFoundError, OversizedObjectError, StorageError
from casckpt.storage.base import BlobInfo, BlobStore, scatter
from casckpt.storage.locations import Location, LocationSet
from casckpt.storage.unreachable import UnreachableBlobStore


class FakeBlobStore:
    """An in-memory BlobStore that records calls and can be made to fail."""

    def __init__(self, url: str, *, failing: bool = False) -> None:
        self.url = url
        self.failing = failing
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []
        self.closed = False

    def _enter(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        if self.failing:
            raise StorageError(f"{self.url} is down")

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._enter("put", key)
        self.objects[key] = bytes(data)

    def put_file(self, key: str, path: Path) -> None:
        self._enter("put_file", key)
        self.objects[key] = path.read_bytes()

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        self._enter("get", key)
        if key not in self.objects:
            raise BlobNotFoundError(f"{key} not in {self.url}")
        if max_size is not None and len(self.objects[key]) > max_size:
            raise OversizedObjectError(f"{key} is larger than {max_size}")
        return self.objects[key]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.get(key)[offset : offset + length]

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        return scatter(self.get(key)[offset:], buffers)

    def size(self, key: str) -> int | None:
        self._enter("size", key)
        data = self.objects.get(key)
        return None if data is None else len(data)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        self._enter("list", prefix)
        for key in sorted(self.objects):
            if key.startswith(prefix):
                yield BlobInfo(key, len(self.objects[key]), time.time())

    def delete(self, key: str) -> None:
        self._enter("delete", key)
        self.objects.pop(key, None)

    def close(self) -> None:
        self.closed = True


def _loc(id_: int, domain: str, state: str = "active", url: str | None = None, *,
         failing: bool = False) -> Location:
    blobs = FakeBlobStore(url or f"file:///blobs/{id_}", failing=failing)
    return Location(id_, f"loc{id_}", domain, state, blobs)


def _fake(loc: Location) -> FakeBlobStore:
    assert isinstance(loc.blobs, FakeBlobStore)
    return loc.blobs


def _pack_ids(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.randbytes(32).hex() for _ in range(n)]


def test_fake_is_a_blob_store() -> None:
    assert isinstance(FakeBlobStore("file:///x"), BlobStore)
    assert isinstance(UnreachableBlobStore("file:///x", "gone"), BlobStore)


# -- placement -----------------------------------------------------------------------


def test_a_store_needs_a_location() -> None:
    with pytest.raises(ValueError):
        LocationSet([])


def test_placement_is_one_location_per_domain() -> None:
    locations = LocationSet([_loc(i, f"d{i % 4}") for i in range(1, 9)])  # 4 domains x 2
    assert locations.domains() == ["d0", "d1", "d2", "d3"]
    for pack_id in _pack_ids(200):
        placed = locations.placement(pack_id)
        assert len(placed) == 4
        assert sorted(loc.domain for loc in placed) == ["d0", "d1", "d2", "d3"]


def test_placement_rotates_the_domains_in_order() -> None:
    locations = LocationSet([_loc(i, f"d{i}") for i in range(5)])
    for pack_id in _pack_ids(50):
        domains = [loc.domain for loc in locations.placement(pack_id)]
        start = int(domains[0][1:])
        assert domains == [f"d{(start + i) % 5}" for i in range(5)]
        assert start == int(pack_id[:8], 16) % 5


def test_placement_uses_only_active_locations() -> None:
    locations = LocationSet([
        _loc(1, "a"), _loc(2, "a", "retiring"),
        _loc(3, "b", "failed"), _loc(4, "b"),
        _loc(5, "c", "retiring"),  # a domain with no active location is no domain to place on
        _loc(6, "d", "failed"),
        _loc(7, "e"),
    ])
    assert [loc.id for loc in locations.active()] == [1, 4, 7]
    assert locations.domains() == ["a", "b", "e"]
    seen: set[int] = set()
    for pack_id in _pack_ids(300):
        placed = locations.placement(pack_id)
        assert all(loc.state == "active" for loc in placed)
        assert sorted(loc.domain for loc in placed) == ["a", "b", "e"]
        seen.update(loc.id for loc in placed)
    assert seen == {1, 4, 7}


def test_placement_with_nothing_active_is_empty() -> None:
    locations = LocationSet([_loc(1, "a", "failed"), _loc(2, "b", "retiring")])
    assert locations.domains() == []
    assert locations.active() == []
    assert locations.placement("ab" * 32) == []


def test_placement_is_deterministic_per_pack_id() -> None:
    def build(order: Sequence[int]) -> LocationSet:
        return LocationSet([_loc(i, f"d{i % 3}") for i in order])

    one, again = build(range(9)), build(range(9))
    shuffled = build(random.Random(1).sample(range(9), 9))
    for pack_id in _pack_ids(200):
        ids = [loc.id for loc in one.placement(pack_id)]
        assert ids == [loc.id for loc in one.placement(pack_id)]
        assert ids == [loc.id for loc in again.placement(pack_id)]  # another process, same catalog
        # the domain order depends on the pack id alone, not on the order locations are listed in
        assert [loc.domain for loc in shuffled.placement(pack_id)] == [
            loc.domain for loc in one.placement(pack_id)]


def test_first_shard_spreads_evenly_over_domains() -> None:
    domains = 6
    locations = LocationSet([_loc(i, f"d{i}") for i in range(domains)])
    ids = _pack_ids(6000, seed=42)
    fair = len(ids) / domains
    for position in range(domains):  # every shard index, not just the first
        counts = Counter(locations.placement(pack_id)[position].domain for pack_id in ids)
        assert set(counts) == {f"d{i}" for i in range(domains)}
        for domain, count in counts.items():
            assert 0.5 * fair <= count <= 1.5 * fair, (position, domain, count)


def test_domains_with_several_locations_use_them_all() -> None:
    # domain "big" has three disks, "small" one
    locations = LocationSet([_loc(1, "big"), _loc(2, "big"), _loc(3, "small"), _loc(4, "big")])
    ids = _pack_ids(3000, seed=7)
    counts = Counter(loc.id for pack_id in ids for loc in locations.placement(pack_id)
                     if loc.domain == "big")
    assert set(counts) == {1, 2, 4}
    fair = len(ids) / 3
    assert all(0.5 * fair <= n <= 1.5 * fair for n in counts.values()), counts
    assert all(locations.placement(pack_id)[0].domain in {"big", "small"} for pack_id in ids)


def test_get_finds_locations_by_id() -> None:
    locations = LocationSet([_loc(3, "a"), _loc(9, "b", "failed")])
    assert locations.get(9) is locations.all[1]
    assert locations.get(3) is locations.all[0]
    assert locations.get(4) is None


# -- read order ----------------------------------------------------------------------


def test_read_order_is_local_first_then_by_id_and_skips_failed() -> None:
    locations = LocationSet([
        _loc(1, "cloud", url="s3://bucket/a"),
        _loc(2, "disk1", url="file:///mnt/one"),
        _loc(3, "cloud2", "retiring", url="s3://other/b"),
        _loc(4, "disk2", "retiring", url="file:///mnt/two"),
        _loc(5, "disk3", "failed", url="file:///mnt/three"),
        _loc(6, "cloud3", "failed", url="s3://third/c"),
    ])
    assert [loc.id for loc in locations.read_order()] == [2, 4, 1, 3]
    assert [loc.remote for loc in locations.all] == [True, False, True, False, False, True]
    assert [loc.readable for loc in locations.all] == [True, True, True, True, False, False]


def test_describe_redacts_credentials() -> None:
    loc = Location(1, "cloud", "cloud", "active",
                   FakeBlobStore("s3://AKIAFAKE:fakesecret@bucket/prefix"))
    assert loc.describe() == "cloud (s3://***@bucket/prefix)"
    assert "fakesecret" not in loc.describe()


# -- small replicated objects ------------------------------------------------------


def test_put_everywhere_writes_every_active_location() -> None:
    locations = LocationSet([_loc(1, "a"), _loc(2, "b"), _loc(3, "c", "retiring"),
                             _loc(4, "d", "failed")])
    assert locations.put_everywhere("manifests/x", b"doc") == 2
    assert [_fake(loc).objects for loc in locations.all] == [
        {"manifests/x": b"doc"}, {"manifests/x": b"doc"}, {}, {}]
    assert _fake(locations.all[3]).calls == []  # a failed location is never touched


def test_put_everywhere_succeeds_when_one_location_fails(caplog: pytest.LogCaptureFixture) -> None:
    gone = Location(3, "gone", "c", "active", UnreachableBlobStore("file:///x", "unplugged"))
    locations = LocationSet([_loc(1, "a", failing=True), _loc(2, "b"), gone])
    with caplog.at_level(logging.WARNING, logger="casckpt.storage.locations"):
        assert locations.put_everywhere("refs/r", b"1") == 1
    assert _fake(locations.all[1]).objects == {"refs/r": b"1"}
    assert "refs/r" in caplog.text and "loc1" in caplog.text and "unplugged" in caplog.text


def test_put_everywhere_raises_when_every_location_fails() -> None:
    locations = LocationSet([_loc(1, "a", failing=True), _loc(2, "b", failing=True)])
    with pytest.raises(StorageError, match="no blob location accepted manifests/x") as info:
        locations.put_everywhere("manifests/x", b"doc")
    assert isinstance(info.value.__cause__, StorageError)
    assert [_fake(loc).calls for loc in locations.all] == [[("put", "manifests/x")]] * 2


def test_put_everywhere_with_no_active_location_raises() -> None:
    locations = LocationSet([_loc(1, "a", "retiring")])
    with pytest.raises(StorageError):
        locations.put_everywhere("manifests/x", b"doc")
    assert _fake(locations.all[0]).objects == {}


def test_exists_anywhere() -> None:
    down, holder, failed = _loc(1, "a", failing=True), _loc(2, "b"), _loc(3, "c", "failed")
    _fake(holder).objects["manifests/y"] = b"y"
    _fake(failed).objects["manifests/z"] = b"z"
    locations = LocationSet([down, holder, failed])
    assert locations.exists_anywhere("manifests/y")
    assert not locations.exists_anywhere("manifests/z")  # only on a failed location
    assert not locations.exists_anywhere("manifests/nope")


def test_delete_skips_failed_locations_and_survives_errors(caplog: pytest.LogCaptureFixture) -> None:
    active, retiring, down, failed = _loc(1, "a"), _loc(2, "b", "retiring"), _loc(3, "c", failing=True), \
        _loc(4, "d", "failed")
    for loc in (active, retiring, failed):
        _fake(loc).objects["manifests/x"] = b"x"
    locations = LocationSet([active, retiring, down, failed])
    with caplog.at_level(logging.WARNING, logger="casckpt.storage.locations"):
        done = locations.delete([(loc.id, "manifests/x") for loc in locations.all])  # does not raise
    assert done == [(1, "manifests/x"), (2, "manifests/x")]
    assert _fake(active).objects == {} and _fake(retiring).objects == {}
    assert _fake(failed).objects == {"manifests/x": b"x"} and _fake(failed).calls == []
    assert _fake(down).calls == [("delete", "manifests/x")]
    assert "manifests/x" in caplog.text


def test_list_all_lists_every_readable_location() -> None:
    a, b, failed = _loc(1, "a"), _loc(2, "b", "retiring"), _loc(3, "c", "failed")
    _fake(a).objects.update({"packs/aa/1": b"1", "manifests/m": b"m"})
    _fake(b).objects.update({"packs/aa/1": b"1", "packs/bb/2": b"22"})
    _fake(failed).objects.update({"packs/cc/3": b"3"})
    locations = LocationSet([a, b, failed])
    got = sorted((loc.id, info.key, info.size) for loc, info in locations.list_all("packs/"))
    assert got == [(1, "packs/aa/1", 1), (2, "packs/aa/1", 1), (2, "packs/bb/2", 2)]


def test_list_all_raises_when_a_location_cannot_be_listed() -> None:
    """Callers delete on the strength of a listing (GC): a partial one must not pass as whole."""
    locations = LocationSet([_loc(1, "a"), _loc(2, "b", failing=True)])
    _fake(locations.all[0]).objects["packs/aa/1"] = b"1"
    with pytest.raises(StorageError):
        list(locations.list_all("packs/"))


def test_close_closes_every_location() -> None:
    locations = LocationSet([_loc(1, "a"), _loc(2, "b", "failed")])
    locations.close()
    assert all(_fake(loc).closed for loc in locations.all)


# -- unreachable locations -------------------------------------------------------------


def test_unreachable_blob_store_refuses_everything(tmp_path: Path) -> None:
    store = UnreachableBlobStore("s3://bucket/prefix", "no credentials for this bucket")
    staged = tmp_path / "f"
    staged.write_bytes(b"x")
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: store.put("packs/aa/1", b"x"),
        "put_file": lambda: store.put_file("packs/aa/1", staged),
        "get": lambda: store.get("packs/aa/1"),
        "get_range": lambda: store.get_range("packs/aa/1", 0, 1),
        "read_into": lambda: store.read_into("packs/aa/1", 0, [memoryview(bytearray(1))]),
        "size": lambda: store.size("packs/aa/1"),
        "list": lambda: list(store.list("packs/")),
        "list_all_keys": lambda: list(store.list()),
        "delete": lambda: store.delete("packs/aa/1"),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, BlobNotFoundError), name  # unreachable, not missing
        assert "s3://bucket/prefix" in str(info.value) and "no credentials" in str(info.value), name
    assert staged.read_bytes() == b"x"  # the staged file is left alone
    store.close()  # closing releases nothing and does not raise


def test_unreachable_location_keeps_its_url_and_state() -> None:
    loc = Location(1, "usb", "usb", "active", UnreachableBlobStore("file:///media/usb", "not mounted"))
    assert not loc.remote and loc.readable
    assert loc.describe() == "usb (file:///media/usb)"
