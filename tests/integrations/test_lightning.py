"""The Lightning plugin: ModelCheckpoint's saves and removals become commits and deletions.

Real Lightning (``lightning.pytorch``) on CPU with a one-layer model. Lightning is
deterministic here (no shuffling, no dropout, a fixed seed), so a resumed fit is compared
with an uninterrupted one bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import io
import math

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    ModelCheckpoint,  # noqa: E402
    StochasticWeightAveraging,
)

import casckpt  # noqa: E402
from casckpt.errors import (  # noqa: E402
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    RefNotFoundError,
    UnsupportedStateError,
    VersionExistsError,
)
from casckpt.integrations.lightning import CasckptCheckpointIO  # noqa: E402
from casckpt.integrations.lightning_io import from_plain, to_plain  # noqa: E402

BATCHES_PER_EPOCH = 4


class Opaque:
    """Not plain data: a checkpoint holding one must be refused."""


class Regressor(L.LightningModule):
    """y = sum(x) with one Linear and Adam; records the weights it saved at each step."""

    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["extra"])
        self.lin = nn.Linear(4, 1)
        self.extra = extra
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.lin(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * BATCHES_PER_EPOCH, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                           batch_size=8)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.saved[checkpoint["global_step"]] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
        if self.extra is not None:
            checkpoint["extra"] = self.extra


def trainer(plugin: CasckptCheckpointIO, root: Path, *callbacks: Any, **limits: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, plugins=[plugin], callbacks=list(callbacks),
                     default_root_dir=root, **limits)


def model(seed: int = 0, **kwargs: Any) -> Regressor:
    L.seed_everything(seed, verbose=False)
    return Regressor(**kwargs)


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "background"])
def test_save_top_k_removals_become_deletions(tmp_path: Path, block: bool) -> None:
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "fit", block=block)
        ckpts = tmp_path / "ckpts"
        cb = ModelCheckpoint(dirpath=ckpts, save_top_k=2, monitor="train_loss", every_n_train_steps=2,
                             save_last=True)
        m = model()
        trainer(plugin, tmp_path, cb, max_steps=12).fit(m)

        saved_steps = sorted(m.saved)
        assert saved_steps == [2, 4, 6, 8, 10, 12]
        kept = {int(Path(p).stem.split("step=")[1]) for p in cb.best_k_models}
        live = {v.step for v in store.log("fit")}
        assert live == kept | {12}  # the top 2, and last.ckpt's step
        assert len(kept) == 2
        for step in set(saved_steps) - live:  # removed by ModelCheckpoint: deleted, recoverable
            with pytest.raises(RefNotFoundError):
                store.resolve(f"fit@{step}")
            path = ckpts / f"epoch={(step - 1) // BATCHES_PER_EPOCH}-step={step}.ckpt"
            with pytest.raises(CheckpointPathNotFoundError, match="casckpt://fit@latest"):
                plugin.load_checkpoint(path)
        for path in [*cb.best_k_models, cb.last_model_path]:  # each path ModelCheckpoint reported
            loaded = plugin.load_checkpoint(path)
            for key, tensor in m.saved[loaded["global_step"]].items():
                assert torch.equal(loaded["state_dict"][key], tensor)
        last = store.resolve("fit@latest")
        assert last.step == 12 and len(last.tags) == 2  # epoch=2-step=12.ckpt and last.ckpt
        assert last.metadata["lightning.path"].endswith("step=12.ckpt")
        assert plugin.load_checkpoint(cb.best_model_path)["callbacks"]  # bookkeeping comes back
        assert not ckpts.exists() and not list(tmp_path.rglob("*.ckpt"))  # nothing on local disk
        undone = store.undelete(f"fit@{min(set(saved_steps) - live)}")  # soft deletion
        assert undone.step == min(set(saved_steps) - live)
        assert store.ops.check().ok


def test_resume_from_the_store_matches_an_uninterrupted_fit(tmp_path: Path) -> None:
    def fit(plugin: CasckptCheckpointIO, epochs: int, ckpt_path: str | None = None) -> L.Trainer:
        t = trainer(plugin, tmp_path, ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1),
                    max_epochs=epochs)
        t.fit(model(seed=1 if ckpt_path else 0), ckpt_path=ckpt_path)  # other weights, unless restored
        return t

    with casckpt.open(tmp_path / "store") as store:
        whole = fit(CasckptCheckpointIO(store, "whole"), 4)
        first = fit(CasckptCheckpointIO(store, "split"), 2)
        assert store.resolve("split@latest").step == 2 * BATCHES_PER_EPOCH
        reader = CasckptCheckpointIO(store, "split")  # as a new process would: nothing in memory
        by_path = reader.load_checkpoint(first.checkpoint_callback.best_model_path)
        by_ref = reader.load_checkpoint("casckpt://split@latest")
        assert by_path["global_step"] == by_ref["global_step"] == 2 * BATCHES_PER_EPOCH
        assert all(torch.equal(by_path["state_dict"][k], v) for k, v in by_ref["state_dict"].items())
        resumed = fit(CasckptCheckpointIO(store, "split"), 4, ckpt_path="casckpt://split@latest")

        assert resumed.global_step == whole.global_step == 4 * BATCHES_PER_EPOCH
        assert sorted(resumed.lightning_module.saved) == [12, 16]  # it went on from step 8
        a, b = whole.lightning_module.state_dict(), resumed.lightning_module.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        oa, ob = whole.optimizers[0].state_dict(), resumed.optimizers[0].state_dict()
        assert oa["param_groups"] == ob["param_groups"]
        for i, state in oa["state"].items():
            assert all(torch.equal(v, ob["state"][i][k]) for k, v in state.items())
        # the whole run's last version and the resumed run's last one hold the same tensors
        assert store.diff("whole@latest", "split@latest").changed == ()
        assert store.ops.check().ok


def test_the_first_launch_with_latest_starts_from_scratch_and_a_restart_resumes(tmp_path: Path) -> None:
    """One ``ckpt_path`` for the first launch and every restart, as Lightning's "last"."""
    def fit(store: casckpt.Store, run: str, steps: int, ckpt_path: str | None) -> L.Trainer:
        t = trainer(CasckptCheckpointIO(store, run), tmp_path,
                    ModelCheckpoint(dirpath=tmp_path / run, every_n_train_steps=2, save_top_k=-1),
                    max_steps=steps)
        t.fit(model(), ckpt_path=ckpt_path)
        return t

    with casckpt.open(tmp_path / "store") as store:
        with pytest.warns(UserWarning, match=r"run 'r' has no version yet.*from scratch"):
            first = fit(store, "r", 4, "casckpt://r@latest")
        fresh = fit(store, "fresh", 4, None)  # no ckpt_path at all
        a, b = first.lightning_module.state_dict(), fresh.lightning_module.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)  # nothing was loaded: trained from scratch
        assert sorted(first.lightning_module.saved) == [2, 4]
        assert [v.step for v in store.log("r")] == [4, 2]

        restarted = fit(store, "r", 8, "casckpt://r@latest")  # the same line, after a restart
        assert sorted(restarted.lightning_module.saved) == [6, 8]  # went on from step 4

        store.fork("r@4", "child")  # a fork with no version of its own starts from its fork point
        for ref, why in (("r@99", "no version at step 99"), ("tag:nope", "no tag"),
                         ("other@latest", "no run named"), ("child@latest", "forked from r@4")):
            with pytest.raises(RefNotFoundError, match=why):
                fit(store, "child" if ref.startswith("child") else "r", 10, f"casckpt://{ref}")
        assert store.ops.check().ok


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "background"])
def test_a_non_plain_object_is_refused_with_its_path_and_nothing_is_committed(tmp_path: Path,
                                                                              block: bool) -> None:
    with casckpt.open(tmp_path / "store") as store:
        t = trainer(CasckptCheckpointIO(store, "bad", block=block), tmp_path,
                    ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2), max_steps=2)
        with pytest.raises(UnsupportedStateError, match=r"extra\.thing") as err:
            t.fit(model(extra={"thing": Opaque(), "fine": 1}))
        assert "Opaque" in str(err.value) and "plain" in str(err.value)
        assert store.runs() == []
        assert not list(tmp_path.rglob("*.ckpt"))
        assert store.ops.check().ok


