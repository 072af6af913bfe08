"""Lightning (``lightning.pytorch``): checkpoints go to a casckpt store instead of ``.ckpt`` files.

::

    import casckpt
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from casckpt.integrations.lightning import CasckptCheckpointIO

    store = casckpt.open("ckpts/")
    trainer = Trainer(plugins=[CasckptCheckpointIO(store, "my-run")],
                      callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss")])
    trainer.fit(model)                                    # saves become versions of my-run
    trainer.fit(model, ckpt_path="casckpt://my-run@latest")  # resume from the store

``ModelCheckpoint``'s saves become commits (one version per global step) and its
``save_top_k`` removals become deletions; no ``.ckpt`` file is written. How paths map to
versions: :mod:`casckpt.integrations.lightning_io`. For the ``pytorch_lightning`` package
use :mod:`casckpt.integrations.pytorch_lightning` (the same class on that package's base).
Needs the extra: ``pip install 'casckpt[lightning]'``.
"""

from __future__ import annotations

from casckpt.errors import OptionalDependencyError
from casckpt.integrations.lightning_io import StoreCheckpointIO
from casckpt.integrations.resume import SCHEME

try:
    import lightning.pytorch as framework
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities import rank_zero_warn
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise OptionalDependencyError(
        f"casckpt.integrations.lightning needs Lightning ({exc}): pip install 'casckpt[lightning]'; "
        "for the pytorch_lightning package use casckpt.integrations.pytorch_lightning"
    ) from exc

__all__ = ["SCHEME", "CasckptCheckpointIO"]


class CasckptCheckpointIO(StoreCheckpointIO, CheckpointIO):
    """A Lightning ``CheckpointIO`` plugin that stores checkpoints in a casckpt store.

    ``Trainer(plugins=[CasckptCheckpointIO(store, run)])``; every method is documented on
    :class:`~casckpt.integrations.lightning_io.StoreCheckpointIO`.
    """

    lightning_version = str(framework.__version__)  # type: ignore[attr-defined]  # what its migration compares with

    def warn(self, message: str) -> None:
        """Warn on global rank zero only, as Lightning's own warnings."""
        rank_zero_warn(message)
