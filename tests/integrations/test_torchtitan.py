"""torchtitan's real ``CheckpointManager`` on casckpt, against its own file checkpoints.

Ranks are forked by tests/helpers/torchtitan_worker.py (dist_worker.py's zygote): a tiny MLP
sharded by FSDP2 on 2 gloo ranks (CPU), torchtitan's optimizer and LR-scheduler containers,
the manager driven as torchtitan's trainer drives it. Every comparison is bit for bit, per
rank, of the model's and the optimizer's tensors (each rank's shard). A resumed launch
starts from another random initialisation, so only a real load can make it agree.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")

import casckpt  # noqa: E402
from casckpt.errors import InvalidArgumentError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from doubles import Zygote  # noqa: E402

WORKER = Path(__file__).parents[1] / "helpers" / "torchtitan_worker.py"


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    zygote = Zygote(WORKER)
    yield zygote
    zygote.close()


def train(ranks: Zygote, *, ok: bool = True, world: int = 2, **args: Any) -> dict[str, Any]:
    args.setdefault("last", 20)
    reply = ranks.ask({"scenario": "tt_train", "world": world, "args": args, "timeout": 150},
                      timeout=180)
    if ok:
        assert reply["codes"] == [0] * world, "\n".join(e for e in reply["errors"] if e)
    return reply


def digests(reply: dict[str, Any]) -> list[dict[str, str]]:
    return [r["digest"] for r in reply["results"]]


@pytest.mark.slow  # ~12 s: five launches of two ranks
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_is_bit_exact_as_from_torchtitans_own_files(ranks: Zygote, tmp_path: Path,
                                                           async_mode: str) -> None:
    files, store = str(tmp_path / "files"), str(tmp_path / "store")
    whole = train(ranks, folder=str(tmp_path / "whole"), steps=15, async_mode=async_mode)
    train(ranks, folder=files, steps=10, async_mode=async_mode)
    from_files = train(ranks, folder=files, steps=15, seed=1, async_mode=async_mode)
    train(ranks, folder=str(tmp_path / "out"), store=store, steps=10, async_mode=async_mode)
    from_store = train(ranks, folder=str(tmp_path / "out"), store=store, steps=15, seed=1,
                       async_mode=async_mode)
    assert [r["loaded"] for r in from_store["results"]] == [10, 10]
    assert digests(from_store) == digests(from_files) == digests(whole)
    assert [r["lr_epoch"] for r in from_store["results"]] == [r["lr_epoch"] for r in whole["results"]]
    assert not (tmp_path / "out").exists()  # nothing went to torchtitan's folder
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("tiny")] == [15, 10, 5]
        assert opened.ops.check().ok


@pytest.mark.slow  # ~6 s: a launch of two ranks
def test_the_last_step_is_model_only_in_the_export_dtype_and_keep_latest_k_is_retention(
        ranks: Zygote, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    train(ranks, folder=str(tmp_path / "out"), store=store, steps=12, last=12, keep=2,
          export_dtype="bfloat16")
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("tiny")] == [12, 10, 5]  # nothing deleted in training
        assert opened.retention.get("tiny").keep_last == 2
        opened.retention.set("tiny", keep_within="7d")  # a policy set by hand ...
        last, full = opened.restore("tiny@12"), opened.restore("tiny@10")
    train(ranks, folder=str(tmp_path / "out"), store=store, steps=10, last=12, keep=3, load_step=10)
    with casckpt.open(store) as opened:  # ... is kept by a launch with keep_latest_k (and logged)
        assert opened.retention.get("tiny").keep_last is None
    assert not any(k.startswith("optimizer") for k in last) and "0.weight" in last
    assert last["0.weight"].dtype == torch.bfloat16 and full["0.weight"].dtype == torch.float32
    assert any(k.startswith("optimizer") for k in full) and full["train_state.step"] == 10


@pytest.mark.slow  # ~8 s: a killed launch waits out its peer
def test_a_killed_save_leaves_no_version_and_the_next_launch_resumes_the_one_before(  # and load_step
        ranks: Zygote, tmp_path: Path) -> None:
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    train(ranks, folder=out, store=store, steps=5)
    killed = train(ranks, ok=False, folder=out, store=store, steps=10, kill=1)
    assert killed["codes"][1] == -9 and killed["codes"][0] != 0
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("tiny")] == [5]
        assert opened.ops.check().ok
    missing = train(ranks, ok=False, folder=out, store=store, steps=10, load_step=7)
    assert all("RefNotFoundError" in e and "tiny@7" in e for e in missing["errors"])
    resumed = train(ranks, folder=out, store=store, steps=10, seed=3, load_step=5)
    assert [r["loaded"] for r in resumed["results"]] == [5, 5]
    whole = train(ranks, folder=str(tmp_path / "whole"), steps=10)
    assert digests(resumed) == digests(whole)


@pytest.mark.slow  # ~8 s: four launches of two ranks
def test_a_fork_resumes_its_fork_point_and_steps_before_it_are_the_parents(
        ranks: Zygote, tmp_path: Path) -> None:
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    train(ranks, folder=out, store=store, steps=15)  # tiny@5, @10, @15
    with casckpt.open(store) as opened:
        opened.fork("tiny@10", "tb")
    forked = train(ranks, folder=out, store=store, run="tb", steps=15, seed=4)
    assert [r["loaded"] for r in forked["results"]] == [10, 10]
    whole = train(ranks, folder=str(tmp_path / "whole"), steps=15)
    assert digests(forked) == digests(whole)  # the same data: it trained on from tiny@10
    earlier = train(ranks, folder=out, store=store, run="tb", steps=5, seed=5, load_step=5)
    assert [r["loaded"] for r in earlier["results"]] == [5, 5]  # tiny@5, before the fork
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("tb")] == [15]


@pytest.mark.slow  # ~6 s: three launches of two ranks
def test_a_run_switched_to_casckpt_resumes_from_its_step_folders_then_saves_to_the_store(
        ranks: Zygote, tmp_path: Path) -> None:
    folder, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    train(ranks, folder=folder, steps=5)  # torchtitan's own files: ckpt/checkpoint/step-5
    switched = train(ranks, folder=folder, store=store, steps=10, seed=2)
    assert [r["loaded"] for r in switched["results"]] == [5, 5]
    whole = train(ranks, folder=str(tmp_path / "whole"), steps=10)
    assert digests(switched) == digests(whole)
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("tiny")] == [10]


def test_bad_configs_are_refused_before_anything_is_saved(tmp_path: Path) -> None:
    from casckpt.integrations.torchtitan import CasckptCheckpointManager

    kwargs: dict[str, Any] = {"dataloader": None, "model_parts": [], "optimizers": None,
                              "lr_schedulers": None, "states": {}, "sd_adapter": None}
    pinned = CasckptCheckpointManager.Config(enable=True, store=str(tmp_path / "s"), run="r",
                                             async_mode="async_with_pinned_mem")
    with pytest.raises(InvalidArgumentError, match="async_mode='async'"):
        pinned.build(**kwargs)
    with pytest.raises(InvalidArgumentError, match="store="):
        CasckptCheckpointManager.Config(enable=True, run="r").build(**kwargs)
    assert not (tmp_path / "s").exists()
