"""``casckpt init --print-grants ROLE``: the PostgreSQL GRANTs of a role and what each storage
backend's access management needs for it (the S3 IAM policy, the Azure role definition).

Creates nothing and connects to nothing: the SQL comes from the catalog's table metadata
(:mod:`casckpt.catalog.grants`), the rest from each registered backend's ``grants``
(:mod:`casckpt.storage.registry`) given the store's URLs, read from ``--blobs``/``--location``
or from PATH's ``casckpt.toml`` when it has one. A backend is printed when a URL is its; with
no such URL at all (a new store), every backend is, with placeholders.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from casckpt.cli import render
from casckpt.config_file import read_config_file
from casckpt.errors import NotAStoreError
from casckpt.storage.registry import RoleGrants, all_backends


def store_urls(path: Path | None) -> list[str]:
    """The blob URLs a store config at ``path`` (a directory or its casckpt.toml) names; none
    when there is no store there."""
    if path is None:
        return []
    file = path if path.suffix == ".toml" else path / "casckpt.toml"
    try:
        doc = read_config_file(file)
    except NotAStoreError:
        return []
    blobs = doc["store"].get("blobs", [])
    items: list[Any] = list(doc.get("locations", [])) + (blobs if isinstance(blobs, list) else [blobs])
    return [item["url"] if isinstance(item, dict) else item for item in items]


def backend_grants(role: str, urls: list[str]) -> list[RoleGrants]:
    """What each backend prints for ``role``: those ``urls`` name, else every one that has any."""
    printing = [b for b in all_backends() if b.grants is not None]
    named = [b for b in printing if any(u.startswith(f"{b.scheme}://") for u in urls)]
    return [b.grants(role, urls) for b in named or printing if b.grants is not None]


def grants_document(role: str, role_name: str | None, urls: list[str]) -> dict[str, Any]:
    """``{"role", "role_name", "sql": [statement, ...], "s3_policy": {...}, ...}`` (a key per
    backend printed, e.g. ``s3_policy``, ``azure_role``)."""
    from casckpt.catalog import grants

    name = grants.check_role_name(role_name or grants.default_role_name(grants.check_role(role)))
    doc: dict[str, Any] = {"role": role, "role_name": name, "sql": grants.grant_statements(role, name)}
    doc.update((g.key, g.document) for g in backend_grants(role, urls))
    return doc


def print_grants(role: str, role_name: str | None, urls: list[str], *, as_json: bool) -> None:
    """Print the role's GRANTs, then each backend's document (or all as one JSON object)."""
    import json

    doc = grants_document(role, role_name, urls)
    if as_json:
        render.print_json(doc)
        return
    lines = ["-- PostgreSQL (run as the catalog tables' owner, e.g. psql -f):", *doc["sql"]]
    for g in backend_grants(role, urls):
        lines += ["", f"# {g.title}:", json.dumps(g.document, indent=2)]
    sys.stdout.write("\n".join(lines) + "\n")  # verbatim: no wrapping, copied into psql / IAM
    sys.stdout.flush()
