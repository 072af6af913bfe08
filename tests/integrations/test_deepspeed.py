"""casckpt.integrations.deepspeed: real DeepSpeed engines (CPU accelerator, 2 gloo ranks).

Each test launches two ranks of tests/integrations/deepspeed_worker.py (ZeRO-1/2/3, AdamW with
torch_adam, WarmupLR, a tiny MLP) and compares what they report: a resume from casckpt
against a resume from DeepSpeed's own TorchCheckpointEngine, bit for bit. The tests marked
``gpu`` run the same comparison on DeepSpeed's CUDA accelerator and NCCL (tests/device/run.sh
on a lent GPU machine; skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import casckpt  # noqa: E402

WORKER = Path(__file__).with_name("deepspeed_worker.py")
WORLD = 2
# a rank's ZeRO optimizer file, by precision: DeepSpeed names bf16's apart
_OPTIM_FILE = {"fp32": "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               "fp16": "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               "bf16": "bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(scenario: str, tmp_path: Path, *, ok: bool = True, world: int = WORLD, device: str = "cpu",
           **args: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks (``device`` "cuda": on GPUs 0..world-1, NCCL); their
    reports (``{"code": ...}`` for a rank that wrote none)."""
    out = tmp_path / f"out-{scenario}"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": device, "CASCKPT_TEST_DEVICE": device, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as sink:  # a file, not a pipe: a full pipe would stall a rank
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), scenario, json.dumps({**args, "out": str(out)}), str(out)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=sink, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait(timeout=300)
    codes = [p.returncode for p in procs]
    if ok and any(codes):
        pytest.fail(f"{scenario}: exit codes {codes}\n" + "\n".join(log.read_text()[-4000:] for log in logs))
    reports = []
    for r in range(world):
        path = out / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"code": codes[r]})
    return reports


@pytest.mark.slow  # ~15 s a test on an idle 2-core machine: DeepSpeed starts 3 engines a rank
@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"),
                                                  (2, "fp16")])
