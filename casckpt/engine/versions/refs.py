"""Refs: how users name versions.

``run@step``, ``run@latest``, ``run@~N`` (N versions before the latest),
``tag:NAME``, or a unique prefix (at least 4 hex digits) of a version id.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from casckpt.catalog import Catalog
from casckpt.catalog.history import fork_point
from casckpt.catalog.rows import VersionRow
from casckpt.engine.versions.durability import restorable_here
from casckpt.engine.versions.validate import MAX_STEP
from casckpt.errors import (
    AmbiguousRefError,
    InvalidArgumentError,
    RefNotFoundError,
    RunNotFoundError,
    VersionMismatchError,
)

if TYPE_CHECKING:  # the manifest format loads with the first manifest read (a ref needs none)
    from casckpt.format.manifest import Manifest

log = logging.getLogger(__name__)

_HEX = re.compile(r"^[0-9a-f]{4,64}$")


def run_not_found(catalog: Catalog, run: str, *, ref: str | None = None,
                  names: Sequence[str] | None = None) -> RunNotFoundError:
    """The "no such run" error, built here only: its message suggests the nearest run names
    (or lists the runs there are; :class:`RunNotFoundError` words it). ``names``: the run
    names, when the caller has just read them."""
    return RunNotFoundError(run, catalog.run_names() if names is None else names, ref=ref)


def check_run(catalog: Catalog, run: str) -> None:
    """Raise :func:`run_not_found` unless a run named ``run`` exists."""
    names = catalog.run_names()
    if run not in names:
        raise run_not_found(catalog, run, names=names)


def tag_not_found(catalog: Catalog, ref: str, name: str) -> RefNotFoundError:
    """The "no such tag" error for ``ref`` (``tag:NAME``), with the nearest tag names."""
    near = difflib.get_close_matches(name, catalog.tag_names(), n=3)
    return RefNotFoundError(ref, f"there is no tag {name!r}", [f"tag:{n}" for n in near])


def _no_version(catalog: Catalog, ref: str, run: str, reason: str, near: list[str]) -> RefNotFoundError:
    """Why ``ref``, naming a version of ``run`` that is not there, names nothing: no such run, a
    run with no versions yet (a fork names the version it starts from), or else ``reason``."""
    names = catalog.run_names()
    if run not in names:
        return run_not_found(catalog, run, ref=ref, names=names)
    if catalog.nth_latest(run, 0) is not None:
        return RefNotFoundError(ref, reason, near)
    parent_id = fork_point(catalog, run)
    if parent_id is None:
        return RefNotFoundError(ref, f"run {run!r} has no versions yet; commit one to it first")
    parent = catalog.version(parent_id)
    if parent is None:
        return RefNotFoundError(ref, f"run {run!r} has no versions yet, and the version it was "
                                f"forked from ({parent_id[:12]}) is deleted")
    point = f"{parent.run}@{parent.step}"
    return RefNotFoundError(
        ref, f"run {run!r} has no versions yet; it was forked from {point}, which holds the "
        f"state it starts from: restore {point} until {run} has a commit of its own", [point])


def resolve(catalog: Catalog, ref: str) -> VersionRow:
    """Return the catalog row of the visible version ``ref`` names.

    Raises:
        RefNotFoundError: nothing matches (with near matches when there are some).
        AmbiguousRefError: an id prefix matches several versions.
        InvalidArgumentError: ``ref`` is not a string.
    """
    if not isinstance(ref, str) or not ref:
        raise InvalidArgumentError(f"a ref must be a non-empty str, got {ref!r}")
    if ref.startswith("tag:"):
        return _resolve_tag(catalog, ref, ref[4:])
    if "@" in ref:
        run, _, selector = ref.rpartition("@")
        return _resolve_run(catalog, ref, run, selector)
    if _HEX.match(ref):
        matches = catalog.ids_with_prefix(ref)
        if len(matches) > 1:
            raise AmbiguousRefError(
                f"{ref!r} matches several versions ({', '.join(m[:12] for m in matches)}); "
                "give more digits"
            )
        if matches:
            row = catalog.version(matches[0])
            if row is not None:
                return row
    names = catalog.run_names()
    if ref in names:
        raise RefNotFoundError(ref, "a bare run name is not a ref", [f"{ref}@latest"])
    near = [f"{n}@latest" for n in difflib.get_close_matches(ref, names, n=3)]
    near += [f"tag:{t}" for t in difflib.get_close_matches(ref, catalog.tag_names(), n=3)]
    raise RefNotFoundError(ref, "no version, run or tag matches (refs look like run@step, "
                           "run@latest, run@~N, tag:NAME or an id prefix)", near)


def _latest_restorable(catalog: Catalog, run: str, newest: VersionRow) -> VersionRow:
    """``run@latest`` is the newest version this host can restore: versions lost before their
    fast tier drained, and versions still on another host's fast tier, are skipped (with a
    warning naming them)."""
    skipped: list[VersionRow] = []
    back, row = 0, newest
    while not restorable_here(catalog, row.id, row.durability):
        skipped.append(row)
        back += 1
        older = catalog.nth_latest(run, back)
        if older is None:
            raise RefNotFoundError(f"{run}@latest", f"no version of run {run!r} can be restored "
                                   "from this host: every one is lost or waits on another host's "
                                   "fast tier")
        row = older
    if skipped:
        log.warning("%s@latest skips %d version(s) that cannot be restored from this host (%s): "
                    "%s", run, len(skipped), "lost before their fast tier drained, or not drained "
                    "from another host's fast tier yet", ", ".join(
                        f"{run}@{r.step} ({r.durability})" for r in skipped[:5]))
    return row


def _resolve_tag(catalog: Catalog, ref: str, name: str) -> VersionRow:
    target = catalog.tag_target(name)
    row = catalog.version(target) if target is not None else None
    if row is None:
        raise tag_not_found(catalog, ref, name)
    return row


def _resolve_run(catalog: Catalog, ref: str, run: str, selector: str) -> VersionRow:
    if selector == "latest" or selector.startswith("~"):
        back = 0
        if selector.startswith("~"):
            if not selector[1:].isdigit():
                raise RefNotFoundError(ref, f"{selector!r} is not ~N with N a number", [f"{run}@~1"])
            back = int(selector[1:])
            if back >= MAX_STEP:
                raise RefNotFoundError(ref, f"run {run!r} has fewer than {back + 1} versions",
                                       [f"{run}@latest"])
        row = catalog.nth_latest(run, back)
        if row is None:
            raise _no_version(catalog, ref, run, f"run {run!r} has fewer than {back + 1} versions",
                              [f"{run}@latest"])
        if selector == "latest" and row.durability != "durable":
            return _latest_restorable(catalog, run, row)
        return row
    if not selector.lstrip("-").isdigit():
        raise RefNotFoundError(ref, f"{selector!r} is not a step, 'latest' or ~N",
                               [f"{run}@latest"])
    step = int(selector)
    row = catalog.at_step(run, step) if -MAX_STEP <= step < MAX_STEP else None
    if row is None:
        near = catalog.steps_near(run, max(-MAX_STEP, min(step, MAX_STEP - 1)))
        raise _no_version(catalog, ref, run, f"run {run!r} has no version at step {selector}",
                          [f"{run}@{s}" for s in near])
    return row


def bind(row: VersionRow, manifest: Manifest) -> Manifest:
    """``manifest`` if it is the version the catalog row says it is, else VersionMismatchError.

    The manifest was verified against the row's id when decoded; this checks what
    the catalog says about it besides (run, step, parent), so a damaged catalog
    can never hand out one version's data for another's ref.
    """
    said = (row.run, row.step, row.parent_id)
    found = (manifest.run, manifest.step, manifest.parent)
    if said != found:
        raise VersionMismatchError(
            f"the catalog says version {row.id[:12]} is {row.run}@{row.step} (parent "
            f"{(row.parent_id or 'none')[:12]}), but its manifest says {manifest.run}@{manifest.step} "
            f"(parent {(manifest.parent or 'none')[:12]}): the catalog is damaged. Nothing was "
            "returned; run `casckpt check` and rebuild the catalog from the blob locations "
            "(`casckpt catalog rebuild`) into a new, empty catalog")
    return manifest


def load_manifest(catalog: Catalog, row: VersionRow) -> Manifest:
    """The verified manifest of the version ``row`` (a :func:`resolve` row), bound to it (:func:`bind`).

    Raises:
        CorruptManifestError: the catalog's copy does not decode or hash to the id.
        VersionMismatchError: it is another version than the row says.
    """
    from casckpt.engine.versions.nodes import StoreNodes
    from casckpt.format.manifest import decode_manifest

    return bind(row, decode_manifest(catalog.manifest(row.id), row.id, StoreNodes(catalog)))
