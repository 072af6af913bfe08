"""Megatron-Core ``dist_checkpointing`` through casckpt: real gloo ranks, Megatron's own entry points.

Ranks are forked by tests/helpers/megatron_worker.py (dist_worker.py's zygote, with
Megatron-Core imported once); each builds the sharded state dict a tensor-parallel layout
would hold (``ShardedTensor.from_rank_offsets`` pieces split on dim 0 or 1 or replicated,
``ShardedObject`` values), or a tiny ``GPTModel`` (local layer spec, CPU initialisation),
and calls ``dist_checkpointing.save`` / ``load`` with the strategies of
:mod:`casckpt.integrations.megatron`. Megatron's ``torch_dist`` save strategy cannot run
on a CPU-only torch (its writer and finalize step call ``torch.cuda``): the comparison
writes torch_dist's format with DCP's FileSystemWriter instead, and loads it with
torch_dist's own load strategy. The test marked ``gpu`` runs torch_dist's own save strategy on
CUDA tensors (tests/device/run.sh on a lent GPU machine; skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

import casckpt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from dist_worker import CHUNK, PACK  # noqa: E402
from doubles import Zygote  # noqa: E402

from casckpt.integrations.megatron import directory_tag  # noqa: E402

WORKER = Path(__file__).parents[1] / "helpers" / "megatron_worker.py"


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    zygote = Zygote(WORKER)
    yield zygote
    zygote.close()


@pytest.fixture(scope="module")
def cuda_ranks() -> Iterator[Zygote]:
    """Ranks forked from a zygote that must not initialise CUDA: Megatron's torch_dist module asks
    ``torch.cuda.is_available()`` on import, which asks the driver (and a forked child then
    cannot) unless NVML answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCKPT_")}
    zygote = Zygote(WORKER, env={**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
    yield zygote
    zygote.close()


def launch(ranks: Zygote, scenario: str, world: int, *, ok: bool = True, backend: str = "gloo",
           **args: Any) -> dict[str, Any]:
    job = {"scenario": scenario, "world": world, "args": args, "timeout": 150, "backend": backend}
    reply = ranks.ask(job, timeout=180)
    if ok:
        assert reply["codes"] == [0] * world, "\n".join(e for e in reply["errors"] if e)
    return reply


def _store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    casckpt.open(path, chunk_size=CHUNK, pack_size=PACK).close()
    return path


@pytest.mark.slow  # ~11 s: four launches of two ranks
def test_save_and_load_bit_exact_as_torch_dist(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    ours, theirs = tmp_path / "ckpt" / "iter_0000007", tmp_path / "torch_dist" / "iter_0000007"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(ours), run="gpt", seed=7)
    launch(ranks, "mc_save", 2, path=str(store), dir=str(theirs), strategy="torch_dist", seed=7)
    loaded = launch(ranks, "mc_load", 2, path=str(store), dir=str(ours), seed=7)["results"]
    baseline = launch(ranks, "mc_load", 2, path=str(store), dir=str(theirs), strategy="torch_dist",
                      seed=7)["results"]
    assert [r["bad"] for r in loaded] == [[], []] == [r["bad"] for r in baseline]
    assert [r["iteration"] for r in loaded] == [107, 107] == [r["iteration"] for r in baseline]
    assert loaded[0]["shapes"]["decoder.proj"] == [[64, 512], "torch.bfloat16"]

    # the directory holds Megatron's two small files; the shards are in the store only
    assert sorted(p.name for p in ours.iterdir()) == ["common.pt", "metadata.json"]
    assert json.loads((ours / "metadata.json").read_text())["sharded_backend"] == "casckpt"
    assert any(p.suffix == ".distcp" for p in theirs.iterdir())
    with casckpt.open(store) as opened:
        version = opened.resolve("gpt@7")
        assert version.tags == (directory_tag(ours),)
        assert version.metadata["megatron.checkpoint_dir"] == str(ours)
        detail = opened.show("gpt@7", tensors=True)
        assert detail.world_size == 2 and detail.saved_with == "dcp"
        shards = {t.path: t.shards for t in detail.tensors}
        assert shards["decoder.w"] == 2 and shards["decoder.norm"] == 1  # the replica saved once
        assert opened.ops.check(read_data=True).ok


@pytest.mark.gpu
def test_on_cuda_torch_dists_own_save_and_casckpts_load_back_bit_exact(cuda_ranks: Zygote,
                                                                      tmp_path: Path) -> None:
    """One NCCL rank on the GPU, the sharded state's tensors on it (384 MiB): Megatron's
    torch_dist save strategy and casckpt's save the same state; each loads back bit for bit
    into CUDA tensors; the save times are printed (casckpt's over torch_dist's, with casckpt's
    default chunk and pack sizes)."""
    store = _store(tmp_path)
    common = {"path": str(store), "device": "cuda", "scale": 512,
              "open": {"chunk_size": 1 << 20, "pack_size": 64 << 20}}  # the defaults
    times = []
    for seed in (7, 8):  # the first round pays for first calls: the second is the measure
        ours, theirs = (tmp_path / kind / f"iter_{seed:07d}" for kind in ("ckpt", "torch_dist"))
        pair = [launch(cuda_ranks, "mc_save", 1, backend="nccl", dir=str(theirs), strategy="torch_dist",
                       seed=seed, **common),
                launch(cuda_ranks, "mc_save", 1, backend="nccl", dir=str(ours), run="gpt", seed=seed,
                       **common)]
        times.append([reply["results"][0] for reply in pair])
        for folder, strategy in ((ours, None), (theirs, "torch_dist")):
            (loaded,) = launch(cuda_ranks, "mc_load", 1, backend="nccl", dir=str(folder), seed=seed,
                               strategy=strategy, **common)["results"]
            assert (loaded["bad"], loaded["iteration"], loaded["devices"]) == ([], 100 + seed, ["cuda:0"])
        assert any(p.suffix == ".distcp" for p in theirs.iterdir())  # torch_dist's own files
        assert sorted(p.name for p in ours.iterdir()) == ["common.pt", "metadata.json"]
    torch_dist, ours_ = times[-1]
    print(f"save of {common['scale'] * 2 * 96 * 1024 * 4 / 2**20:.0f} MiB of CUDA tensors, one rank: "
          f"torch_dist {torch_dist['wall']:.3f} s wall ({torch_dist['cpu']:.3f} s CPU), casckpt "
          f"{ours_['wall']:.3f} s wall ({ours_['cpu']:.3f} s CPU); casckpt / torch_dist = "
          f"{ours_['wall'] / torch_dist['wall']:.2f} wall, {ours_['cpu'] / torch_dist['cpu']:.2f} CPU; "
          f"all rounds: {times}")
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("gpt")] == [8, 7]
        assert opened.ops.check(read_data=True).ok


@pytest.mark.slow  # ~9 s: three launches of two ranks
def test_every_replica_in_the_plan_saves_the_same_version(ranks: Zygote, tmp_path: Path) -> None:
    """keep_only_main_replica=False hands DCP every replica; it dedups them in its central plan
    (it failed with Megatron's assertion of the decentralized plan)."""
    store = _store(tmp_path)
    main_only, every = tmp_path / "a" / "iter_0000007", tmp_path / "b" / "iter_0000007"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(main_only), run="a", seed=7)
    launch(ranks, "mc_save", 2, path=str(store), dir=str(every), run="b", seed=7, main_only=False)
    loaded = launch(ranks, "mc_load", 2, path=str(store), dir=str(every), seed=7)["results"]
    assert [r["bad"] for r in loaded] == [[], []]
    with casckpt.open(store) as opened:
        assert opened.resolve("b@7").new_bytes == 0  # the same pieces as run a's, stored once
        shards = {t.path: t.shards for t in opened.show("b@7", tensors=True).tensors}
        assert shards["decoder.norm"] == 1


