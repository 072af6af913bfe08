"""URL redaction for messages (a location's URL may carry a user name and secret)."""

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
