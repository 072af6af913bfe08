"""add_version retried after a COMMIT in doubt (catalog.publishing): the retry that finds the
version visible tells by the commit's lease whether its own earlier try published it or
another writer (a concurrent copy) did, and keeps no tree_paths id a rolled-back try interned.

The lost COMMIT is simulated on SQLite: the first write transaction is rolled back (or, for
the try that did land, committed) and then raises CatalogUnavailableError(in_doubt); the
other writer is a second Catalog on the same database, run between the tries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, select

from casckpt.catalog import Catalog, treechanges
from casckpt.catalog import schema as s
from casckpt.catalog.leases import begin_lease
from casckpt.errors import CatalogUnavailableError


class _Rollback(Exception):
    pass


def _row(step: int) -> dict[str, Any]:
    return {"id": f"{step:064x}", "step": step, "parent_id": None, "state": "visible",
            "created_at": 1.0, "committed_at": 1.0, "logical_bytes": 0, "new_bytes": 0,
            "stored_bytes": 0, "duration_s": 0.0, "meta": {}, "metrics": {}, "message": None,
            "manifest": b""}


def _change(path: str) -> treechanges.Change:
    return (path, "float32", "[4]", 16, bytes(32), 16)


def lose_first_commit(catalog: Catalog, *, landed: bool, meanwhile: Callable[[], None]) -> None:
    """The catalog's next write transaction loses its COMMIT's answer: rolled back unless
    ``landed``; ``meanwhile`` runs (another writer) before the retry."""
    real_write = catalog.write

    @contextmanager
    def lost() -> Iterator[Connection]:
        del catalog.write  # the retry writes for real
        try:
            with real_write() as conn:
                yield conn
                if not landed:
                    raise _Rollback
        except _Rollback:
            pass
        meanwhile()
        error = CatalogUnavailableError("connection lost during COMMIT")
        error.in_doubt = True
        raise error

    catalog.write = lost  # type: ignore[method-assign]


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Catalog, Catalog]]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    mine, other = Catalog(url, where="mine"), Catalog(url, where="other")
    yield mine, other
    mine.close()
    other.close()


@pytest.mark.parametrize("landed", [False, True])
def test_an_in_doubt_retry_is_judged_by_the_lease(two: tuple[Catalog, Catalog], landed: bool) -> None:
    mine, other = two
    row = _row(1)
    lease = begin_lease(mine, row["id"])
    # the other copy publishes the same version only if our COMMIT did not land
    def meanwhile() -> None:
        if not landed:
            other.add_version(dict(row), "ft", [], [], [], [])

    lose_first_commit(mine, landed=landed, meanwhile=meanwhile)
    assert mine.add_version(dict(row), "ft", [], [], [], [], lease=lease) is landed
    with mine.read() as conn:
        assert conn.execute(select(s.leases.c.id).where(s.leases.c.id == lease)).first() is None
        assert conn.execute(select(s.versions.c.id)).scalars().all() == [row["id"]]


def test_without_a_lease_an_in_doubt_retry_counts_the_version_its_own(two: tuple[Catalog, Catalog]) -> None:
    mine, _ = two
    lose_first_commit(mine, landed=True, meanwhile=lambda: None)
    assert mine.add_version(_row(1), "ft", [], [], [], []) is True


def test_a_rolled_back_try_keeps_no_path_ids(two: tuple[Catalog, Catalog]) -> None:
    mine, other = two
    first, second = _row(1), _row(2)

    def meanwhile() -> None:  # interns another path first, then publishes the same version
        other.add_version(_row(9), "other", [], [], [], [], tree_changes=[_change("aaa_other")])
        other.add_version(dict(first), "ft", [], [], [], [], tree_changes=[_change("w")])

    lease = begin_lease(mine, first["id"])
    lose_first_commit(mine, landed=False, meanwhile=meanwhile)
    published = mine.add_version(dict(first), "ft", [], [], [], [], lease=lease, tree_changes=[_change("w")])
    assert published is False
    with mine.read() as conn:
        ids = {path: i for i, path in conn.execute(select(s.tree_paths.c.id, s.tree_paths.c.path))}
    assert all(ids[path] == i for path, i in mine.path_ids.items()), (mine.path_ids, ids)
    second["parent_id"] = first["id"]
    mine.add_version(second, "ft", [], [], [], [], tree_changes=[_change("w")])
    with mine.read() as conn:
        recorded = treechanges.recorded(conn, second["id"])
    assert recorded is not None and [r[0] for r in recorded[1]] == ["w"]
