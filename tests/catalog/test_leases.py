"""The lease a save of many ranks names its version on after it began (``leases.name_version``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

import casckpt
from casckpt.catalog import schema as s
from casckpt.catalog.leases import begin_lease, end_lease, name_version, oldest_lease
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
