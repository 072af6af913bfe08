"""Preflight of operations that delete (gc): prove the credentials may delete catalog rows
and objects before anything is marked, condemned or deleted.

Without it, gc run with the writer role's credentials would get as far as condemning chunks
(an UPDATE a writer may make) and then fail on the first DELETE, or delete rows and then fail
on the objects. The catalog side asks the database (:func:`casckpt.catalog.grants.missing_rights`),
each location is probed (:func:`casckpt.storage.rights.delete_refused`); neither changes anything.
"""

from __future__ import annotations

from casckpt.catalog.grants import missing_rights
from casckpt.engine.context import EngineContext
from casckpt.errors import AccessDeniedError
from casckpt.storage.rights import delete_refused

_HINT = "run it with the admin role's credentials (`casckpt init --print-grants admin`)"


def require_delete_rights(ctx: EngineContext, operation: str, *, objects: bool = True) -> None:
    """Raise unless the store's credentials may do everything ``operation`` (e.g. ``"gc"``) does:
    every catalog privilege of the admin role, and (``objects``) deleting on every location.

    Raises:
        AccessDeniedError: a right is missing; ``right`` names the first (catalog rights
            first, deletions first among them). Nothing was changed.
        StorageError: a location could not be probed.
    """
    missing = missing_rights(ctx.catalog, "admin")
    if missing:
        rest = missing[1:]
        listed = ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else "")
        more = f" (and {len(rest)} more: {listed})" if rest else ""
        raise AccessDeniedError(
            f"{operation} needs {missing[0]} in the catalog{more}, which these credentials lack; "
            f"nothing was changed: {_HINT}", right=missing[0])
    for loc in ctx.locations.all:
        if objects and loc.readable:
            refused = delete_refused(loc.blobs)
            if refused is not None:
                raise AccessDeniedError(
                    f"{operation} needs to delete objects on location {loc.describe()}, and a probe "
                    f"found these credentials may not ({refused}); nothing was changed: {_HINT}",
                    right=refused.right)
