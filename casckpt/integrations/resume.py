"""The first launch of a run: what the framework integrations resume from.

A training script is launched the same way the first time and after every restart, so its
resume line (``checkout_for_resume(store, "ft@latest", ...)``, Lightning's
``ckpt_path="casckpt://ft@latest"``) must mean "the newest version, or start fresh when there
is none yet", as Lightning's own ``ckpt_path="last"`` does. Only ``RUN@latest`` of a run with
no visible version, not forked from another, starts fresh: a ref naming a step, a tag or an
id still has to name a version, and a fork starts from the version it was forked from.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from casckpt.errors import RefNotFoundError

if TYPE_CHECKING:
    from casckpt.store import Store
    from casckpt.store_core import Ref
    from casckpt.types import Version

LATEST = "@latest"

SCHEME = "casckpt://"
"""A checkpoint path ``casckpt://REF`` names the version REF names (``run@latest``, ``tag:best``,
...): Lightning's ``ckpt_path``, Megatron's ``CasckptLoadStrategy(store, ref)``."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def scheme_ref(text: str) -> str | None:
    """The REF of ``casckpt://REF`` (``""`` when nothing follows it); None for any other text."""
    return text[len(SCHEME):] if text.startswith(SCHEME) else None


def location_tag(prefix: str, location: str, *scope: str) -> str:
    """The tag naming the version saved at ``location`` (a path, taken absolute, or a URL),
    within ``scope`` (e.g. the run; none: whoever saved there): ``prefix``, the location's
    stem, and a digest of the scope and the location."""
    where = location if "://" in location else os.path.abspath(location)
    digest = hashlib.sha256("\0".join((*scope, where)).encode()).hexdigest()[:16]
    stem = _UNSAFE.sub("_", Path(where).stem).strip("_-")[:80] or "checkpoint"
    return f"{prefix}{stem}.{digest}"


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
