"""Reads through this host's fast tier: the tier wraps the pack layer's reader.

A pack the tier holds is read from the tier's disk (verified like any read by the caller);
any other pack, and a pack evicted meanwhile, from the locations (:class:`PackReader`). A
damaged tier copy of a drained pack is evicted and the pack read from the locations; a
damaged copy of a pack not drained yet is the only one, and fails the read.
"""

from __future__ import annotations

from collections.abc import Sequence

from casckpt.engine.packlayer.packlayouts import Layouts
from casckpt.engine.packlayer.packread import PackReader
from casckpt.engine.tiering.tier import FastTier
from casckpt.errors import BlobNotFoundError, CorruptPackError
from casckpt.format.chunks import object_id


class TierReads:
    """The fast tier ``tier`` in front of ``located``, the reader of the locations. Thread-safe
    (as its parts are); what :class:`PackReader` promises, with the tier's packs first."""

    def __init__(self, tier: FastTier, located: PackReader, layouts: Layouts) -> None:
        self.tier, self.located, self._layouts = tier, located, layouts

    @property
    def retry_s(self) -> float:
        """See :attr:`PackReader.retry_s`."""
        return self.located.retry_s

    def waiting_s(self) -> float | None:
        """See :meth:`PackReader.waiting_s`."""
        return self.located.waiting_s()

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview], *,
                  heal: bool = True) -> int:
        """See :meth:`PackReader.read_into`; from the tier when it holds the pack."""
        if self.tier.dir.holds(pack_id):
            try:
                return self.tier.dir.read_into(pack_id, offset, buffers)
            except BlobNotFoundError:
                pass  # evicted meanwhile: it had drained
        return self.located.read_into(pack_id, offset, buffers, heal=heal)

    def get(self, pack_id: str) -> bytes:
        """See :meth:`PackReader.get`; from the tier when it holds the pack intact."""
        if self.tier.dir.holds(pack_id):
            try:
                data = self.tier.dir.get(pack_id)
                if object_id(data) == pack_id:
                    return data
            except BlobNotFoundError:
                pass
        return self.located.get(pack_id)

    def can_reconstruct(self, pack_id: str) -> bool:
        """See :meth:`PackReader.can_reconstruct`. A drained pack the tier served can always be
        read again from the locations; a pack not drained cannot."""
        if self.tier.dir.holds(pack_id):
            layout = self._layouts.get(pack_id, fresh=True)
            return layout is not None and layout.tier is None
        return self.located.can_reconstruct(pack_id)

    def reconstruct(self, pack_id: str, *, heal: bool = True) -> bytes:
        """See :meth:`PackReader.reconstruct`. A damaged tier copy of a drained pack is evicted
        and the pack read from the locations instead.

        Raises:
            CorruptPackError: the damaged copy is of a pack not drained yet (the only one).
        """
        if self.tier.dir.holds(pack_id):
            layout = self._layouts.get(pack_id, fresh=True)
            if layout is not None and layout.tier is not None:
                raise CorruptPackError(
                    f"pack {pack_id} on the fast tier {self.tier.dir.root} is damaged and has not "
                    "drained yet: it is the only copy. Restore another version")
            self.tier.dir.evict(pack_id)
            return self.located.get(pack_id)
        return self.located.reconstruct(pack_id, heal=heal)
