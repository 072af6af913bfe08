"""``casckpt init --print-grants ROLE``: the PostgreSQL GRANTs of a role and what each storage
backend's access management needs for it (the S3 IAM policy, the Azure role definition).

Creates nothing and connects to nothing: :func:`casckpt.grants` gives the SQL (from the
catalog's table metadata) and each backend's document (from the registered backends, given the
store's URLs, read from ``--blobs``/``--location`` or from PATH's ``casckpt.toml`` when it has
one); the text output titles each document as its backend does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import casckpt
from casckpt.cli import render
from casckpt.config import read_config_file
from casckpt.errors import NotAStoreError
from casckpt.storage.registry import role_grants


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


def print_grants(role: str, role_name: str | None, urls: list[str], *, as_json: bool) -> None:
    """Print the role's GRANTs, then each backend's document (or all as one JSON object)."""
    import json

    doc = casckpt.grants(role, role_name=role_name, urls=urls)
    if as_json:
        render.print_json(doc)
        return
    lines = ["-- PostgreSQL (run as the catalog tables' owner, e.g. psql -f):", *doc["sql"]]
    for g in role_grants(role, urls):
        lines += ["", f"# {g.title}:", json.dumps(g.document, indent=2)]
    sys.stdout.write("\n".join(lines) + "\n")  # verbatim: no wrapping, copied into psql / IAM
    sys.stdout.flush()
