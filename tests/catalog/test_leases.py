"""The lease a save of many ranks names its version on after it began (``leases.name_version``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

import casckpt
from casckpt.catalog import leases
from casckpt.catalog import schema as s
from casckpt.catalog.leases import (
    begin_lease,
    end_lease,
    name_version,
    oldest_lease,
    rank_lease_id,
    save_lease_id,
)
from casckpt.errors import CatalogError
from casckpt.testing.internals import internals

VERSION = "ab" * 32


def test_a_version_named_after_the_lease_began_is_tombstoned_when_the_lease_ends(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        catalog = internals(store).catalog
        lease = begin_lease(catalog)  # as a group save: before the version id is known
        name_version(catalog, lease, VERSION)
        with catalog.read() as conn:
            assert conn.execute(select(s.leases.c.version_id)).scalars().all() == [VERSION]
        end_lease(catalog, lease)  # the save failed: its manifest, if written, is known garbage
        with catalog.read() as conn:
            assert conn.execute(select(s.tombstones.c.version_id)).scalars().all() == [VERSION]


def test_naming_a_version_on_a_lease_gc_reaped_is_refused(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        catalog = internals(store).catalog
        lease = begin_lease(catalog)
        with catalog.write() as conn:  # a save that ran for more than a day
            conn.execute(s.leases.update().values(started_at=0.0))
        assert oldest_lease(catalog, 10 * 24 * 3600.0) is None  # gc reaps it as crashed
        with pytest.raises(CatalogError, match="save this step again"):
            name_version(catalog, lease, VERSION)


@pytest.mark.parametrize("catalog_kind", ["sqlite", "postgres"])
def test_a_version_named_while_gc_reaps_its_lease_is_tombstoned(
        tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        catalog_kind: str) -> None:
    """gc reads the leases, then deletes the crashed ones in another transaction: a save that
    names its version in between (its lease older than a day) goes on to write its manifest,
    so the version gc tombstones is the one on the row it deletes, not the one it read."""
    kwargs = {"catalog": request.getfixturevalue("pg_url")} if catalog_kind == "postgres" else {}
    with casckpt.open(tmp_path / "store", **kwargs) as store:
        catalog = internals(store).catalog
        lease = begin_lease(catalog)
        with catalog.write() as conn:  # a save that ran for more than a day
            conn.execute(s.leases.update().values(started_at=0.0))

        def alive(pid: int) -> bool:  # gc judges the rows it read, between its two transactions
            name_version(catalog, lease, VERSION)
            return True

        monkeypatch.setattr(leases, "_alive", alive)
        assert oldest_lease(catalog, 10 * 24 * 3600.0) is None  # reaped: older than LEASE_TTL
        with catalog.read() as conn:
            assert conn.execute(select(s.tombstones.c.version_id)).scalars().all() == [VERSION]


def test_a_save_ends_its_ranks_leases_and_only_its_own(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        catalog = internals(store).catalog
        save, other = save_lease_id(), save_lease_id()
        for lease in (save, other):
            begin_lease(catalog, lease=lease)
            for rank in (1, 2):
                begin_lease(catalog, lease=rank_lease_id(lease, rank))
        end_lease(catalog, rank_lease_id(save, 2))  # a rank ends its own lease alone
        with catalog.read() as conn:
            assert len(conn.execute(select(s.leases.c.id)).all()) == 5
        end_lease(catalog, save, ranks=True)
        with catalog.read() as conn:
            left = set(conn.execute(select(s.leases.c.id)).scalars())
        assert left == {other, rank_lease_id(other, 1), rank_lease_id(other, 2)}
