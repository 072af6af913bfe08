"""URL redaction for messages and logs: credentials in a URL never reach a message.

A leaf: every backend's error mapping and every location may use it.
"""

from __future__ import annotations

import re

_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact_text(text: str) -> str:
    """Every ``scheme://user:secret@`` in ``text`` -> ``scheme://***@`` (for messages that quote URLs)."""
    return _URL_USERINFO.sub("***@", text)


def redact_url(url: str) -> str:
    """``scheme://user:secret@host/db`` -> ``scheme://***@host/db`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return scheme + sep + netloc + slash + tail