def test_errors_name_what_to_do(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "r")
        with pytest.raises(CheckpointPathNotFoundError, match=r"casckpt://r@latest"):
            plugin.load_checkpoint(tmp_path / "never.ckpt")
        with pytest.raises(RefNotFoundError, match="no run named"):
            plugin.load_checkpoint("casckpt://nothing@latest")
        with pytest.raises(InvalidArgumentError, match="global_step"):
            plugin.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt")
        with pytest.raises(InvalidArgumentError, match="storage_options"):
            plugin.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={"a": 1})
        with pytest.raises(InvalidArgumentError, match="device"):
            plugin.load_checkpoint("casckpt://r@latest", map_location=lambda s, _: s)

        plugin.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, tmp_path / "a.ckpt")
        plugin.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, tmp_path / "last.ckpt")
        assert len(store.log("r")) == 1 and len(store.resolve("r@3").tags) == 2
        # a second training reusing the run name must not attach its step to the old version
        with pytest.raises(VersionExistsError, match=r"casckpt delete r@3"):
            CasckptCheckpointIO(store, "r").save_checkpoint({"global_step": 3}, tmp_path / "b.ckpt")
        # a removal while last.ckpt still names the version keeps it; the last name drops it
        plugin.remove_checkpoint(tmp_path / "a.ckpt")
        assert store.resolve("r@3").step == 3
        with pytest.raises(CheckpointPathNotFoundError):
            plugin.load_checkpoint(tmp_path / "a.ckpt")
        plugin.save_checkpoint({"global_step": 5, "w": torch.zeros(2)}, tmp_path / "last.ckpt")
        assert [v.step for v in store.log("r")] == [5]  # last.ckpt moved: step 3 is unnamed
        plugin.remove_checkpoint(tmp_path / "gone.ckpt")  # like a missing file: nothing happens
        assert torch.equal(plugin.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.zeros(2))
        assert store.ops.check().ok


