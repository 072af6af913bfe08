"""``store.tier``: the fast tier, where commits land before they drain to the locations.

:class:`Tier` is the namespace of :class:`casckpt.Store` for the fast tier of
:func:`casckpt.open` ``fast_tier=`` (see docs/guides/fast-tier.md): its status, a drain
now, waiting until versions are durable, and declaring another host's tier lost. The
tier itself is :mod:`casckpt.engine.tiering.tier`; the drain worker belongs to the store's core.
"""

from __future__ import annotations

from casckpt.errors import InvalidArgumentError
from casckpt.store_core import Ref, StoreCore
from casckpt.types import DrainReport, ProgressCallback, TierLoss, TierStatus


class Tier:
    """The fast tier of one open store (``store.tier``); thread-safe as the store is."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def status(self) -> TierStatus:
        """Bytes per tier, versions not durable yet, this host's fast tier and its drain rate
        (see :class:`casckpt.types.TierStatus`)."""
        from casckpt.engine.tiering.tierstatus import tier_status

        return tier_status(self._core.catalog, self._core.tier)

    def drain(self, *, wait: bool = True, progress: ProgressCallback | None = None) -> DrainReport:
        """Drain this host's fast tier now, in this thread: every pack not drained to the
        locations, then the manifests of the versions that become durable, then eviction to
        the budget. ``wait``: if another process of this host is draining the tier, wait for it
        (else return at once with ``busy``). The background drain worker does the same; this
        is for scripts and ``casckpt drain``.

        Raises:
            InvalidArgumentError: the store was opened without a fast tier.
            ReadOnlyStoreError: the store is read-only.
        """
        self._core.refuse_write("store.tier.drain", "the catalog and the locations")
        if self._core.tier is None:
            raise InvalidArgumentError("this store was opened without a fast tier (fast_tier=, or "
                                       "fast_tier in casckpt.toml); there is nothing to drain")
        return self._core.drain(wait=wait, progress=progress)

    def wait_durable(self, ref: Ref | None = None, timeout: float | None = None) -> None:
        """Wait until ``ref`` is durable: drained from the fast tier it was committed to, every
        pack and its manifest on the store's locations with their redundancy. ``ref`` None:
        every version of this store not durable when called (those waiting on this host's
        fast tier, when the store has one). Returns at once for durable versions, and in a
        store without a fast tier. Works from any host (it polls the catalog); the drain
        itself runs on the committing host.

        Raises:
            VersionLostError: a version was lost with its fast tier before it drained.
            DrainTimeoutError: ``timeout`` seconds passed first (the drain goes on).
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        from casckpt.catalog import tiers as tier_sql
        from casckpt.engine.tiering.tier import wait_durable

        catalog = self._core.catalog
        if ref is not None:
            ids = [self._core.row(ref).id]
        else:
            tier = self._core.tier
            ids = [v for v, state in tier_sql.not_durable(catalog, tier_id=tier.id if tier else None)
                   if state == "fast"]
        wait_durable(catalog, ids, timeout, self._core.nudge_drain)

    def forget(self, tier_id: str) -> TierLoss:
        """Declare another host's fast tier lost by hand (its host is gone for good): the packs
        still waiting on it to drain are lost, and so is every version needing one of them
        (``log`` marks them, restore refuses them). Versions already durable are unaffected.
        ``tier_id``: the tier's id or a unique prefix of it (``casckpt tier status``). A tier
        lost already is left as it is (the report lists nothing).

        Raises:
            TierNotFoundError: no tier of this store has that id.
            AmbiguousRefError: the prefix names several tiers.
            InvalidArgumentError: it is this handle's own tier, or a tier of this host whose
                directory still holds it (drain it instead: ``casckpt drain``).
            ReadOnlyStoreError: the store is read-only.
        """
        from casckpt.engine.tiering.tierforget import forget

        self._core.refuse_write("store.tier.forget", "the catalog")
        return forget(self._core.catalog, self._core.tier, tier_id)
