"""Names of the ``az://container/prefix`` backend: its URLs and the RBAC data actions of its
roles. A leaf: the registration (:mod:`casckpt.storage.azure_backend`), the store
(:mod:`casckpt.storage.azure`) and its errors (:mod:`casckpt.storage.azure_errors`) all read it,
and it imports none of them (nor the Azure SDK)."""

from __future__ import annotations

import re

from casckpt.errors import InvalidArgumentError
from casckpt.storage.redact import redact_text

BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
READ, WRITE, ADD, DELETE = (f"{BLOBS}/read", f"{BLOBS}/write", f"{BLOBS}/add/action",
                            f"{BLOBS}/delete")
DATA_ACTIONS = {"reader": [READ], "writer": [READ, WRITE, ADD], "admin": [READ, WRITE, ADD, DELETE]}
"""The data actions each role needs."""

_CONTAINER = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}$")


def split_az_url(url: str) -> tuple[str, str]:
    """``az://container/a/b/`` -> ``("container", "a/b")``.

    Raises:
        InvalidArgumentError: not an ``az://container[/prefix]`` URL with a valid container
            name (3-63 lower-case letters, digits and single hyphens).
    """
    if not url.startswith("az://"):
        raise InvalidArgumentError(f"{redact_text(url)!r} is not an az://container/prefix URL")
    if redact_text(url) != url:
        raise InvalidArgumentError(
            f"Azure location {redact_text(url)!r} holds a credential: give it through "
            "AZURE_STORAGE_CONNECTION_STRING or an identity DefaultAzureCredential finds, never "
            "in the URL (it is stored in the catalog and shown in messages)")
    container, _, prefix = url[len("az://"):].partition("/")
    if not _CONTAINER.match(container):
        raise InvalidArgumentError(
            f"invalid Azure container name {container!r} in {url!r}: use 3-63 lower-case "
            "letters, digits and single hyphens, starting and ending with a letter or digit")
    return container, prefix.strip("/")