def test_path_keyed_dicts_and_dict_subclasses_round_trip() -> None:
    from collections import OrderedDict

    from lightning.fabric.utilities.data import AttributeDict

    tree = {"hp": AttributeDict(lr=0.1), "sd": OrderedDict(w=torch.ones(1)),
            "best": {"/tmp/x/epoch=0.ckpt": torch.tensor(1.0)}, "t": (1, [2, {"a": None}])}
    plain = to_plain(tree)
    assert type(plain["hp"]) is dict and type(plain["sd"]) is dict
    back = from_plain(plain)
    assert back["hp"] == {"lr": 0.1} and back["t"] == (1, [2, {"a": None}])
    assert list(back["best"]) == ["/tmp/x/epoch=0.ckpt"]


def test_the_pytorch_lightning_package_takes_its_own_flavour(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from casckpt.integrations.pytorch_lightning import CasckptCheckpointIO as PLCheckpointIO

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    with casckpt.open(tmp_path / "store") as store:
        t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, max_steps=2, default_root_dir=tmp_path,
                       plugins=[PLCheckpointIO(store, "pl")],
                       callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts")])
        t.fit(Tiny(), data)
        assert [v.step for v in store.log("pl")] == [2]
        assert not list(tmp_path.rglob("*.ckpt"))


def test_import_casckpt_imports_no_lightning() -> None:
    code = ("import sys, casckpt, casckpt.integrations\n"
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


lightning_model = model
lightning_trainer = trainer


def torch_round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), where


def test_lightning_odd_checkpoint_dicts_round_trip_as_torch_save_gives_them(tmp_path: Path) -> None:
    """Shared storage, views, bf16, int keys, tuples, None, NaN, -0.0 held; a user dict whose one
    key is ``casckpt.pairs`` (the plugin's own escape key) came back as a different dict."""
    base = torch.arange(12, dtype=torch.float32)
    checkpoint = {
        "global_step": 1, "base": base, "view": base[2:6], "t": base.view(3, 4).t(),
        "bf16": torch.tensor([1.5, float("nan"), -0.0], dtype=torch.bfloat16),
        "ints": {1: "one", 2: None}, "tup": (1, 2.5, None, (float("nan"),)), "neg0": -0.0,
        "user": {"casckpt.pairs": [("k", 1)]}, "user2": {"casckpt.pairs": [["a/b", torch.ones(1)]]},
    }
    want = torch_round_trip(checkpoint)
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "r")
        plugin.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
        got = CasckptCheckpointIO(store, "r").load_checkpoint(tmp_path / "x.ckpt")
    same(want["user"], got["user"], "user")
    same(want["user2"], got["user2"], "user2")
    for key in want:
        if key not in ("t", "view"):  # torch.save keeps views' strides; the store packs them
            same(want[key], got[key], key)
        else:
            assert torch.equal(want[key], got[key]) and want[key].dtype == got[key].dtype


def test_lightning_a_same_step_save_with_other_weights_is_not_silently_the_old_ones(
        tmp_path: Path) -> None:
    """Was: a later save at a step the plugin already committed only tagged that version;
    StochasticWeightAveraging swaps the averaged weights in at train end without a step, so
    ``trainer.save_checkpoint('swa.ckpt')`` silently loaded the pre-SWA weights. Now refused
    (the path names nothing); unchanged same-step saves (last.ckpt) still just name it."""
    with casckpt.open(tmp_path / "store") as store:
        plugin = CasckptCheckpointIO(store, "swa")
        m = lightning_model()
        t = lightning_trainer(plugin, tmp_path, ModelCheckpoint(dirpath=tmp_path / "ckpts"),
                              StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), max_epochs=3)
        t.fit(m)
        averaged = m.state_dict()["lin.weight"].clone()
        assert not torch.equal(m.saved[t.global_step]["lin.weight"], averaged)  # SWA moved them
        with pytest.raises(VersionExistsError, match=r"other weights.*StochasticWeightAveraging"):
            t.save_checkpoint(tmp_path / "swa.ckpt")  # Lightning's way to keep the SWA weights
        with pytest.raises(CheckpointPathNotFoundError):
            plugin.load_checkpoint(tmp_path / "swa.ckpt")
        assert [v.step for v in store.log("swa")] == [t.global_step]
        # a fresh plugin (a resumed process) re-saving the unchanged state at that step: fine
        again = CasckptCheckpointIO(store, "swa")
        loaded = again.load_checkpoint(f"casckpt://swa@{t.global_step}")
        again.save_checkpoint(loaded, tmp_path / "last.ckpt")
        assert len(store.resolve(f"swa@{t.global_step}").tags) == 2
