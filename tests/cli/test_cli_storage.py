"""Storage administration from the command line: locations, redundancy, repair, check, rebuilds.

Each test builds a six-location ``ec:4+2`` store with ``casckpt init
--location ... --redundancy ec:4+2`` (one failure domain per directory), fills
it through the Python API with small packs (so there are many), then drives
the CLI through typer's CliRunner.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.catalog import inventory
from casckpt.cli import storage as storage_cli
from casckpt.cli.main import app, parse_locations
from casckpt.config import BlobLocation
from casckpt.testing.internals import internals

RUN = "ec-run"
DOMAINS = [f"d{i}" for i in range(6)]
STEPS = (1, 2, 3)


@dataclass(frozen=True)
class EcStore:
    root: Path
    dirs: list[Path]
    states: dict[int, dict[str, Any]]

    def dir_of(self, name: str) -> Path:
        return self.dirs[int(name.removeprefix("loc"))]


def cli(store: Path | None, *args: str) -> Result:
    prefix = ["--store", str(store)] if store is not None else []
    return CliRunner().invoke(app, [*prefix, *args])


def ok_json(store: Path, *args: str) -> Any:
    result = cli(store, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def state_for(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40_000, generator=gen), "b": torch.randn(3_000, generator=gen), "step": step}


def _init_args(root: Path, dirs: list[Path]) -> list[str]:
    args = ["init", str(root), "--redundancy", "ec:4+2"]
    for domain, d in zip(DOMAINS, dirs, strict=True):
        args += ["--location", f"{domain}={d}"]
    return args


def _ec_store(top: Path) -> EcStore:
    root = top / "store"
    dirs = [top / f"disk{i}" for i in range(6)]
    created = cli(None, *_init_args(root, dirs))
    assert created.exit_code == 0, created.output
    assert "Created" in created.stdout and "ec:4+2" in created.stdout
    states = {step: state_for(step) for step in STEPS}
    with casckpt.open(root, create=False, pack_size=64 << 10, chunk_size=16 << 10) as store:
        for step, state in states.items():
            store.commit(state, run=RUN, step=step)
    return EcStore(root, dirs, states)


@pytest.fixture
def ec_store(tmp_path: Path) -> EcStore:
    """A store of its own for a test that changes it."""
    return _ec_store(tmp_path)


@pytest.fixture(scope="module")
def shared_ec_store(tmp_path_factory: pytest.TempPathFactory) -> EcStore:
    """One store for the tests that only read it or are refused before changing it."""
    return _ec_store(tmp_path_factory.mktemp("shared-ec"))


def _packs(store: EcStore) -> int:
    return int(ok_json(store.root, "stats")["packs"])


def _assert_restores_bit_exact(store: EcStore) -> None:
    with casckpt.open(store.root, create=False) as s:
        for step, state in store.states.items():
            tree = s.restore(f"{RUN}@{step}", map_location="cpu")
            assert torch.equal(tree["w"], state["w"]) and torch.equal(tree["b"], state["b"])
            assert tree["step"] == step


def _by_name(store: EcStore) -> dict[str, dict[str, Any]]:
    return {loc["name"]: loc for loc in ok_json(store.root, "location", "list")}


# -- init and location list ------------------------------------------------------


def test_init_records_six_locations_in_their_domains(shared_ec_store: EcStore) -> None:
    config = (shared_ec_store.root / "casckpt.toml").read_text()
    assert config.count("[[locations]]") == 6 and 'redundancy = "ec:4+2"' in config
    locations = ok_json(shared_ec_store.root, "location", "list")
    assert [loc["name"] for loc in locations] == [f"loc{i}" for i in range(6)]
    assert [loc["domain"] for loc in locations] == DOMAINS
    assert all(loc["state"] == "active" and loc["reachable"] and loc["damaged"] == 0 for loc in locations)
    packs = _packs(shared_ec_store)
    assert packs >= 4
    # ec:4+2 puts one shard of every pack on each of the six domains
    assert [loc["shards"] for loc in locations] == [packs] * 6
    assert all(loc["bytes"] > 0 for loc in locations)
    assert locations[3]["url"] == shared_ec_store.dirs[3].resolve().as_uri()


def test_location_list_table(shared_ec_store: EcStore) -> None:
    result = cli(shared_ec_store.root, "location", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(column in lines[0] for column in ("NAME", "DOMAIN", "STATE", "URL", "SHARDS", "SIZE",
                                                  "DAMAGED", "REACHABLE"))
    row = next(line for line in lines if line.startswith("loc4 "))
    assert "d4" in row and "active" in row and "KiB" in row and row.rstrip().endswith("yes")
    assert str(shared_ec_store.dirs[4].resolve()) in row


def test_init_refuses_too_few_domains_before_creating_anything(tmp_path: Path) -> None:
    root = tmp_path / "store"
    args = ["init", str(root), "--redundancy", "ec:4+2"]
    for i in range(3):
        args += ["--location", f"same={tmp_path / f'disk{i}'}"]  # three disks, one domain
    result = cli(None, *args)
    assert result.exit_code == 2, result.output
    assert "failure domains" in result.stderr and "DOMAIN=URL" in result.stderr
    assert not root.exists()
    both = cli(None, "init", str(root), "--blobs", str(tmp_path / "b"), "--location", str(tmp_path / "c"))
    assert both.exit_code == 2 and "--blobs" in both.stderr
    bad = cli(None, "init", str(root), "--redundancy", "raid5")
    assert bad.exit_code == 2 and "ec:K+M" in bad.stderr and not root.exists()


def test_init_single_location_without_domain_still_works(tmp_path: Path) -> None:
    root, blobs = tmp_path / "store", tmp_path / "blobs"
    result = cli(None, "init", str(root), "--location", str(blobs))
    assert result.exit_code == 0, result.output
    [loc] = ok_json(root, "location", "list")
    assert (loc["name"], loc["domain"]) == ("loc0", "loc0")
    assert ok_json(root, "redundancy", "show")["redundancy"] == "none"


def test_parse_locations_domain_prefix() -> None:
    assert parse_locations(["d0=/mnt/a", "/mnt/b=c", "s3://bucket/p", "eu-1=s3://bucket/q", "./x=y"]) == [
        BlobLocation("/mnt/a", "d0"),
        BlobLocation("/mnt/b=c"),
        BlobLocation("s3://bucket/p"),
        BlobLocation("s3://bucket/q", "eu-1"),
        BlobLocation("./x=y"),
    ]
    with pytest.raises(casckpt.CasckptError):
        parse_locations(["d0="])


# -- fail, repair, check ------------------------------------------------------------


def test_fail_a_lost_location_then_repair(ec_store: EcStore) -> None:
    packs = _packs(ec_store)
    shutil.rmtree(ec_store.dir_of("loc2"))
    lost = cli(ec_store.root, "check")
    assert lost.exit_code == 1, lost.output  # loc2's shards are gone

    failed = ok_json(ec_store.root, "location", "fail", "loc2")
    assert (failed["name"], failed["state"], failed["shards"]) == ("loc2", "failed", packs)
    table = cli(ec_store.root, "location", "fail", "loc2")
    assert table.exit_code == 0 and "failed" in table.stdout and "casckpt repair" in table.stderr

    # five domains left for six shards: repair re-creates loc2's shards, doubled up, and says so
    short = cli(ec_store.root, "repair", "--json")
    assert short.exit_code == 1, short.output
    repaired = json.loads(short.stdout)
    assert repaired["packs"] == packs
    assert repaired["shards_rewritten"] == packs == repaired["shards_moved"]
    assert repaired["unrepaired"] == [] and repaired["ok"] is False
    assert len(repaired["degraded"]) == packs
    degraded = cli(ec_store.root, "check")
    assert degraded.exit_code == 1 and "share failure domain" in degraded.stdout + degraded.stderr
    locations = _by_name(ec_store)
    assert locations["loc2"]["shards"] == 0
    assert sum(loc["shards"] for loc in locations.values()) == 6 * packs

    ec_store.dirs.append(ec_store.root.parent / "disk6")  # a new disk in a new domain
    ok_json(ec_store.root, "location", "add", str(ec_store.dirs[-1]), "--domain", "d6")
    spread = ok_json(ec_store.root, "repair")
    assert spread["ok"] is True and spread["degraded"] == [] and spread["shards_moved"] == packs
    assert _by_name(ec_store)["loc6"]["shards"] == packs

    clean = ok_json(ec_store.root, "check", "--read-data")
    assert clean["ok"] is True and clean["problems"] == []
    assert clean["packs_read"] == packs and clean["chunks_read"] == clean["chunks"] > 0
    _assert_restores_bit_exact(ec_store)

    again = cli(ec_store.root, "repair")
    assert again.exit_code == 0, again.output
    assert "nothing to repair" in again.stdout


def test_repair_table_and_progress(ec_store: EcStore, monkeypatch: pytest.MonkeyPatch) -> None:
    phases: list[tuple[str, int, int]] = []

    @contextmanager
    def recording() -> Iterator[Any]:
        yield lambda phase, done, total: phases.append((phase, done, total))

    monkeypatch.setattr(storage_cli, "progress_bars", recording)
    ok_json(ec_store.root, "location", "add", str(ec_store.root.parent / "disk6"), "--domain", "d6")
    ok_json(ec_store.root, "location", "retire", "loc0")
    result = cli(ec_store.root, "repair")
    assert result.exit_code == 0, result.output
    packs = _packs(ec_store)
    assert "shards moved to another location" in result.stdout
    assert "every pack is back at full redundancy" in result.stdout
    assert phases and phases[-1] == ("repair", packs, packs)


def test_repair_exits_1_when_too_many_domains_are_lost(ec_store: EcStore) -> None:
    for name in ("loc0", "loc1", "loc2"):  # three of six: ec:4+2 survives only two
        shutil.rmtree(ec_store.dir_of(name))
        ok_json(ec_store.root, "location", "fail", name)
    result = cli(ec_store.root, "repair", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and len(report["unrepaired"]) == report["packs"] == _packs(ec_store)
    table = cli(ec_store.root, "repair")
    assert table.exit_code == 1 and "unrepaired packs" in table.stdout


def test_check_read_data_subset(shared_ec_store: EcStore) -> None:
    packs = _packs(shared_ec_store)
    half = ok_json(shared_ec_store.root, "check", "--read-data-subset", "50%")
    assert half["ok"] is True
    assert 0 < half["packs_read"] < packs
    assert 0 < half["chunks_read"] < half["chunks"]
    table = cli(shared_ec_store.root, "check", "--read-data-subset", "0.5")
    assert table.exit_code == 0, table.output
    assert "no problems found" in table.stdout and "packs," in table.stdout.split("; read ")[1]
    everything = ok_json(shared_ec_store.root, "check", "--read-data-subset", "100%")
    assert everything["packs_read"] == packs


def test_check_read_data_subset_bad_input(shared_ec_store: EcStore) -> None:
    both = cli(shared_ec_store.root, "check", "--read-data", "--read-data-subset", "5%")
    assert both.exit_code == 2 and "--read-data-subset" in both.stderr
    for bad in ("150%", "0%", "lots"):
        result = cli(shared_ec_store.root, "check", "--read-data-subset", bad)
        assert result.exit_code == 2, (bad, result.output)
        assert result.stderr.startswith("casckpt: error:") and "%" in result.stderr


def test_check_finds_a_corrupt_shard_and_repair_rewrites_it(ec_store: EcStore) -> None:
    shard = max((p for p in ec_store.dirs[4].rglob("*") if p.is_file() and "packs" in p.parts),
                key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    dirty = cli(ec_store.root, "check", "--read-data", "--json")
    assert dirty.exit_code == 1, dirty.output
    assert json.loads(dirty.stdout)["problems"]
    assert _by_name(ec_store)["loc4"]["damaged"] == 1
    repaired = ok_json(ec_store.root, "repair")
    assert (repaired["packs"], repaired["shards_rewritten"], repaired["shards_moved"]) == (1, 1, 0)
    assert ok_json(ec_store.root, "check", "--read-data")["ok"] is True
    assert _by_name(ec_store)["loc4"]["damaged"] == 0


# -- catalog and cache ----------------------------------------------------------------


def _drop_catalog(root: Path) -> None:
    for file in root.glob("catalog.db*"):
        file.unlink()


def test_catalog_rebuild_restores_the_log(ec_store: EcStore) -> None:
    log = ok_json(ec_store.root, "log", RUN)
    packs = _packs(ec_store)
    _drop_catalog(ec_store.root)
    report = ok_json(ec_store.root, "catalog", "rebuild")
    assert report["ok"] is True and report["lost_packs"] == [] and report["skipped"] == []
    assert (report["packs"], report["versions"], report["runs"]) == (packs, len(STEPS), 1)
    rebuilt = ok_json(ec_store.root, "log", RUN)
    assert [(v["id"], v["step"]) for v in rebuilt] == [(v["id"], v["step"]) for v in log]
    assert ok_json(ec_store.root, "redundancy", "show")["redundancy"] == "ec:4+2"
    _assert_restores_bit_exact(ec_store)
    refused = cli(ec_store.root, "catalog", "rebuild")  # the catalog is no longer empty
    assert refused.exit_code == 2 and "not empty" in refused.stderr


def test_catalog_rebuild_table(ec_store: EcStore) -> None:
    _drop_catalog(ec_store.root)
    result = cli(ec_store.root, "catalog", "rebuild")
    assert result.exit_code == 0, result.output
    assert "catalog rebuilt" in result.stdout
    versions = next(line for line in result.stdout.splitlines() if line.strip().startswith("versions "))
    assert versions.split()[-1] == str(len(STEPS))


def test_catalog_rebuild_exits_1_when_packs_are_lost(ec_store: EcStore) -> None:
    _drop_catalog(ec_store.root)
    for name in ("loc0", "loc1", "loc2"):
        for packs_dir in ec_store.dir_of(name).glob("packs"):
            shutil.rmtree(packs_dir)
    result = cli(ec_store.root, "catalog", "rebuild", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["lost_packs"] and report["skipped"]
    table = cli(ec_store.root, "catalog", "rebuild")  # nothing was recovered: the catalog is still empty
    assert table.exit_code == 1, table.output
    assert "lost packs (too few readable shards)" in table.stdout and "skipped versions" in table.stdout
    assert report["lost_packs"][0] in table.stdout


def test_cache_rebuild_counts_every_chunk(ec_store: EcStore) -> None:
    with casckpt.open(ec_store.root, create=False) as store:
        # stats leaves tree nodes out; the cache has them
        chunks = inventory.live_chunk_count(internals(store).catalog)
    assert ok_json(ec_store.root, "cache", "rebuild") == {"chunks": chunks}
    table = cli(ec_store.root, "cache", "rebuild")
    assert table.exit_code == 0 and f"{chunks} chunks" in table.stdout
    _assert_restores_bit_exact(ec_store)


# -- redundancy -------------------------------------------------------------------------


def test_redundancy_show_and_set(ec_store: EcStore) -> None:
    assert ok_json(ec_store.root, "redundancy", "show") == {"run": None, "redundancy": "ec:4+2", "runs": {}}
    shown = cli(ec_store.root, "redundancy", "show")
    assert shown.exit_code == 0 and "ec:4+2" in shown.stdout

    assert ok_json(ec_store.root, "redundancy", "set", "replicate:3")["redundancy"] == "replicate:3"
    assert ok_json(ec_store.root, "redundancy", "show")["redundancy"] == "replicate:3"

    own = ok_json(ec_store.root, "redundancy", "set", "ec:2+1", "--run", RUN)
    assert own == {"run": RUN, "redundancy": "ec:2+1"}
    assert ok_json(ec_store.root, "redundancy", "show", "--run", RUN)["redundancy"] == "ec:2+1"
    assert ok_json(ec_store.root, "redundancy", "show")["runs"] == {RUN: "ec:2+1"}
    table = cli(ec_store.root, "redundancy", "show")
    assert f"run {RUN}: ec:2+1" in table.stdout

    ok_json(ec_store.root, "redundancy", "set", "inherit", "--run", RUN)
    assert ok_json(ec_store.root, "redundancy", "show", "--run", RUN)["redundancy"] == "replicate:3"
    inherited = cli(ec_store.root, "redundancy", "show", "--run", RUN)
    assert "(the store's)" in inherited.stdout


def test_redundancy_set_rejects_bad_specs(shared_ec_store: EcStore) -> None:
    for bad in ("raid6", "ec:4", "replicate:1", "inherit"):
        result = cli(shared_ec_store.root, "redundancy", "set", bad)
        assert result.exit_code == 2, (bad, result.output)
        assert result.stderr.startswith("casckpt: error:") and bad in result.stderr
    unknown = cli(shared_ec_store.root, "redundancy", "set", "raid6")
    assert "ec:K+M" in unknown.stderr and "replicate:N" in unknown.stderr
    too_wide = cli(shared_ec_store.root, "redundancy", "set", "ec:6+2")
    assert too_wide.exit_code == 2 and "failure domains" in too_wide.stderr
    assert ok_json(shared_ec_store.root, "redundancy", "show")["redundancy"] == "ec:4+2"


# -- location add, retire, activate ---------------------------------------------------------


def test_location_add_then_retire(ec_store: EcStore, tmp_path: Path) -> None:
    packs = _packs(ec_store)
    extra = tmp_path / "disk6"
    added = ok_json(ec_store.root, "location", "add", str(extra), "--domain", "d6", "--name", "extra")
    assert 0 <= added.pop("probe_s") < 5
    assert added == {"name": "extra", "url": extra.resolve().as_uri(), "domain": "d6", "state": "active",
                     "shards": 0, "bytes": 0, "damaged": 0, "reachable": True, "reason": None}
    assert str(extra) in (ec_store.root / "casckpt.toml").read_text()
    again = cli(ec_store.root, "location", "add", str(tmp_path / "disk7"), "--name", "extra")
    assert again.exit_code == 2 and "extra" in again.stderr

    retired = ok_json(ec_store.root, "location", "retire", "loc0")
    assert (retired["state"], retired["shards"]) == ("retiring", packs)
    repaired = ok_json(ec_store.root, "repair")
    assert repaired["ok"] is True and repaired["shards_moved"] == packs
    locations = _by_name(ec_store)
    assert locations["loc0"]["shards"] == 0 and locations["extra"]["shards"] == packs
    assert ok_json(ec_store.root, "check", "--read-data")["ok"] is True
    _assert_restores_bit_exact(ec_store)

    active = cli(ec_store.root, "location", "activate", "loc0")
    assert active.exit_code == 0, active.output
    row = next(line for line in active.stdout.splitlines() if line.startswith("loc0 "))
    assert "active" in row
    assert _by_name(ec_store)["loc0"]["state"] == "active"


def test_the_old_location_drain_spelling_is_an_error_naming_retire(shared_ec_store: EcStore) -> None:
    """`location drain` was renamed `location retire` (pre-0012 spelling; drain is the fast
    tier's alone): the old one exits 2 naming the new one, changes nothing, is not in the help."""
    states = {name: loc["state"] for name, loc in _by_name(shared_ec_store).items()}
    result = cli(shared_ec_store.root, "location", "drain", "loc0", "--json")  # pre-0012 spelling
    assert result.exit_code == 2 and result.stdout == ""
    assert "casckpt location retire NAME" in result.stderr and "nothing was changed" in result.stderr
    assert {name: loc["state"] for name, loc in _by_name(shared_ec_store).items()} == states
    listed = cli(None, "location", "--help")
    assert listed.exit_code == 0 and " retire " in listed.stdout and " drain " not in listed.stdout


def test_unknown_location_exits_3(shared_ec_store: EcStore) -> None:
    for verb in ("retire", "fail", "activate"):
        result = cli(shared_ec_store.root, "location", verb, "loc9")
        assert result.exit_code == 3, result.output
        assert "loc9" in result.stderr and result.stdout == ""
