"""The ``pytorch_lightning`` package's flavour of :mod:`casckpt.integrations.lightning`.

``pytorch_lightning`` and ``lightning.pytorch`` ship the same code under two names, and a
``Trainer`` of one accepts only plugins built on its own ``CheckpointIO``; this module gives
the same class on ``pytorch_lightning``'s base (``lightning_fabric``). Needs
``pip install pytorch-lightning``.
"""

from __future__ import annotations

from casckpt.errors import OptionalDependencyError
from casckpt.integrations.lightning_io import StoreCheckpointIO
from casckpt.integrations.resume import SCHEME

try:
    import pytorch_lightning as framework
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning_fabric.utilities import rank_zero_warn
except ImportError as exc:  # pragma: no cover - installed wherever tests run
    raise OptionalDependencyError(
        f"casckpt.integrations.pytorch_lightning needs pytorch_lightning ({exc}): "
        "pip install pytorch-lightning, or use casckpt.integrations.lightning with 'casckpt[lightning]'"
    ) from exc

__all__ = ["SCHEME", "CasckptCheckpointIO"]


class CasckptCheckpointIO(StoreCheckpointIO, CheckpointIO):
    """:class:`casckpt.integrations.lightning.CasckptCheckpointIO` for ``pytorch_lightning.Trainer``."""

    lightning_version = str(framework.__version__)  # type: ignore[attr-defined]  # what its migration compares with

    def warn(self, message: str) -> None:
        """Warn on global rank zero only, as Lightning's own warnings."""
        rank_zero_warn(message)
