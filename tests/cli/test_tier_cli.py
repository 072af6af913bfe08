"""The fast tier's command line: ``init --fast-tier``, ``drain``, ``tier status``, ``tier
forget``, and the durability ``log`` and ``show`` print.

Versions are left waiting on a tier the way a training process killed before its drain
leaves them: committed by a handle that does not drain (``background_drain=False``), so
every test starts from a known number of versions not durable yet.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app

RUN = "fast-run"


def cli(store: Path | None, *args: str, env: dict[str, str | None] | None = None) -> Result:
    prefix = ["--store", str(store)] if store is not None else []
    return CliRunner().invoke(app, [*prefix, *args], env=env)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((256,), float(step)), "b": torch.arange(64, dtype=torch.int32) + step,
            "step": step}


def _commit(path: Path, steps: range, *, fast_tier: Path | None = None) -> list[casckpt.Version]:
    """Commit ``steps`` through a handle that leaves its tier undrained (a killed trainer)."""
    with casckpt.open(path, create=False, fast_tier=fast_tier,
                      options=casckpt.Options(background_drain=False)) as store:
        return [store.commit(_state(step), run=RUN, step=step) for step in steps]


def _durable(path: Path, steps: range) -> None:
    with casckpt.open(path, create=False) as store:
        for step in steps:
            store.commit(_state(step), run=RUN, step=step, durable=True)


def _check(path: Path, *, lost: int = 0) -> None:
    """``check`` finds nothing wrong but the ``lost`` versions (reported, never hidden)."""
    with casckpt.open(path, create=False, options=casckpt.Options(background_drain=False)) as store:
        report = store.ops.check()
        gone = {f"{v.run}@{v.step}" for v in store.log() if v.durability == "lost"}
    assert len(gone) == lost
    assert [p for p in report.problems if p.subject not in gone] == [], report.problems
    assert {p.subject for p in report.problems} == gone
    assert all("lost before it drained" in p.detail for p in report.problems)


def _tier_dir(path: Path, tier: Path) -> Path:
    with casckpt.open(path, create=False, options=casckpt.Options(background_drain=False)) as store:
        local = store.tier.status().local_path
    assert local is not None and Path(local).parent == tier.resolve()
    return Path(local)


@pytest.fixture
def tiered(tmp_path: Path) -> tuple[Path, Path]:
    """A store whose casckpt.toml records a fast tier: steps 0-1 durable, 2-3 waiting on it."""
    path, tier = tmp_path / "store", tmp_path / "nvme"
    result = cli(None, "init", str(path), "--fast-tier", str(tier), "--fast-tier-bytes", "1GiB")
    assert result.exit_code == 0, result.output
    _durable(path, range(2))
    versions = _commit(path, range(2, 4))
    assert [v.durability for v in versions] == ["fast", "fast"]
    return path, tier


# -- init ------------------------------------------------------------------------------


def test_init_records_the_fast_tier(tmp_path: Path) -> None:
    path, tier = tmp_path / "store", tmp_path / "nvme"
    result = cli(None, "init", str(path), "--fast-tier", str(tier), "--fast-tier-bytes", "2GiB")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"Created an empty casckpt store in {path}",
                                          f"fast tier {tier} (budget 2.0 GiB)"]
    with casckpt.open(path, create=False, options=casckpt.Options(background_drain=False)) as store:
        status = store.tier.status()
    assert status.budget == 2 << 30 and status.local_path == str(tier / Path(status.local_path).name)


def test_init_budget_without_a_tier_is_a_usage_error(tmp_path: Path) -> None:
    result = cli(None, "init", str(tmp_path / "store"), "--fast-tier-bytes", "2GiB")
    assert result.exit_code == 2
    assert "--fast-tier DIR" in result.output and not (tmp_path / "store").exists()


def test_init_takes_the_root_fast_tier_and_its_env(tmp_path: Path) -> None:
    path, tier = tmp_path / "store", tmp_path / "nvme"
    result = cli(None, "init", str(path), env={"CASCKPT_FAST_TIER": str(tier)})
    assert result.exit_code == 0, result.output
    assert f"fast tier {tier} (budget half its disk's free space)" in result.stdout
    assert "fast_tier" in (path / "casckpt.toml").read_text()


# -- log and show ----------------------------------------------------------------------


def test_log_has_no_durability_column_when_every_version_is_durable(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with casckpt.open(path) as store:
        store.commit(_state(0), run=RUN, step=0)
    result = cli(path, "log")
    assert result.exit_code == 0 and "DURABILITY" not in result.stdout
    assert "durability" not in cli(path, "show", f"{RUN}@0").stdout
    logged = json.loads(cli(path, "log", "--json").stdout)
    assert [v["durability"] for v in logged] == ["durable"]
    assert json.loads(cli(path, "show", f"{RUN}@0", "--json").stdout)["version"]["durability"] == "durable"


def test_log_and_show_print_the_durability_of_fast_versions(tiered: tuple[Path, Path]) -> None:
    path, _ = tiered
    result = cli(path, "log")
    assert result.exit_code == 0, result.output
    head, _rule, *rows = result.stdout.splitlines()
    assert head.split()[:4] == ["ID", "RUN", "STEP", "DURABILITY"]
    assert [(row.split()[2], row.split()[3]) for row in rows] == [
        ("3", "fast"), ("2", "fast"), ("1", "durable"), ("0", "durable")]
    logged = json.loads(cli(path, "log", "--json").stdout)
    assert [v["durability"] for v in logged] == ["fast", "fast", "durable", "durable"]

    shown = cli(path, "show", f"{RUN}@3")
    assert shown.exit_code == 0, shown.output
    assert "durability  fast: on the fast tier of the host that committed it" in shown.stdout
    assert "DEGRADED" not in shown.stdout  # a pack not drained has no shards by design
    assert "durability" not in cli(path, "show", f"{RUN}@1").stdout
    assert json.loads(cli(path, "show", f"{RUN}@3", "--json").stdout)["version"]["durability"] == "fast"


def test_long_logs_stream_the_durability_column_too(tiered: tuple[Path, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from casckpt.cli import render

    path, _ = tiered
    with casckpt.open(path, create=False, options=casckpt.Options(background_drain=False)) as store:
        versions = store.log(RUN)
    render.stream_log(versions)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[3] == "DURABILITY" and lines[2].split()[3] == "fast"


# -- tier status -----------------------------------------------------------------------


def test_tier_status_table(tiered: tuple[Path, Path]) -> None:
    path, tier = tiered
    local = _tier_dir(path, tier)
    result = cli(path, "tier", "status")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["versions", "2", "durable,", "2", "fast"]
    assert lines[2].split() == ["this", "host", str(local)]
    assert "budget 1.0 GiB" in lines[3]
    assert lines[4].split()[:2] == ["not", "drained"] and lines[4].split()[-2:] == ["2", "pack(s)"]
    row = next(line for line in lines if line.endswith("yes"))
    assert row.split()[3:4] == ["active"] and row.split()[-2:] == ["2", "yes"]
    assert lines[-1].startswith("not durable yet: ") and len(lines[-1].split()[3:]) == 2


def test_tier_status_json(tiered: tuple[Path, Path]) -> None:
    path, tier = tiered
    result = cli(path, "tier", "status", "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["versions"] == {"durable": 2, "fast": 2}
    assert len(status["not_durable"]) == 2 and status["budget"] == 1 << 30
    assert status["local_path"] == str(_tier_dir(path, tier))
    [info] = status["tiers"]
    assert info["this_host"] and info["state"] == "active" and info["undrained_packs"] == 2
    assert status["held_bytes"] >= info["undrained_bytes"] > 0
    assert status["drain_rate"] > 0  # the host's: the durable commits drained
    assert status["durable_bytes"] > 0


def test_tier_status_and_check_say_when_the_budget_exceeds_the_disk(tmp_path: Path) -> None:
    path, tier = tmp_path / "store", tmp_path / "nvme"
    result = cli(None, "init", str(path), "--fast-tier", str(tier), "--fast-tier-bytes", "1000000TiB")
    assert result.exit_code == 0, result.output
    _commit(path, range(1))
    shown = " ".join(cli(path, "tier", "status").stdout.split())  # rich wraps long lines
    assert "warning: the budget" in shown and "exceeds the file system holding the tier" in shown
    assert " free of " in shown  # the disk row
    status = json.loads(cli(path, "tier", "status", "--json").stdout)
    assert 0 < status["disk_free"] <= status["disk_bytes"] < status["budget"]
    assert any("exceeds the file system" in w for w in status["warnings"])
    checked = cli(path, "check")
    assert checked.exit_code == 0, checked.output  # a warning, not a problem with the data
    assert "exceeds the file system" in " ".join(checked.stdout.split())
    report = json.loads(cli(path, "check", "--json").stdout)
    assert report["ok"] and any("exceeds the file system" in w for w in report["warnings"])


def test_tier_status_of_a_store_without_a_tier(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with casckpt.open(path) as store:
        store.commit(_state(0), run=RUN, step=0)
    result = cli(path, "tier", "status")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1:] == ["versions   1 durable",
                                              "this host  no fast tier (casckpt --fast-tier DIR)"]
    status = json.loads(cli(path, "tier", "status", "--json").stdout)
    assert status["tiers"] == [] and status["local_path"] is None


def test_looking_at_a_store_drains_nothing(tiered: tuple[Path, Path]) -> None:
    path, _ = tiered
    for args in (("log",), ("show", f"{RUN}@3"), ("tier", "status"), ("runs",), ("stats",)):
        assert cli(path, *args).exit_code == 0
    assert json.loads(cli(path, "tier", "status", "--json").stdout)["versions"]["fast"] == 2


# -- drain -----------------------------------------------------------------------------


def test_drain_makes_every_version_durable(tiered: tuple[Path, Path]) -> None:
    path, _ = tiered
    result = cli(path, "drain")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["drained", "2", "pack(s),"]
    assert lines[1].split() == ["durable", "now", "2", "version(s)"]
    assert lines[2].split()[0] == "evicted" and lines[3].split()[0] == "took"
    assert "DURABILITY" not in cli(path, "log").stdout
    again = json.loads(cli(path, "drain", "--json").stdout)
    assert (again["packs"], again["versions"], again["busy"], again["error"]) == (0, 0, False, None)
    _check(path)


def test_drain_json(tiered: tuple[Path, Path]) -> None:
    path, _ = tiered
    result = cli(path, "drain", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["packs"], report["versions"], report["lost_versions"], report["error"]) == (2, 2, [], None)
    assert report["bytes"] > 0 and report["seconds"] >= 0
    assert [v["durability"] for v in json.loads(cli(path, "log", "--json").stdout)] == ["durable"] * 4


def test_drain_with_the_tier_given_on_the_command_line(tmp_path: Path) -> None:
    path, tier = tmp_path / "store", tmp_path / "nvme"
    assert cli(None, "init", str(path)).exit_code == 0
    _commit(path, range(2), fast_tier=tier)
    assert json.loads(cli(path, "tier", "status", "--json").stdout)["versions"] == {"fast": 2}
    result = cli(path, "drain", "--json", env={"CASCKPT_FAST_TIER": str(tier)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["versions"] == 2
    result = cli(None, "--store", str(path), "--fast-tier", str(tier), "drain", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["versions"] == 0
    _check(path)


def test_drain_without_a_tier_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "store"
    assert cli(None, "init", str(path)).exit_code == 0
    result = cli(path, "drain")
    assert result.exit_code == 2
    assert "no fast tier on this host" in result.output and "--fast-tier DIR" in result.output


@contextmanager
def _draining(local: Path) -> Iterator[None]:
    """Hold the tier's drain lock, as another process draining it would."""
    fd = os.open(local / "drain.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_drain_no_wait_while_another_process_drains(tiered: tuple[Path, Path]) -> None:
    path, tier = tiered
    with _draining(_tier_dir(path, tier)):
        result = cli(path, "drain", "--no-wait")
        as_json = cli(path, "drain", "--no-wait", "--json")
    assert result.exit_code == 0, result.output
    assert "another process of this host is draining this tier; nothing done" in result.stdout
    assert json.loads(as_json.stdout)["busy"] is True
    assert json.loads(cli(path, "tier", "status", "--json").stdout)["versions"]["fast"] == 2


def test_drain_finding_a_pack_gone_reports_lost_versions_and_exits_1(tiered: tuple[Path, Path]) -> None:
    path, tier = tiered
    local = _tier_dir(path, tier)
    with casckpt.open(path, create=False, options=casckpt.Options(background_drain=False)) as store:
        newest = store.resolve(f"{RUN}@3")
    held = sorted((local / "packs").rglob("*"), key=lambda p: p.stat().st_mtime)
    packs = [p for p in held if p.is_file()]
    packs[-1].unlink()  # the newest pack: step 3's
    result = cli(path, "drain")
    assert result.exit_code == 1, result.output
    assert "LOST: 1 pack(s) were gone from the tier before they drained; 1 version(s) needing them " \
           f"are lost: {newest.short_id}" in result.stdout
    logged = {v["step"]: v["durability"] for v in json.loads(cli(path, "log", "--json").stdout)}
    assert logged == {0: "durable", 1: "durable", 2: "durable", 3: "lost"}
    restored = cli(path, "restore", f"{RUN}@3", "--to", str(path.parent / "out.safetensors"))
    assert restored.exit_code == 4 and "lost before it drained" in restored.output
    _check(path, lost=1)


# -- a tier lost -------------------------------------------------------------------------


def test_a_wiped_tier_shows_its_versions_lost_in_log(tiered: tuple[Path, Path]) -> None:
    path, tier = tiered
    shutil.rmtree(_tier_dir(path, tier))  # the disk replaced: the next open on this host finds it new
    result = cli(path, "log")
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()[2:]
    assert [(row.split()[2], row.split()[3]) for row in rows] == [
        ("3", "lost"), ("2", "lost"), ("1", "durable"), ("0", "durable")]
    shown = cli(path, "show", f"{RUN}@2")
    assert "durability  lost: its fast tier was lost before it drained" in shown.stdout
    latest = cli(path, "restore", f"{RUN}@latest", "--to", str(path.parent / "latest.safetensors"))
    assert latest.exit_code == 0, latest.output
    assert f"({RUN}@1)" in latest.stdout  # @latest skips the lost ones
    status = json.loads(cli(path, "tier", "status", "--json").stdout)
    assert status["versions"] == {"durable": 2, "lost": 2}
    assert sorted(t["state"] for t in status["tiers"]) == ["active", "lost"]
    assert cli(path, "drain").exit_code == 0  # nothing left to drain on the new tier
    _check(path, lost=2)


def _another_hosts_tier(tmp_path: Path) -> tuple[Path, Path, str]:
    """A store without a tier in its config; two versions wait on a tier at ``gone``."""
    path, gone = tmp_path / "store", tmp_path / "gone"
    assert cli(None, "init", str(path)).exit_code == 0
    _durable(path, range(1))
    _commit(path, range(1, 3), fast_tier=gone)
    [info] = json.loads(cli(path, "tier", "status", "--json").stdout)["tiers"]
    return path, gone, info["id"]


def test_tier_forget_declares_a_gone_tier_lost(tmp_path: Path) -> None:
    path, gone, tier_id = _another_hosts_tier(tmp_path)
    shutil.rmtree(gone)  # its disk is gone, and nothing on this host will open it again

    refused = cli(path, "tier", "forget", tier_id[:8])
    assert refused.exit_code == 2 and "Pass --yes" in refused.output
    assert json.loads(cli(path, "tier", "status", "--json").stdout)["versions"]["fast"] == 2

    result = cli(path, "tier", "forget", tier_id[:8], "--yes")
    assert result.exit_code == 0, result.output
    assert f"fast tier {tier_id[:12]} (" in result.stdout
    assert "is lost, with 2 pack(s) not drained: 2 version(s) are lost: " in result.stdout
    logged = {v["step"]: v["durability"] for v in json.loads(cli(path, "log", "--json").stdout)}
    assert logged == {0: "durable", 1: "lost", 2: "lost"}

    again = cli(path, "tier", "forget", tier_id, "--yes", "--json")
    assert again.exit_code == 0, again.output
    loss = json.loads(again.stdout)
    assert (loss["tier"], loss["packs"], loss["versions"]) == (tier_id, [], [])
    _check(path, lost=2)


def test_tier_forget_refuses_a_tier_that_is_not_lost(tmp_path: Path) -> None:
    path, gone, tier_id = _another_hosts_tier(tmp_path)
    whole = cli(path, "tier", "forget", tier_id, "--yes")  # still whole on this host
    assert whole.exit_code == 2 and "it is not lost. Drain it instead" in whole.output
    own = cli(None, "--store", str(path), "--fast-tier", str(gone), "tier", "forget", tier_id, "--yes")
    assert own.exit_code == 2 and "the one this store was opened with" in own.output
    unknown = cli(path, "tier", "forget", "0" * 32, "--yes")
    assert unknown.exit_code == 3 and "no fast tier of this store has this id" in unknown.output
    assert json.loads(cli(path, "tier", "status", "--json").stdout)["versions"]["fast"] == 2


def test_tier_status_imports_no_torch(tiered: tuple[Path, Path]) -> None:
    from test_startup import _commands_in_one_process

    path, _ = tiered
    commands = [["tier", "status"], ["tier", "status", "--json"], ["log"], ["show", f"{RUN}@3"]]
    results = _commands_in_one_process(path, commands)
    assert [r["code"] for r in results] == [0] * len(commands), results
    assert [r for r in results if "torch" in r["loaded"]] == []  # type: ignore[operator]
