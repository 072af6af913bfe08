"""Fixtures for blob store tests: a shared boto3 session, buckets, a fault proxy.

The moto S3 server (``moto_endpoint``, on 127.0.0.1) and the fake, isolated AWS
environment (``aws_env``) come from tests/conftest.py; the proxy from
:mod:`casckpt.testing.faultproxy`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from casckpt.testing.faultproxy import FaultProxy


@pytest.fixture
def fake_credentials(aws_env: None) -> tuple[str, str]:
    """The (access key id, secret access key) that ``aws_env`` put in the environment."""
    key_id, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    assert "FAKE" in key_id.upper() and "FAKE" in secret.upper(), "not the test credentials"
    return key_id, secret


@pytest.fixture(scope="session")
def boto_session(_session_aws_env: None) -> Any:
    """One boto3 Session for the test session: building a client from a fresh
    Session reloads the S3 model (~0.2 s), too slow to do in every test."""
    boto3 = pytest.importorskip("boto3")
    return boto3.session.Session()


@pytest.fixture(scope="session")
def s3_admin(moto_endpoint: str, boto_session: Any) -> Iterator[Any]:
    """A plain boto3 client on the moto server, for setting up and inspecting buckets."""
    client = boto_session.client("s3", endpoint_url=moto_endpoint)
    yield client
    client.close()


@pytest.fixture
def bucket(s3_admin: Any, aws_env: None) -> str:
    """A new, empty bucket on the moto server."""
    name = f"casckpt-test-{uuid.uuid4().hex[:16]}"
    s3_admin.create_bucket(Bucket=name)
    return name


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the moto server, stopped at teardown."""
    with FaultProxy(moto_endpoint) as proxy:
        yield proxy


# -- Azure: Azurite on loopback, the development account's connection string ------------------

@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of an Azurite blob service shared by the session (containers
    are per test); skipped, saying how to install it, where Azurite or the SDK is missing."""
    pytest.importorskip("azure.storage.blob", reason="needs casckpt[azure] (azure-storage-blob)")
    from casckpt.testing.azurite import azurite_server, find_azurite

    if find_azurite() is None:
        pytest.skip("Azurite is not installed: npm install -g azurite@3 (or npm install --prefix DIR "
                    "azurite@3 and AZURITE_PREFIX=DIR); .ci/run installs it")
    with azurite_server(tmp_path_factory.mktemp("azurite")) as url:
        yield url


@pytest.fixture
def azure_connection(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The development account's connection string, also in AZURE_STORAGE_CONNECTION_STRING
    (how casckpt.open finds it) for the test."""
    from casckpt.testing.azurite import connection_string

    conn = connection_string(azurite_endpoint)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    return conn


@pytest.fixture
def container(azure_connection: str) -> Iterator[Any]:
    """A new, empty container on Azurite: its plain SDK client, for setting up and inspecting."""
    from azure.storage.blob import ContainerClient

    client = ContainerClient.from_connection_string(azure_connection, f"casckpt-{uuid.uuid4().hex[:16]}")
    client.create_container()
    yield client
    client.close()


@pytest.fixture
def azure_proxy(azurite_endpoint: str) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of Azurite, stopped at teardown."""
    with FaultProxy(azurite_endpoint) as proxy:
        yield proxy
