"""Credentials inside a location URL never reach a message or a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import casckpt
from casckpt.errors import CasckptError
from casckpt.storage.redact import redact_text, redact_url

SECRET = "TOPSECRET"
URLS = [
    f"s3://AKIAABCDEFGHIJKLMNOP:{SECRET}@bucket/x",
    f"s3://user:p@ss{SECRET}@bucket/x",
    f"s3://bucket/x?X-Amz-Signature={SECRET}",
    f"az://user:{SECRET}@container/x",
    f"az://container/x?sv=2024-01-01&sig={SECRET}",
    f"az://container/x;AccountKey={SECRET}",
    f"file://user:{SECRET}@localhost/tmp/x",
]


@pytest.mark.parametrize("url", URLS)
def test_redaction_removes_every_credential_form(url: str) -> None:
    assert SECRET not in redact_url(url) and SECRET not in redact_text(f"failed on {url!r}: no")
    assert "bucket" in redact_url(url) or "container" in redact_url(url) or "localhost" in redact_url(url)


@pytest.mark.parametrize("url", URLS)
def test_an_open_and_commit_over_a_credential_url_leak_no_secret(
        tmp_path: Path, url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the open is refused or the location is kept as unreachable, neither the
    messages raised nor the log lines quote the secret."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing is ever reached
    caplog.set_level(logging.DEBUG, logger="casckpt")
    said = []
    try:
        with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "blobs"), url]) as store:
            try:
                store.commit({"a": 1}, run="r", step=1)
            except CasckptError as exc:
                said.append(str(exc))
            said += [loc.url for loc in store.locations.list()]
    except CasckptError as exc:
        said.append(str(exc))
    said += [r.getMessage() for r in caplog.records]
    assert said and not [line for line in said if SECRET in line]