def test_resume_from_casckpt_matches_torch_checkpoint_engine_bit_for_bit(tmp_path: Path, stage: int,
                                                                         precision: str) -> None:
    """ZeRO-3 partitions the parameters too: each rank saves its own model-states file, and
    the resumed training (``continued``) shows the partitions came back. fp16 keeps a dynamic
    loss scaler (its scale moved from 2**8 by the save) in the optimizer state."""
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    reports = launch("compare", tmp_path, stage=stage, store=url, torch_dir=str(tmp_path / "torch"),
                     ds_dir=str(tmp_path / "ds"), precision=precision)
    dtype = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert [r["ran_on"]["dtype"] for r in reports] == [dtype] * WORLD
    if precision == "fp16":
        assert [r["ran_on"]["loss_scale"] for r in reports] == [512.0] * WORLD
    for rank, report in enumerate(reports):
        assert report["casckpt_loaded"] == report["torch_loaded"], rank
        assert report["casckpt_loaded"] == report["saved"], rank
        assert report["casckpt_continued"] == report["torch_continued"] == report["continued"], rank
    where = ({"mp_rank_00_model_states.pt": 0} if stage < 3 else
             {"zero_pp_rank_0_mp_rank_00_model_states.pt": 0, "zero_pp_rank_1_mp_rank_00_model_states.pt": 1})
    optim = _OPTIM_FILE[precision]
    where |= {optim.format(rank=0): 0, optim.format(rank=1): 1}
    assert reports[0]["files"] == ["latest", *sorted(f"t3/{name}" for name in where)]
    with casckpt.open(url) as store:
        (version,) = store.log("ds")
        assert (version.step, version.metadata["deepspeed.tag"]) == (3, "t3")
        assert version.metadata["deepspeed.files"] == where
        assert store.ops.check(read_data=True).ok
    for name in where:
        marker = json.loads((tmp_path / "ds" / "t3" / name).read_text())
        assert (marker["ref"], marker["file"]) == ("casckpt://ds@3", name)


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "background"), [("bf16", False), ("fp16", False), ("bf16", True)])
def test_on_cuda_and_nccl_a_resume_from_casckpt_matches_torch_checkpoint_engine(
        tmp_path: Path, precision: str, background: bool) -> None:
    """ZeRO-2 on one GPU (one NCCL rank: two cannot share a GPU), bf16 or fp16 (its dynamic loss
    scaler in the optimizer state): the saved state holds CUDA tensors; both resumes, and the
    training after them, match bit for bit; ``background`` copies them to host memory first."""
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    (report,) = launch("compare", tmp_path, world=1, device="cuda", stage=2, precision=precision, store=url,
                       torch_dir=str(tmp_path / "torch"), ds_dir=str(tmp_path / "ds"), background=background)
    ran_on = report["ran_on"]
    assert (ran_on["device"], ran_on["backend"]) == ("cuda:0", "nccl"), ran_on
    assert ran_on["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision], ran_on
    if precision == "fp16":  # the scaler moved from 2**8: its state is part of what must come back
        assert ran_on["loss_scale"] not in (None, 1.0, 256.0), ran_on
    assert report["casckpt_loaded"] == report["torch_loaded"] == report["saved"]
    assert report["casckpt_continued"] == report["torch_continued"] == report["continued"]
    assert report["files"] == sorted(["latest", "t3/mp_rank_00_model_states.pt",
                                      "t3/" + _OPTIM_FILE[precision].format(rank=0)])
    with casckpt.open(url) as store:
        (version,) = store.log("ds")
        assert (version.step, version.metadata["deepspeed.tag"]) == (3, "t3")
        assert store.ops.check(read_data=True).ok


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_no_version_and_the_previous_one_resumes(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    ds_dir = tmp_path / "ds"
    reports = launch("killed", tmp_path, ok=False, stage=2, store=url, ds_dir=str(ds_dir))
    assert all("unexpected" not in report for report in reports)
    assert reports[1].get("code") == -9
    out = tmp_path / "out-killed"
    saved = [json.loads((out / f"saved{r}.json").read_text())["saved"] for r in range(WORLD)]
    with casckpt.open(url) as store:
        assert [v.step for v in store.log("ds")] == [3]
    assert (ds_dir / "latest").read_text() == "global_step3"
    assert not (ds_dir / "global_step5" / "mp_rank_00_model_states.pt").exists()
    resumed = launch("resume", tmp_path, stage=2, store=url, ds_dir=str(ds_dir))
    for rank, report in enumerate(resumed):
        assert report["loaded"] == saved[rank], rank
        assert report["versions"] == [3]


@pytest.mark.slow
def test_a_background_commit_stores_the_state_of_the_save_while_training_goes_on(tmp_path: Path) -> None:
    """``background=True``: the commit starts a second after ``save_checkpoint`` returned, once
    two more training steps changed every parameter and moment; the version still holds the
    state at the save (the files were copied), and resumes bit for bit like DeepSpeed's own."""
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    reports = launch("compare", tmp_path, stage=2, store=url, torch_dir=str(tmp_path / "torch"),
                     ds_dir=str(tmp_path / "ds"), background=True)
    for rank, report in enumerate(reports):
        assert not report["committed_during_training"], rank  # the commit came after the steps
        assert report["casckpt_loaded"] == report["torch_loaded"] == report["saved"], rank
        assert report["casckpt_continued"] == report["torch_continued"] == report["continued"], rank
    with casckpt.open(url) as store:
        assert [v.step for v in store.log("ds")] == [3]


@pytest.mark.slow
def test_a_rank_killed_in_its_background_commit_fails_the_save_on_the_others(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    ds_dir = tmp_path / "ds"
    reports = launch("killed_in_background", tmp_path, ok=False, stage=2, store=url, ds_dir=str(ds_dir))
    assert reports[1].get("code") == -9
    assert reports[0]["save_returned"] and reports[0]["wait"] == "GroupCommitError"
    assert reports[0]["versions"] == [3]
    saved = json.loads((tmp_path / "out-killed_in_background" / "saved0.json").read_text())["saved"]
    assert not (ds_dir / "global_step5" / "mp_rank_00_model_states.pt").exists()  # no marker
    assert (ds_dir / "latest").read_text() == "global_step5"  # DeepSpeed wrote it at once
    resumed = launch("resume", tmp_path, stage=2, store=url, ds_dir=str(ds_dir))
    assert resumed[0]["loaded"] == saved and resumed[0]["versions"] == [3]


@pytest.mark.slow
def test_a_script_ending_with_a_background_commit_in_flight_waits_for_it(tmp_path: Path) -> None:
    """No close(): the commit still runs when the script ends; it is saved, not lost to Python
    stopping its thread pools at exit (which failed it before, with exit code 0)."""
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    ds_dir = tmp_path / "ds"
    reports = launch("exit_in_flight", tmp_path, stage=2, store=url, ds_dir=str(ds_dir))
    assert all(r["in_flight"] for r in reports)
    with casckpt.open(url) as store:
        assert [v.step for v in store.log("ds")] == [2]
        assert store.ops.check(read_data=True).ok
    assert json.loads((ds_dir / "global_step2" / "mp_rank_00_model_states.pt").read_text())["ref"] == "casckpt://ds@2"
    resumed = launch("resume", tmp_path, stage=2, store=url, ds_dir=str(ds_dir))
    assert [r["loaded"] for r in resumed] == [r["saved"] for r in reports]


@pytest.mark.slow
def test_a_background_commit_failing_on_one_rank_fails_the_next_save_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's markers cannot be written (a full disk) after the version is published: the
    next save raises on rank 1 (its own error) and on rank 0 (naming rank 1), and no rank
    waits for the other in the save's first collective."""
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    reports = launch("marker_fails", tmp_path, stage=2, store=url, ds_dir=str(tmp_path / "ds"))
    assert [r["next_save"] for r in reports] == ["GroupCommitError", "OSError"]
    assert [r["versions"] for r in reports] == [[2], [2]]


@pytest.mark.slow
def test_after_a_rollback_a_resave_is_refused_on_every_rank_and_a_fork_resumes(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    reports = launch("rollback", tmp_path, stage=2, store=url, ds_dir=str(tmp_path / "ds"))
    assert [r["resave"] for r in reports] == ["VersionExistsError"] * WORLD
    assert [r["refused"] for r in reports] == ["UnsupportedStateError", "GroupCommitError"]
    for report in reports:
        assert report["released"]
        assert report["steps"] == {"ds": [4, 3, 2], "ds-b": [3]}
        # what DeepSpeed returns first: the path of the model file it loaded
        assert report["resumed_tag"].endswith("/global_step3/mp_rank_00_model_states.pt")
        del report["loaded"]["rng"], report["saved"]["rng"]  # the global RNG: not in this save
        assert report["loaded"] == report["saved"]


@pytest.mark.slow
def test_frozen_layer_is_stored_once_across_saves(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    casckpt.open(url).close()
    reports = launch("dedup", tmp_path, stage=2, store=url, ds_dir=str(tmp_path / "ds"), frozen=512)
    first, second = reports[0]["saves"]
    assert first["logical"] == second["logical"] > 512 * 16 * 4
    assert second["new"] < first["new"] / 4


@pytest.mark.slow
def test_ds_to_universal_reads_a_version_exported_as_files(tmp_path: Path) -> None:
    """DeepSpeed's universal-checkpoint conversion of a stored version (export_files) gives what
    it gives from TorchCheckpointEngine's folder, tensor for tensor, and one rank loads it (a
    reshard from 2 ranks to 1) with the weights that were saved."""
    import torch

    from casckpt.integrations.deepspeed import export_files

    url = str(tmp_path / "store")
    casckpt.open(url).close()
    (saved, _) = launch("compare", tmp_path, stage=2, store=url, torch_dir=str(tmp_path / "torch"),
                        ds_dir=str(tmp_path / "ds"))
    with casckpt.open(url) as store:
        folder = export_files(store, "ds@3", tmp_path / "exported")
    outputs = {}
    for name, source in (("torch", tmp_path / "torch" / "t3"), ("casckpt", folder)):
        outputs[name] = tmp_path / f"universal-{name}" / "t3"
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(source), "--output_folder", str(outputs[name]), "--num_extract_workers", "1",
                        "--num_merge_workers", "1", "--inject_missing_state"],  # not a Megatron model
                       check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    found = sorted(p.relative_to(outputs["torch"]) for p in outputs["torch"].rglob("*.pt"))
    assert found
    assert found == sorted(p.relative_to(outputs["casckpt"]) for p in outputs["casckpt"].rglob("*.pt"))
    for relative in found:
        if relative.parts[0] != "zero":
            continue  # the model-states copies hold the folder's own path
        a = torch.load(outputs["torch"] / relative, weights_only=False)
        b = torch.load(outputs["casckpt"] / relative, weights_only=False)
        assert _same(a, b), relative
    (one,) = launch("universal", tmp_path, world=1, stage=2, load_dir=str(outputs["casckpt"].parent),
                    tag="t3")
    assert one["loaded"]["module"] == saved["saved"]["module"]
    assert one["loaded"]["steps"] == "3"


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "__dict__"):  # the LossScaler: no __eq__
        return type(a) is type(b) and _same(vars(a), vars(b))
    return bool(a == b)
