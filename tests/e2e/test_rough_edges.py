"""Rough edges a newcomer hit: each message says what is wrong and what to do instead."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.cli.main import app
from casckpt.errors import MetricNotFoundError, RefNotFoundError, RestoreTargetError, RunNotFoundError

RUN, FORK = "tiny-lm", "tiny-lm-ft"


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


@pytest.fixture
def store_path(tmp_path: Path) -> Iterator[Path]:
    """A store with RUN at steps 1 and 2 (a model and its optimizer, metrics loss and lr)
    and FORK, forked from RUN@1 and without versions of its own."""
    path = tmp_path / "store"
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with casckpt.open(path) as store:
        for step in (1, 2):
            store.commit({"model": model.state_dict(), "optim": optim.state_dict()}, run=RUN,
                         step=step, metrics={"loss": 1 / step, "lr": 0.1})
        store.fork(f"{RUN}@1", FORK)
    yield path
    with casckpt.open(path, create=False) as store:
        assert store.ops.check().ok


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


# 1. restore(into=module) of a state that keeps the module under a key


def test_restore_into_a_module_names_the_key_to_pass_it_under(store_path: Path) -> None:
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with casckpt.open(store_path, create=False) as store:
        with pytest.raises(RestoreTargetError) as module_error:
            store.restore(f"{RUN}@latest", into=model)
        with pytest.raises(RestoreTargetError) as optim_error:
            store.restore(f"{RUN}@latest", into=optim)
        with pytest.raises(RestoreTargetError) as other_error:
            store.restore(f"{RUN}@latest", into=torch.nn.BatchNorm1d(2))
        restored = store.restore(f"{RUN}@latest", into={"model": model})
    assert 'into={"model": model}' in str(module_error.value)
    assert "'model', 'optim'" in str(module_error.value)
    assert "remove those keys" not in str(module_error.value)
    assert 'into={"optim": optim}' in str(optim_error.value)
    assert "none of them holds the BatchNorm1d's keys" in str(other_error.value)
    assert "'model', 'optim'" in str(other_error.value)
    assert restored["model"] is model


# 2. a fork with no versions yet


@pytest.mark.parametrize("selector", ["latest", "~1", "5"])
def test_a_fork_without_versions_names_its_fork_point(store_path: Path, selector: str) -> None:
    ref = f"{FORK}@{selector}"
    with casckpt.open(store_path, create=False) as store:
        for call in (store.resolve, store.show, store.restore):
            with pytest.raises(RefNotFoundError) as info:
                call(ref)
            message = str(info.value)
            assert f"run {FORK!r} has no versions yet" in message
            assert f"forked from {RUN}@1" in message and f"restore {RUN}@1" in message
            assert info.value.near == (f"{RUN}@1",) and f"{FORK}@latest?" not in message


def test_cli_show_of_an_empty_fork_names_its_fork_point(store_path: Path) -> None:
    result = cli("--store", str(store_path), "show", f"{FORK}@latest")
    assert result.exit_code == 3
    assert f"forked from {RUN}@1" in " ".join(result.stderr.split())


def test_a_run_never_forked_without_versions_says_to_commit(store_path: Path) -> None:
    with casckpt.open(store_path, create=False) as store:
        store.retention.set("empty", keep_last=1)  # creates the run
        with pytest.raises(RefNotFoundError, match="has no versions yet; commit one"):
            store.resolve("empty@latest")


# 3. --store after the command


@pytest.mark.parametrize(("args", "fixed"), [
    (["runs", "--store", "{store}"], "casckpt --store {store} runs"),
    (["show", f"{RUN}@1", "--store={store}"], f"casckpt --store {{store}} show {RUN}@1"),
    (["retention", "set", RUN, "-s", "{store}", "--keep-last", "2"],
     f"casckpt --store {{store}} retention set {RUN} --keep-last 2"),
])
def test_store_option_after_the_command_says_it_goes_first(
        store_path: Path, args: list[str], fixed: str) -> None:
    result = cli(*(a.format(store=store_path) for a in args))
    assert result.exit_code == 2
    said = " ".join(result.stderr.replace("│", " ").split())
    assert "--store goes before the command" in said
    assert fixed.format(store=store_path) in said


# 4. files restore writes honour the umask


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_restore_to_a_file_honours_the_umask(store_path: Path, tmp_path: Path, umask: int) -> None:
    with casckpt.open(store_path, create=False) as store:
        store.commit({"w": torch.ones(2), "note": "x" * 70_000}, run="big", step=1)
    target = tmp_path / "out.safetensors"
    old = os.umask(umask)
    try:
        result = cli("--store", str(store_path), "restore", "big@1", "--to", str(target))
        plain = cli("--store", str(store_path), "restore", f"{RUN}@1", "--to", str(tmp_path / "p.st"))
    finally:
        os.umask(old)
    assert result.exit_code == 0 and plain.exit_code == 0, result.output + plain.output
    for written in (target, target.with_suffix(".values.json"), tmp_path / "p.st"):
        assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask, written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "out.values.json",
                                                          "p.st", "store"]


# 5. readable help


@pytest.mark.parametrize("command", [[], ["log"], ["restore"], ["check"], ["gc"], ["best"],
                                     ["retention", "set"], ["location", "list"], ["init"]])
def test_help_shows_no_typer_type_labels(command: list[str]) -> None:
    result = cli(*command, "--help")
    assert result.exit_code == 0, result.output
    for label in ("<bool>", "<list[", " range>", "<float>"):
        assert label not in result.stdout, (command, label)


# 6. unknown metric, unknown run


def test_best_of_an_unknown_metric_lists_the_metrics(store_path: Path) -> None:
    with casckpt.open(store_path, create=False) as store:
        with pytest.raises(MetricNotFoundError) as info:
            store.best(RUN, "acc")
        with pytest.raises(MetricNotFoundError) as near:
            store.best(RUN, "los")
        store.retention.set("fresh", keep_last=1)  # a run without versions
        with pytest.raises(MetricNotFoundError) as none:
            store.best("fresh", "acc")
    assert "its versions record: loss, lr" in str(info.value)
    assert near.value.near[0] == "loss" and "Did you mean: loss" in str(near.value)
    assert "record no metrics" in str(none.value)
    result = cli("--store", str(store_path), "best", RUN, "--metric", "acc")
    assert result.exit_code == 3 and "loss, lr" in result.stderr


def test_an_unknown_run_lists_the_runs(store_path: Path) -> None:
    with casckpt.open(store_path, create=False) as store:
        for call in (store.log, store.retention.get, store.retention.plan, store.retention.clear,
                     lambda run: store.best(run, "loss")):
            with pytest.raises(RunNotFoundError) as info:
                call("nosuchrun")
            assert isinstance(info.value, KeyError)
            assert f"runs: {RUN}, {FORK}" in str(info.value), call
        with pytest.raises(RunNotFoundError, match=f"Did you mean: {RUN}, {FORK}"):
            store.log("tiny-l")
        with pytest.raises(RunNotFoundError, match=f"runs: {RUN}, {FORK}"):
            store.resolve("nosuchrun@latest")
        for i in range(12):
            store.fork(f"{RUN}@1", f"zz-{i}")
        with pytest.raises(RunNotFoundError, match="and 4 more"):
            store.log("nosuchrun")
    result = cli("--store", str(store_path), "log", "nosuchrun")
    assert result.exit_code == 3 and f"runs: {RUN}, {FORK}" in result.stderr


# 7. retention set without a rule


def test_retention_set_without_a_rule_names_the_cli_flags(store_path: Path) -> None:
    result = cli("--store", str(store_path), "retention", "set", RUN)
    assert result.exit_code == 2
    said = " ".join(result.stderr.split())
    assert "--keep-last" in said and "--keep-best" in said and "keep_last" not in said
    assert f"casckpt retention clear {RUN}" in said


# 8. --keep-last keeps the highest steps


def test_keep_last_keeps_the_highest_steps_as_its_help_says(tmp_path: Path) -> None:
    help_text = " ".join(cli("retention", "set", "--help").stdout.split())
    assert "Keep the N versions with the highest steps." in help_text
    usage = (Path(__file__).parents[2] / "docs" / "usage.md").read_text(encoding="utf-8")
    assert "| `keep_last`, --keep-last N | int > 0 | Keep the N versions with the highest steps. |" in usage
    with casckpt.open(tmp_path / "store") as store:
        for step in (300, 100, 200):  # step 200 is the newest, step 300 the highest
            store.commit({"w": torch.full((2,), float(step))}, run=RUN, step=step)
        store.retention.set(RUN, keep_last=1)
        (plan,) = store.retention.plan(RUN)
        assert [d.version.step for d in plan.decisions if d.keep] == [300]
        assert store.ops.check().ok
