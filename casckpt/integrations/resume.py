"""The first launch of a run: what the framework integrations resume from.

A training script is launched the same way the first time and after every restart, so its
resume line (``checkout_for_resume(store, "ft@latest", ...)``, Lightning's
``ckpt_path="casckpt://ft@latest"``) must mean "the newest version, or start fresh when there
is none yet", as Lightning's own ``ckpt_path="last"`` does. Only ``RUN@latest`` of a run with
no visible version, not forked from another, starts fresh: a ref naming a step, a tag or an
id still has to name a version, and a fork starts from the version it was forked from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from casckpt.errors import RefNotFoundError

if TYPE_CHECKING:
    from casckpt.store import Store
    from casckpt.store_core import Ref
    from casckpt.types import Version

LATEST = "@latest"


def version_to_resume(store: Store, ref: Ref) -> Version | None:
    """The version ``ref`` names; None when it is ``RUN@latest`` and ``RUN`` has no version yet.

    Raises:
        RefNotFoundError: ``ref`` names no version and is not such a first launch (a missing
            step or tag, a fork with no version of its own, versions none of which this host
            can restore).
        AmbiguousRefError: as :meth:`casckpt.Store.resolve`.
    """
    try:
        return store.resolve(ref)
    except RefNotFoundError:
        if not (isinstance(ref, str) and ref.endswith(LATEST)):
            raise
        run = ref[:-len(LATEST)]
        if _has_versions(store, run) or any(
                node.name == run and node.fork_version is not None for node in store.lineage()):
            raise
        return None


def _has_versions(store: Store, run: str) -> bool:
    try:
        return bool(store.log(run, limit=1))
    except RefNotFoundError:  # no such run: nothing was ever committed to it
        return False
