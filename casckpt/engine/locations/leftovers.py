"""Reclaiming what dead or failed commits left behind: staging packs and temporary objects.

A commit writes packs into its store's staging directory and objects through
temporary files in each local location's ``tmp/``; both live in scratch
directories locked by their owner (see ``storage/scratch.py``). A process
killed mid-commit leaves them behind, costing only space. The next store
opened on the same cache and locations removes them (``Store`` calls
:func:`reclaim_leftovers` when it is built), and so can GC; a live commit's
files, in this process or another, are never touched.
"""

from __future__ import annotations

from pathlib import Path

from casckpt.storage.locations import LocationSet
from casckpt.storage.scratch import DEFAULT_GRACE, Reclaimed, TempReclaimer, reclaim


def reclaim_leftovers(staging: Path, locations: LocationSet, *,
                      grace: float = DEFAULT_GRACE) -> Reclaimed:
    """Remove dead owners' staging packs under ``staging`` and temporary files on every
    location not failed; loose files of older casckpt versions go once older than ``grace``
    seconds. Returns what was removed. Never raises for a file it could not remove (logged).

    Safe to call at any time, from any process, while others commit.
    """
    done = reclaim(staging, grace=grace)
    for loc in locations.all:
        if loc.readable and isinstance(loc.blobs, TempReclaimer):
            done += loc.blobs.reclaim_temp(grace)
    return done
