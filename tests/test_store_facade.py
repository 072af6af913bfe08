"""The shape of the public API: Store's own surface, its namespaces (one module, one declaration
per method), no second name for any call, and a CLI that goes through the public API only."""

from __future__ import annotations

import inspect
import pkgutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import (
    InvalidArgumentError,
    LastKeyError,
    ReadOnlyStoreError,
    RefNotFoundError,
    TierNotFoundError,
)
from casckpt.store import Store
from casckpt.store_history import StoreHistory
from casckpt.store_keys import Keys
from casckpt.store_locations import Locations
from casckpt.store_mirrors import Mirrors
from casckpt.store_ops import Ops
from casckpt.store_read import StoreRead
from casckpt.store_retention import Retention
from casckpt.store_tier import Tier
from casckpt.store_write import StoreWrite

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NAMESPACES = {"locations": Locations, "keys": Keys, "tier": Tier, "retention": Retention, "ops": Ops,
              "mirrors": Mirrors}
GONE = ("wait_durable", "drain", "tier_status", "forget_tier", "tree", "set_retention",
        "clear_retention", "plan_retention", "add_location", "drain_location", "fail_location",
        "activate_location", "redundancy", "set_redundancy", "add_key", "remove_key", "rotate_key",
        "check", "repair", "audit", "drill", "drill_history", "advise", "stats", "report",
        "gc_history", "delta_chain", "set_delta_chain", "rebuild_catalog", "rebuild_cache",
        "migrate_trees")


def _public(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def _declared(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "step": step}


def test_store_holds_at_most_30_public_methods_and_none_of_the_old_names() -> None:
    methods = {n for n in _public(Store) if n not in NAMESPACES and callable(getattr(Store, n))}
    assert len(methods) <= 30, sorted(methods)
    assert {"commit", "restore", "load_tensor", "log", "show", "diff", "lineage", "gc"} <= methods
    assert not set(GONE) & _public(Store), "an old name is still a Store attribute"


def test_every_method_is_declared_once() -> None:
    parts = [_declared(cls) for cls in (Store, StoreWrite, StoreRead, StoreHistory)]
    facade = set().union(*parts)
    assert sum(map(len, parts)) == len(facade), "a method is declared in two of Store's classes"
    for name, cls in NAMESPACES.items():
        assert not _declared(cls) & facade, f"store.{name} repeats a Store method"
        assert cls.__module__ == f"casckpt.store_{name}", cls  # one module per namespace


def test_the_namespaces_work_on_one_store(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s", blobs=[str(tmp_path / "a"), str(tmp_path / "b")]) as store:
        assert isinstance(store.locations, Locations) and isinstance(store.ops, Ops)
        store.commit(_state(1), run="r", step=1)
        store.fork("r@1", "ft")
        assert [(n.name, n.parent_run) for n in store.lineage()] == [("r", None), ("ft", "r")]

        assert [loc.state for loc in store.locations.list()] == ["active", "active"]
        assert store.locations.set_redundancy("replicate:2") == "replicate:2"
        assert store.locations.set_redundancy("none", run="ft") == "none"
        assert (store.locations.redundancy(), store.locations.redundancy("ft")) == ("replicate:2", "none")
        assert store.locations.set_redundancy("inherit", run="ft") == "replicate:2"
        added = store.locations.add(str(tmp_path / "c"), name="c")
        assert (added.name, added.state, added.reachable) == ("c", "active", True)
        assert store.locations.retire("c").state == "retiring"
        assert store.locations.fail("c").state == "failed"
        assert store.locations.activate("c").state == "active"

        policy = store.retention.set("r", keep_last=1)
        assert store.retention.get("r") == policy and store.retention.get("ft") is None
        store.commit(_state(2), run="r", step=2)
        [plan] = store.retention.plan("r")
        assert [(d.version.step, d.keep) for d in plan.decisions] == [(2, True), (1, True)]
        assert any("fork" in reason for reason in plan.decisions[1].reasons)  # ft forks from r@1
        store.retention.clear("r")
        assert store.retention.get("r") is None and store.retention.plan() == []

        store.ops.set_delta_chain(3, run="r")
        chains = store.ops.delta_chain
        assert (chains(), chains("r"), chains("ft")) == (32, 3, 32)  # ft follows the store
        assert store.ops.check(read_data=True).ok and store.ops.stats().versions == 2
        report = store.ops.drill("r", count=1, seed=0)
        assert report.recorded and [r.ok for r in report.results] == [True]
        assert [r.drill_id for r in store.ops.drill_history(run="r")] == [report.drill_id]
        assert {e.action for e in store.ops.audit(action="location")} >= {"location.add"}
        assert store.ops.rebuild_cache() >= 1
        store.gc(grace=0)
        assert len(store.ops.gc_history()) == 1

        with pytest.raises(InvalidArgumentError, match="without a fast tier"):
            store.tier.drain()
        status = store.tier.status()
        assert (status.local_path, status.versions.get("durable"), status.not_durable) == (None, 2, ())
        store.tier.wait_durable()  # nothing waits on a tier: returns at once
        with pytest.raises(TierNotFoundError):
            store.tier.forget("f00d")
        with pytest.raises(RefNotFoundError):
            store.retention.get("nosuchrun")


def test_keys_list_add_rotate_remove(tmp_path: Path) -> None:
    first, second, third = (tmp_path / f"k{i}" for i in range(3))
    ids = [casckpt.generate_key_file(k) for k in (first, second, third)]
    with casckpt.open(tmp_path / "s", key_file=first) as store:
        assert [(k.id, k.in_use) for k in store.keys.list()] == [(ids[0], True)]
        assert store.keys.add(second).id == ids[1]
        assert store.keys.rotate(third, old=ids[1]).id == ids[2]
        assert {k.id for k in store.keys.list()} == {ids[0], ids[2]}
        store.keys.remove(ids[2])
        with pytest.raises(LastKeyError):
            store.keys.remove(ids[0])


def test_a_read_only_store_refuses_each_namespace_write_by_its_name(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        store.commit(_state(1), run="r", step=1)
    with casckpt.open(tmp_path / "s", read_only=True) as store:
        writes = {
            "store.locations.add": lambda: store.locations.add(str(tmp_path / "c")),
            "store.locations.retire": lambda: store.locations.retire("loc0"),
            "store.locations.set_redundancy": lambda: store.locations.set_redundancy("none"),
            "store.retention.set": lambda: store.retention.set("r", keep_last=1),
            "store.retention.clear": lambda: store.retention.clear("r"),
            "store.tier.drain": lambda: store.tier.drain(),
            "store.ops.repair": lambda: store.ops.repair(),
            "store.ops.set_delta_chain": lambda: store.ops.set_delta_chain(2),
            "store.ops.rebuild_cache": lambda: store.ops.rebuild_cache(),
        }
        for name, call in writes.items():
            with pytest.raises(ReadOnlyStoreError, match=f"{name} needs write access"):
                call()
        assert store.ops.check().ok and store.locations.redundancy() == "none"  # reads work


def test_the_cli_contract_forbids_every_module_but_the_public_ones() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"]
                  if c["type"] == "forbidden" and c["source_modules"] == ["casckpt.cli"]]
    public = {"cli", "config", "errors", "retention_rules", "types"}
    modules = {m.name for m in pkgutil.iter_modules(casckpt.__path__)} - public
    assert set(contract["forbidden_modules"]) == {f"casckpt.{m}" for m in modules}
