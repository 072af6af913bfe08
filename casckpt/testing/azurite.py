"""A local Azure Blob Storage for tests: Azurite (the Azure Storage emulator) on loopback.

:func:`azurite_server` starts ``azurite-blob`` (from the npm package ``azurite``, 3.x) on
127.0.0.1 at a free port with its data in a given directory, and yields its blob endpoint.
Azurite's well-known development account (:data:`ACCOUNT`, :data:`ACCOUNT_KEY`) is public by
design: nothing here can reach a real storage account.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from casckpt.errors import InvalidArgumentError, StorageError

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
               "K1SZFPTOtr/KBHBeksoGMGw==")


def find_azurite() -> str | None:
    """The ``azurite-blob`` executable: ``$AZURITE_BLOB``, then ``PATH``, then
    ``node_modules/.bin`` of ``$AZURITE_PREFIX`` (``npm install --prefix DIR azurite@3``)."""
    given = os.environ.get("AZURITE_BLOB")
    if given:
        return given
    found = shutil.which("azurite-blob")
    if found:
        return found
    prefix = os.environ.get("AZURITE_PREFIX")
    local = Path(prefix, "node_modules", ".bin", "azurite-blob") if prefix else None
    return str(local) if local is not None and local.is_file() else None


def connection_string(endpoint: str) -> str:
    """The connection string of the development account at ``endpoint`` (Azurite's, or a
    proxy's in front of it)."""
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def azurite_server(location: Path, *, timeout: float = 30.0) -> Iterator[str]:
    """Run ``azurite-blob`` on 127.0.0.1 with its data under ``location``; yields
    ``http://127.0.0.1:PORT`` (the account's endpoint is that plus ``/devstoreaccount1``).

    Raises:
        InvalidArgumentError: azurite-blob is not installed (see :func:`find_azurite`).
        StorageError: it exited, or did not start listening within ``timeout`` seconds (the
            message names its log).
    """
    exe = find_azurite()
    if exe is None:
        raise InvalidArgumentError("azurite-blob is not installed: npm install -g azurite@3")
    port = _free_port()
    log = (location / "azurite.log").open("wb")
    proc = subprocess.Popen(
        [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location),
         "--skipApiVersionCheck", "--loose", "--silent"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StorageError(f"azurite-blob did not start (exit {proc.poll()}); see "
                                       f"{location / 'azurite.log'}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