def test_reshard_on_load_and_a_ref_choosing_the_version(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    first, second = tmp_path / "ckpt" / "iter_0000001", tmp_path / "ckpt" / "iter_0000002"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(first), run="gpt", seed=1, objects=False)
    launch(ranks, "mc_save", 2, path=str(store), dir=str(second), run="gpt", seed=2, objects=False)
    one = launch(ranks, "mc_load", 1, path=str(store), dir=str(first), seed=1, objects=False)
    assert one["results"][0]["bad"] == []  # TP 2 -> 1: every piece assembled on one rank
    swapped = launch(ranks, "mc_load", 2, path=str(store), dir=str(second), seed=2, objects=False,
                     axis={"decoder.w": 1, "decoder.proj": 0, "optimizer.exp_avg": 1})
    assert [r["bad"] for r in swapped["results"]] == [[], []]  # split on the other dimension
    by_ref = launch(ranks, "mc_load", 2, path=str(store), dir=str(second), seed=1, objects=False,
                    ref="casckpt://gpt@1")  # the shards of step 1, common.pt of the directory
    assert [r["bad"] for r in by_ref["results"]] == [[], []]
    assert [r["iteration"] for r in by_ref["results"]] == [102, 102]
    third = tmp_path / "ckpt" / "iter_0000003"  # the same state again: every chunk deduplicated
    launch(ranks, "mc_save", 2, path=str(store), dir=str(third), run="gpt", seed=2, objects=False)
    with casckpt.open(store) as opened:
        again = opened.resolve("gpt@3")
        assert again.logical_bytes > 0 and again.new_bytes == 0


