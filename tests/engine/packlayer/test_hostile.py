"""Invariant 10: a hostile file where a pack should be never hangs or exhausts a reader.

A FIFO, a symlink to /dev/zero or out of the location, a pack extended to a
sparse gigabyte: restore and check run in a process of their own
(tests/helpers/hostile_child.py, forked warm by its zygote) under a timeout, so a read that blocks fails
the test instead of hanging the suite, and report their peak RSS, so a read
that swallows a gigabyte fails it too. With redundancy the restore still
succeeds from the other locations and repair rewrites what was refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from doubles import Zygote

import casckpt

CHILD = Path(__file__).resolve().parents[2] / "helpers" / "hostile_child.py"
GIB = 1 << 30
RSS_ALLOWANCE_KIB = 200 * 1024  # far below the gigabyte a whole read would cost
REF = "r@1"


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("casckpt_tests_hostile_child", CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(96 * 1024, generator=g), "b": torch.arange(step, step + 100), "step": step}


def _make_store(root: Path, redundancy: str | None = None, locations: int = 1) -> list[Path]:
    """A store with versions r@0 and r@1; returns its blob directories."""
    dirs = [root] if locations == 1 else [root / "blobs" / f"d{i}" for i in range(locations)]
    blobs = None if locations == 1 else [f"blobs/d{i}" for i in range(locations)]
    with casckpt.open(root, blobs=blobs, redundancy=redundancy, chunk_size=16 << 10,
                      pack_size=128 << 10, workers=2) as store:
        for step in (0, 1):
            store.commit(_state(step), run="r", step=step)
    return dirs


def _packs(directory: Path) -> list[Path]:
    found = sorted(p for p in (directory / "packs").rglob("*") if p.is_file())
    assert found, f"no pack objects under {directory}"
    return found


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    server = Zygote(CHILD)
    yield server
    server.close()


@pytest.fixture
def run(zygote: Zygote, tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """Run one read in a forked process of its own; see :func:`_run`."""
    return lambda root, op, *args: _run(zygote, tmp_path, root, op, *args)


def _run(zygote: Zygote, tmp: Path, root: Path, op: str, *args: str,
         timeout: float = 120) -> dict[str, Any]:
    out, err = tmp / f"{op}.out", tmp / f"{op}.err"
    pid = zygote.ask({"op": "spawn", "args": [str(root), op, *args], "stdout": str(out),
                      "stderr": str(err)}, 30)["pid"]
    try:
        status = zygote.ask({"op": "wait", "pid": pid}, timeout)["status"]
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        assert zygote.proc.stdout is not None
        zygote.proc.stdout.readline()  # the wait's answer, now that the child is gone
        raise AssertionError(f"`{op}` hung on a hostile file (killed after {timeout} s)") from None
    assert status == 0, f"`{op}` crashed ({status}):\n{err.read_text()[-3000:]}"
    result: dict[str, Any] = json.loads(out.read_text().strip().splitlines()[-1])
    grew = result["rss_peak_kib"] - result["rss_before_kib"]
    assert grew < RSS_ALLOWANCE_KIB, f"`{op}` grew its peak RSS by {grew} KiB"
    return result


Runner = Callable[..., dict[str, Any]]


def _assert_refused(result: dict[str, Any], *words: str) -> None:
    assert result["error"] is not None, "the read succeeded"
    assert "CasckptError" in result["error"], f"untyped error {result['error']}: {result['message']}"
    for word in words:
        assert word in result["message"], result["message"]


def _assert_problems(result: dict[str, Any], *words: str) -> None:
    assert result["error"] is None, f"check raised {result['error']}: {result['message']}"
    text = "\n".join(result["problems"])
    assert result["problems"], "check found nothing wrong"
    for word in words:
        assert word in text, text


def _expected() -> str:
    return str(child.digest(_state(1)))


def test_fifo_at_a_pack_path_fails_restore_and_check_promptly(run: Runner, tmp_path: Path) -> None:
    root = tmp_path / "store"
    (location,) = _make_store(root)
    for pack in _packs(location):
        pack.unlink()
        os.mkfifo(pack)
    _assert_refused(run(root, "restore", REF), "FIFO")
    _assert_problems(run(root, "check"), "FIFO")
    _assert_problems(run(root, "check-read-data"), "FIFO")


@pytest.mark.parametrize(("redundancy", "locations"), [("replicate:2", 2), ("ec:2+1", 3)])
def test_fifo_in_one_location_restores_from_the_others_and_repair_replaces_it(
        run: Runner, tmp_path: Path, redundancy: str, locations: int) -> None:
    root = tmp_path / "store"
    dirs = _make_store(root, redundancy, locations)
    fifos = _packs(dirs[0])
    for pack in fifos:
        pack.unlink()
        os.mkfifo(pack)
    assert run(root, "restore", REF)["digest"] == _expected()
    _assert_problems(run(root, "check-read-data"), "FIFO")
    healed = run(root, "repair")
    assert healed["error"] is None and healed["problems"] == [], healed
    assert healed["message"] == "repaired ok=True"
    assert all(p.is_file() and not p.is_symlink() for p in _packs(dirs[0]))
    assert run(root, "restore", REF)["digest"] == _expected()


@pytest.mark.parametrize("target", ["dev-zero", "outside-copy"])
def test_pack_symlinked_out_of_the_location_is_refused_unread(run: Runner, tmp_path: Path,
                                                              target: str) -> None:
    root = tmp_path / "store"
    (location,) = _make_store(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    for pack in _packs(location):
        if target == "dev-zero":
            pack.unlink()
            pack.symlink_to("/dev/zero")
        else:  # the very bytes of the pack, valid, but not in the location
            pack.rename(outside / pack.name)
            pack.symlink_to(outside / pack.name)
    _assert_refused(run(root, "restore", REF), "outside the location")
    _assert_problems(run(root, "check"), "outside the location")
    _assert_problems(run(root, "check-read-data"), "outside the location")


def test_a_pack_extended_to_a_sparse_gigabyte_is_never_read_whole(run: Runner,
                                                                  tmp_path: Path) -> None:
    root = tmp_path / "store"
    dirs = _make_store(root, "replicate:2", 2)
    for pack in _packs(dirs[0]):
        os.truncate(pack, GIB)
    _assert_problems(run(root, "check"), f"is {GIB} bytes")
    _assert_problems(run(root, "check-read-data"), f"is {GIB} bytes")  # refused, not read
    assert run(root, "restore", REF)["digest"] == _expected()  # by range, within the recorded size


def test_an_extended_single_copy_restores_by_range_and_check_flags_it(run: Runner,
                                                                      tmp_path: Path) -> None:
    root = tmp_path / "store"
    (location,) = _make_store(root)
    for pack in _packs(location):
        os.truncate(pack, GIB)
    assert run(root, "restore", REF)["digest"] == _expected()
    _assert_problems(run(root, "check"), f"is {GIB} bytes")
