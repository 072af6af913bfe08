"""Whether a version or a pack can be read from this host: durable, lost with its fast
tier, or waiting on another host's fast tier (see :mod:`casckpt.engine.tiering.tier`).

Catalog reads only, so the pack layer, refs and restores can ask before reading a byte.
"""

from __future__ import annotations

from casckpt.catalog import Catalog
from casckpt.catalog import tiers as sql
from casckpt.errors import CasckptError, VersionLostError, VersionNotDurableError


def check_readable(catalog: Catalog, version_id: str, durability: str) -> None:
    """Refuse, before reading anything, a version that cannot be read whole from here.

    Raises:
        VersionLostError: it was lost before it drained.
        VersionNotDurableError: it waits on another host's fast tier.
    """
    if durability == "durable":
        return
    if durability == "lost":
        raise VersionLostError(
            f"version {version_id[:12]} was lost before it drained: its fast tier was lost "
            "(wiped, or its host gone). Restore an earlier version (`casckpt log` marks the lost "
            "ones; @latest skips them)")
    others = {t: n for t, n in sql.waiting_on(catalog, version_id).items() if t != catalog.fast_tier}
    if others:
        where = ", ".join(f"{_host_of(catalog, t)} ({n} pack(s))" for t, n in others.items())
        raise VersionNotDurableError(
            f"version {version_id[:12]} is on the fast tier of {where} and not drained to the "
            "store's locations yet, so it cannot be read from this host. Wait for it "
            "(store.tier.wait_durable(ref), or `casckpt drain --wait` on that host), or restore an "
            "earlier version")


def _host_of(catalog: Catalog, tier_id: str) -> str:
    return next((f"host {t.host} ({t.path})" for t in sql.tiers(catalog) if t.id == tier_id),
                f"tier {tier_id}")


def restorable_here(catalog: Catalog, version_id: str, durability: str) -> bool:
    """Whether :func:`check_readable` would let the version be read from this process."""
    try:
        check_readable(catalog, version_id, durability)
    except (VersionLostError, VersionNotDurableError):
        return False
    return True


def not_durable_error(catalog: Catalog, pack_id: str, tier_id: str, state: str) -> CasckptError:
    """The error for reading a pack that is on another tier (or lost) rather than the locations."""
    if state == "lost":
        return VersionLostError(f"pack {pack_id} was lost with its fast tier before it drained; "
                                "the versions needing it cannot be restored (`casckpt log`)")
    return VersionNotDurableError(
        f"pack {pack_id} is on the fast tier of {_host_of(catalog, tier_id)} and not drained yet; "
        "wait for the drain (store.tier.wait_durable) or restore an earlier version")
