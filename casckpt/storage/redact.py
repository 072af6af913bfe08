"""Redaction for messages and logs: credentials never reach a message.

The one place that knows what a credential looks like in text: the user part of a URL
(``s3://KEY:SECRET@bucket``), signed query fields (an Azure SAS ``sig=``, S3's
``X-Amz-Signature=``), connection-string fields (``AccountKey=``), AWS access key ids and
shared-key signatures. A leaf: every backend's error mapping and every location may use it.
"""

from __future__ import annotations

import re

_URL_USERINFO = re.compile(r"(?<=://)[^/\s'\"]*@")
_SECRET_FIELDS = re.compile(
    r"((?:AccountKey|SharedAccessSignature|sig|Signature|X-Amz-Signature|X-Amz-Credential|Credential"
    r"|X-Amz-Security-Token|SecurityToken|password|passwd|pwd|token|secret)=)[^;&\s\"',]+",
    re.IGNORECASE)
_SHARED_KEY = re.compile(r"(SharedKey [^:\s]+:)[A-Za-z0-9+/=]+")
_ACCESS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|ANPA)[A-Z0-9]{12,}\b")


def redact_text(text: str) -> str:
    """``text`` with every credential it quotes replaced by ``***`` (``scheme://***@host``,
    ``sig=***``, ``AccountKey=***``, ...): for messages that quote URLs or SDK errors."""
    text = _URL_USERINFO.sub("***@", text)
    text = _SECRET_FIELDS.sub(r"\1***", text)
    text = _SHARED_KEY.sub(r"\1***", text)
    return _ACCESS_KEY_ID.sub("***", text)


def redact_url(url: str) -> str:
    """``scheme://user:secret@host/db?sig=...`` -> ``scheme://***@host/db?sig=***`` (for
    messages and logs)."""
    return redact_text(url)