@pytest.mark.slow  # ~10 s: a GPTModel built on five ranks in all
def test_a_tiny_gpt_model_round_trips_and_reshards_as_torch_dist(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    ours, theirs = tmp_path / "ckpt" / "iter_0000005", tmp_path / "torch_dist" / "iter_0000005"
    common = {"path": str(store), "seed": 5}
    saved = launch(ranks, "mc_gpt", 2, dir=str(ours), action="save", **common)["results"]
    assert saved == launch(ranks, "mc_gpt", 2, dir=str(theirs), action="save", strategy="torch_dist",
                           **common)["results"]  # the same model on both sides
    back = launch(ranks, "mc_gpt", 2, dir=str(ours), action="load", **common)["results"]
    assert [r["digests"] for r in back] == [r["digests"] for r in saved]  # TP 2 -> 2, bit for bit
    assert all(_random_weights(r) <= _changed(r) for r in back)  # it replaced another seed's weights
    one = launch(ranks, "mc_gpt", 1, dir=str(ours), action="load", **common)["results"][0]
    baseline = launch(ranks, "mc_gpt", 1, dir=str(theirs), action="load", strategy="torch_dist",
                      **common)["results"][0]
    assert one["digests"] == baseline["digests"]  # TP 2 -> 1 as torch_dist reshards it
    assert len(_random_weights(one)) >= 8 and _random_weights(one) <= _changed(one)


def _random_weights(result: dict[str, Any]) -> set[str]:
    """The parameters initialised at random (norms start at ones, biases at zeros, whatever the seed)."""
    return {k for k in result["digests"] if k.endswith(".weight") and "norm" not in k}


def _changed(result: dict[str, Any]) -> set[str]:
    return {k for k, v in result["digests"].items() if result["before"][k] != v}


def test_a_directory_two_runs_saved_to_loads_the_newest_save(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = tmp_path / "ckpt" / "iter_0000001"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(folder), run="a", seed=1)
    launch(ranks, "mc_save", 2, path=str(store), dir=str(folder), run="b", seed=2)
    loaded = launch(ranks, "mc_load", 2, path=str(store), dir=str(folder), seed=2)["results"]
    assert [r["bad"] for r in loaded] == [[], []]  # run b's shards, not the older run a's
    assert [r["iteration"] for r in loaded] == [102, 102]


@pytest.mark.slow  # ~18 s: a killed launch waits out its peer
def test_a_killed_save_into_a_reused_directory_refuses_to_mix(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = tmp_path / "ckpt" / "latest"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(folder), run="gpt", step=1, seed=1)
    killed = launch(ranks, "mc_save", 2, ok=False, path=str(store), dir=str(folder), run="gpt",
                    step=2, seed=2, kill=1)  # Megatron wrote step 2's common.pt; no version 2
    assert killed["codes"][1] == -9
    mixed = launch(ranks, "mc_load", 2, ok=False, path=str(store), dir=str(folder), seed=1)
    assert all("MixedCheckpointError" in e and "casckpt://gpt@1" in e for e in mixed["errors"])
    # named explicitly, the version's shards go with the directory's common.pt, as documented
    by_ref = launch(ranks, "mc_load", 2, path=str(store), dir=str(folder), seed=1, ref="casckpt://gpt@1")
    assert [r["bad"] for r in by_ref["results"]] == [[], []]
    assert [r["iteration"] for r in by_ref["results"]] == [102, 102]


def test_a_killed_save_leaves_no_version(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    first, second = tmp_path / "ckpt" / "iter_0000001", tmp_path / "ckpt" / "iter_0000002"
    launch(ranks, "mc_save", 2, path=str(store), dir=str(first), run="gpt", seed=1)
    killed = launch(ranks, "mc_save", 2, ok=False, path=str(store), dir=str(second), run="gpt",
                    seed=2, kill=1)
    assert killed["codes"][1] == -9 and killed["codes"][0] != 0
    assert not (second / "metadata.json").exists()  # Megatron never finished the directory
    with casckpt.open(store) as opened:
        assert [v.step for v in opened.log("gpt")] == [1]
        assert opened.ops.check().ok
    resumed = launch(ranks, "mc_load", 2, path=str(store), dir=str(first), seed=1)
    assert [r["bad"] for r in resumed["results"]] == [[], []]


def test_bad_input_is_refused_with_typed_errors(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    reply = launch(ranks, "mc_refusals", 1, path=str(store), dir=str(tmp_path / "ckpt"))
    errors = reply["results"][0]
    assert errors["object_with_tensor"][0] == "UnsupportedStateError"
    assert errors["no_step"][0] == "InvalidArgumentError" and "iter_NNNNNNN" in errors["no_step"][1]
    assert errors["never_saved"][0] == "CheckpointPathNotFoundError"
    with casckpt.open(store) as opened:
        assert opened.log() == []


def test_one_ranks_bad_object_key_fails_every_rank_together(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    reply = launch(ranks, "mc_bad_key", 2, path=str(store), dir=str(tmp_path / "ckpt" / "iter_0000001"))
    errors = [r["error"] for r in reply["results"]]  # rank 0's object is fine: it must not wait
    assert [e[0] for e in errors] == ["InvalidNameError", "InvalidNameError"], errors
    assert all("loader/state" in e[1] for e in errors)
    with casckpt.open(store) as opened:
        assert opened.log() == []


def test_a_read_only_store_is_refused_before_megatron_writes(tmp_path: Path) -> None:
    from casckpt.integrations.megatron import CasckptSaveStrategy

    store = _store(tmp_path)
    with casckpt.open(store, read_only=True) as opened, pytest.raises(casckpt.errors.ReadOnlyStoreError,
                                                                       match="read-only"):
        CasckptSaveStrategy(opened, run="gpt")


def test_import_casckpt_imports_no_megatron() -> None:
    code = "import sys, casckpt, casckpt.integrations\nprint('megatron' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_objects_holding_tensors_round_trip_bit_exact(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = tmp_path / "ckpt" / "iter_0000003"
    launch(ranks, "mc_objects", 2, path=str(store), dir=str(folder), seed=3, action="save")
    back = launch(ranks, "mc_objects", 2, path=str(store), dir=str(folder), seed=3, action="load")
    assert [r["bad"] for r in back["results"]] == [[], []]  # RNG states, _extra_state, mixed leaves
    extra = "decoder.layers.linear_qkv._extra_state"
    assert back["results"][0]["metadata"] == [  # as torch_dist lists them: no object's tensors
        f"{extra}/shard_0_3", f"{extra}/shard_1_3", f"{extra}/shard_2_3", "decoder.norm", "decoder.proj",
        "decoder.w", "mixed/shard_0_2", "mixed/shard_1_2", "optimizer.exp_avg", "rng_state/shard_0.0_1.2",
        "rng_state/shard_0.1_1.2", "shared/shard_0_1"]
    with casckpt.open(store) as opened:
        paths = {t.path for t in opened.show("gpt@3", tensors=True).tensors}
        assert "rng_state%2Fshard_0.1_1.2%t2" in paths  # rank 1's torch RNG state, as a tensor
        assert opened.ops.check(read_data=True).ok
    # the same RNG states, asked for by the other ranks: objects are found by key and offset
    swapped = launch(ranks, "mc_objects", 2, path=str(store), dir=str(folder), seed=3, action="load",
                     rng_from=[[1], [0]])
    assert [r["bad"] for r in swapped["results"]] == [[], []]


def test_objects_holding_tensors_load_onto_another_layout(ranks: Zygote, tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = tmp_path / "ckpt" / "iter_0000004"
    launch(ranks, "mc_objects", 2, path=str(store), dir=str(folder), seed=4, action="save")
    one = launch(ranks, "mc_objects", 1, path=str(store), dir=str(folder), seed=4, action="load",
                 rng_from=[[0, 1]], saved_world=2)  # TP 2 -> 1: tensors resharded, both RNG states
    assert one["results"][0]["bad"] == []


@pytest.mark.parametrize("kind", ["dtype_key", "object"])
def test_an_object_casckpt_cannot_store_fails_every_rank_before_writing(ranks: Zygote, tmp_path: Path,
                                                                         kind: str) -> None:
    store = _store(tmp_path)
    folder = tmp_path / "ckpt" / "iter_0000001"
    reply = launch(ranks, "mc_bad_object", 2, path=str(store), dir=str(folder), kind=kind)
    errors = [r["error"] for r in reply["results"]]  # only rank 1's object is bad
    assert [e[0] for e in errors] == ["UnsupportedStateError"] * 2, errors
    assert all("'optimizer_state/shard_1_2'" in e[1] and "never pickles" in e[1] for e in errors)
    assert not (folder / "metadata.json").exists()
    with casckpt.open(store) as opened:
        assert opened.log() == []
        assert opened.ops.check().ok
