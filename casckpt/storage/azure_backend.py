"""The ``az://container/prefix`` backend's registration: options, capabilities and roles.

Imports neither the Azure SDK nor :mod:`casckpt.storage.azure` until a location is opened, so
it is registered (``casckpt.backends`` entry point ``az``) whether or not ``casckpt[azure]`` is
installed; opening a location without the SDK says what to install.

Roles (``casckpt init --print-grants ROLE``) are Azure RBAC data actions on blobs, as a custom
role definition for the containers the store uses, and the role assignment condition that
limits them to the store's prefix (conditions are Azure ABAC, version 2.0):

- *reader*: ``.../containers/blobs/read`` (reads, properties, and listing: List Blobs is
  authorized as a read, sub-operation ``Blob.List``).
- *writer*: the reader's, plus ``.../blobs/write`` and ``.../blobs/add/action`` (Put Blob, Put
  Block, Put Block List). No delete, for the reason S3's writer has none (see
  docs/guides/roles.md).
- *admin*: the writer's, plus ``.../blobs/delete`` (gc, repair).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from casckpt.config_file import INT, NUMBER, TEXT
from casckpt.errors import InvalidArgumentError
from casckpt.storage.azure_names import BLOBS, DATA_ACTIONS, READ, split_az_url
from casckpt.storage.base import BlobStore
from casckpt.storage.registry import Backend, Capabilities, RoleGrants

OPTIONS: Mapping[str, str] = {
    "account_url": TEXT, "max_single_put_size": INT, "max_block_size": INT,
    "max_concurrency": INT, "sdk_attempts": INT, "list_page_size": INT, "retry_attempts": INT,
    "connect_timeout": NUMBER, "read_timeout": NUMBER,
}
"""What an ``[az]`` table may hold: :class:`~casckpt.storage.azure.AzureBlobStore`'s options
(never a secret: credentials come from the environment), and ``retry_attempts`` for the
:class:`~casckpt.storage.retry.RetryingBlobStore` around it (5)."""


def _scope(container: str) -> str:
    return ("/subscriptions/SUBSCRIPTION_ID/resourceGroups/RESOURCE_GROUP/providers/"
            f"Microsoft.Storage/storageAccounts/ACCOUNT/blobServices/default/containers/{container}")


def _condition(actions: Sequence[str], prefix: str) -> str:
    """The ABAC condition keeping ``actions`` inside ``prefix``: objects by their path, listings
    by the prefix they ask for."""
    if not prefix:
        return ""
    path = f"@Resource[{BLOBS}:path] StringStartsWith '{prefix}/'"
    listed = f"@Request[{BLOBS}:prefix] StringStartsWith '{prefix}/'"
    parts = [f"((!(ActionMatches{{'{READ}'}} AND SubOperationMatches{{'Blob.List'}})) OR ({listed}))",
             f"((!(ActionMatches{{'{READ}'}} AND NOT SubOperationMatches{{'Blob.List'}})) OR ({path}))"]
    parts += [f"((!(ActionMatches{{'{a}'}})) OR ({path}))" for a in actions if a != READ]
    return " AND ".join(parts)


def azure_role(role: str, urls: Sequence[str]) -> dict[str, Any]:
    """The custom role definition granting ``role`` and its assignments (one per container and
    prefix among the ``az://`` URLs in ``urls``; none: placeholders ``CONTAINER``, ``PREFIX``).

    Raises:
        InvalidArgumentError: an unknown role, or a malformed ``az://`` URL.
    """
    if role not in DATA_ACTIONS:
        raise InvalidArgumentError(f"unknown role {role!r}: choose one of {', '.join(DATA_ACTIONS)}")
    places = sorted({split_az_url(u) for u in urls if u.startswith("az://")}) or [("CONTAINER", "PREFIX")]
    actions = DATA_ACTIONS[role]
    definition = {
        "Name": f"casckpt {role}", "IsCustom": True,
        "Description": f"casckpt's {role} role on checkpoint blobs (casckpt init --print-grants {role})",
        "Actions": [], "NotActions": [], "DataActions": list(actions), "NotDataActions": [],
        "AssignableScopes": sorted({_scope(container) for container, _ in places}),
    }
    assignments = []
    for container, prefix in places:
        assignment: dict[str, Any] = {"scope": _scope(container)}
        if prefix:
            assignment.update(condition=_condition(actions, prefix), conditionVersion="2.0")
        assignments.append(assignment)
    return {"roleDefinition": definition, "assignments": assignments}


def _open(url: str, options: Mapping[str, Any], create: bool) -> BlobStore:
    from casckpt.storage.azure import AzureBlobStore
    from casckpt.storage.retry import RetryingBlobStore

    given = dict(options)
    attempts = int(given.pop("retry_attempts", 5))
    return RetryingBlobStore(AzureBlobStore(url, **given), attempts=attempts)  # containers never made


def _grants(role: str, urls: Sequence[str]) -> RoleGrants:
    return RoleGrants("azure_role", f"Azure custom role and assignments of the {role} role",
                      azure_role(role, urls))


BACKEND = Backend(
    scheme="az", example="az://container/prefix", open=_open, options=OPTIONS, grants=_grants,
    capabilities=Capabilities(),  # Azure Blob Storage is strongly consistent, listings included
)
"""Azure Blob Storage (:mod:`casckpt.storage.azure`)."""
