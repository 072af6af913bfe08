"""CasckptCheckpointEngine against a real store, one process (a 1-rank gloo group where a
commit needs one): which tag a load resumes, what it refuses to write or read.

Fast; the 2-rank DeepSpeed engines are in test_deepspeed.py (slow tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

import casckpt  # noqa: E402
from casckpt.errors import (  # noqa: E402
    CorruptManifestError,
    InvalidArgumentError,
    UnsupportedStateError,
    VersionExistsError,
)
from casckpt.integrations.deepspeed import CasckptCheckpointEngine, export_files  # noqa: E402
from casckpt.integrations.deepspeed_state import NODE, decode  # noqa: E402
from casckpt.store import Store  # noqa: E402

FILE = "mp_rank_00_model_states.pt"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with casckpt.open(str(tmp_path / "store")) as opened:
        yield opened


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def saved(store: Store, engine: CasckptCheckpointEngine, step: int, *, tag: str | None = None,
          files: object = None) -> None:
    """A version as the engine's commit stores it (one rank)."""
    tag = tag if tag is not None else f"global_step{step}"
    store.commit({FILE: {"w": torch.full((2,), float(step))}}, run="ds", step=step,
                 metadata={"deepspeed.tag": tag,
                           "deepspeed.files": files if files is not None else {FILE: 0}},
                 tags=(engine.tag_name(tag),))


def test_a_load_without_tag_resumes_latest_then_the_last_commit_not_the_highest_step(
        store: Store, tmp_path: Path) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 0)
    for step in (100, 110, 120, 105):  # a rollback to 100, then a save at 105
        saved(store, engine, step)
    assert engine.prepare_load(tmp_path / "fresh") == "global_step105"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "latest").write_text("global_step110")
    assert engine.prepare_load(folder) == "global_step110"
    assert (folder / "latest").read_text() == "global_step110"
    (folder / "latest").write_text("global_step7")  # DeepSpeed's own tag, not this run's
    assert engine.prepare_load(folder) == "global_step105"
    loaded = engine.load(str(folder / "global_step105" / FILE))
    assert torch.equal(loaded["w"], torch.full((2,), 105.0))


def test_saving_a_step_the_run_holds_after_a_rollback_says_to_fork(
        store: Store, tmp_path: Path, world: None) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 110)
    for step in (100, 110):
        saved(store, engine, step)
    engine.prepare_load(tmp_path / "ckpt", "global_step100")
    info = CheckpointCommitInfo(tag="global_step110", save_dir=str(tmp_path / "ckpt"), save_latest=True)
    engine.create(info)
    engine.save({"w": torch.zeros(2)}, str(tmp_path / "ckpt" / "global_step110" / FILE))
    with pytest.raises(VersionExistsError, match=r"store.fork\('ds@100'"):
        engine.commit(info)
    store.fork("ds@100", "ds-b")  # what the message says to do
    forked = CasckptCheckpointEngine(store, "ds-b", lambda: 110)
    forked.create(info)
    forked.save({"w": torch.zeros(2)}, str(tmp_path / "ckpt" / "global_step110" / FILE))
    assert forked.commit(info)
    assert forked.last_version is not None and forked.last_version.run == "ds-b"


def test_a_refused_file_raises_from_commit_not_save_and_publishes_nothing(
        store: Store, tmp_path: Path, world: None) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 1)
    info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path / "ckpt"), save_latest=True)
    engine.create(info)
    # no raise here: every rank must reach commit's collective
    engine.save({"client": object()}, str(tmp_path / "ckpt" / "global_step1" / FILE))
    with pytest.raises(UnsupportedStateError, match="client"):
        engine.commit(info)
    assert store.runs() == [] or not store.log("ds")


@pytest.mark.parametrize("tag", ["exp_b/step5", "..", ""])
def test_a_tag_that_is_not_a_plain_folder_name_is_refused(store: Store, tmp_path: Path, tag: str) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 5)
    with pytest.raises(InvalidArgumentError, match="plain folder name"):
        engine.create(CheckpointCommitInfo(tag=tag, save_dir=str(tmp_path), save_latest=True))
    with pytest.raises(InvalidArgumentError, match="plain folder name"):
        engine.prepare_load(tmp_path / "ckpt", tag)


@pytest.mark.parametrize(("tag", "files"), [
    ("../../outside", {FILE: 0}), ("t", {"../../escaped": 0}), ("t", {"ABSOLUTE": 0}),
    ("t", {FILE: "0"})])
def test_stored_names_that_leave_the_folder_are_refused_before_writing(
        store: Store, tmp_path: Path, tag: str, files: object) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 1)
    if files == {"ABSOLUTE": 0}:  # an absolute name inside tmp_path: a failing test writes nowhere else
        files = {str(tmp_path / "escaped-abs"): 0}
    saved(store, engine, 1, tag=tag, files=files)
    load_dir = tmp_path / "a" / "b" / "ckpt"
    with pytest.raises(CorruptManifestError, match="plain"):
        engine.prepare_load(load_dir)
    with pytest.raises(CorruptManifestError, match="plain"):
        export_files(store, "ds@1", load_dir)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "store" not in p.relative_to(tmp_path).parts
                and p.name != "pg"]


def test_a_load_never_overwrites_deepspeeds_own_files(store: Store, tmp_path: Path) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 10)
    saved(store, engine, 10)
    folder = tmp_path / "checkpoints"
    (folder / "global_step10").mkdir(parents=True)
    torch.save({"module": {"w": torch.full((2,), 7.0)}}, folder / "global_step10" / FILE)
    (folder / "latest").write_text("global_step10")
    before = (folder / "global_step10" / FILE).read_bytes()
    with pytest.raises(InvalidArgumentError, match="DeepSpeed's own checkpoint files"):
        engine.prepare_load(folder, "global_step10")
    assert (folder / "global_step10" / FILE).read_bytes() == before
    other = tmp_path / "casckpt-dir"  # markers of our own are rewritten freely
    assert engine.prepare_load(other) == engine.prepare_load(other) == "global_step10"
    assert json.loads((other / "global_step10" / FILE).read_text())["ref"] == "casckpt://ds@10"


def test_a_load_keeps_the_restored_files_until_release(store: Store, tmp_path: Path) -> None:
    engine = CasckptCheckpointEngine(store, "ds", lambda: 4)
    saved(store, engine, 4)
    engine.prepare_load(tmp_path / "ckpt")
    for _ in range(2):  # DeepSpeed reads the model file twice: one restore serves both
        loaded = engine.load(str(tmp_path / "ckpt" / "global_step4" / FILE))
        assert torch.equal(loaded["w"], torch.full((2,), 4.0))
    assert engine._loaded is not None
    engine.release()  # what load_checkpoint does when DeepSpeed's load returns
    assert engine._loaded is None


def test_a_dtype_node_reads_only_torch_dtypes_and_a_bad_kind_is_corrupt() -> None:
    with pytest.raises(CorruptManifestError):
        decode({NODE: ["unhashable"], "value": 1})
    with pytest.raises(CorruptManifestError):
        decode({NODE: {"a": 1}, "value": 1})
    assert decode({NODE: "dtype", "value": "bfloat16"}) is torch.bfloat16
    code = ("import sys, torch; from casckpt.integrations.deepspeed_state import NODE, decode\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "try: decode({NODE: 'dtype', 'value': '_dynamo'})\n"
            "except Exception as e: print(type(e).__name__)\n"
            "print(before, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["CorruptManifestError", "False", "False"]
