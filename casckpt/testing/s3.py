"""A local S3 for tests and benchmarks: a moto server on loopback and fake, isolated credentials.

Nothing here can reach a real AWS account: the server binds 127.0.0.1 on a
free port, and :func:`fake_aws_environment` replaces every variable the AWS
SDK reads credentials, profiles, endpoints or proxies from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FAKE_ACCESS_KEY_ID = "AKIAFAKEFAKEFAKEFAKE"
FAKE_SECRET_ACCESS_KEY = "fakeSecret/DO+NOT+USE/0123456789abcdefghij"
REGION = "us-east-1"

_HIDDEN = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE", "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
)


def fake_aws_variables(home: Path) -> dict[str, str | None]:
    """Environment values (None: unset) for fake credentials and no profile, role or proxy."""
    values: dict[str, str | None] = dict.fromkeys(_HIDDEN)
    values.update({
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_ACCESS_KEY,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": str(home / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1,localhost",
    })
    return values


@contextmanager
def fake_aws_environment(home: Path) -> Iterator[None]:
    """:func:`fake_aws_variables` in ``os.environ`` for the ``with`` body; old values restored."""
    values = fake_aws_variables(home)
    saved = {name: os.environ.get(name) for name in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextmanager
def moto_server() -> Iterator[str]:
    """An in-process moto S3 server on 127.0.0.1 (a free port); yields its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
