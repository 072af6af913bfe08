"""A throttled S3 link for the workloads that measure against one (``copy``, ``tiers``).

``s3_link(workdir, rate, name, log)`` sets up what both need, in one place: fake AWS
credentials for the duration (``casckpt.testing.s3.fake_aws_environment``), a moto server
behind a ``rate`` bytes/s proxy in a child process (``benchmarks/throttle.py``), a boto3
client through the proxy and one to moto itself (both shaped as S3BlobStore's, from
``benchmarks/s3.py``), the bucket created and one warm-up put and get. It yields an
:class:`S3Link`: the clients, the proxy's byte counts around a step (``traffic``) and the raw
boto3 baseline, objects one after the other with S3BlobStore's TransferConfig and checksum
(``upload``, ``download``), timed as the workloads time everything (``clock``).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import measure
from benchmarks.s3 import BUCKET, casckpt_transfer_defaults, s3_client, transfer_config, warm_up
from benchmarks.throttle import ThrottledS3, throttled_s3
from casckpt.testing.s3 import fake_aws_environment

T = TypeVar("T")
MB = 1_000_000


def clock(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall seconds, after releasing the memory the previous step left."""
    measure.release_memory()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@dataclass(frozen=True)
class S3Link:
    """The throttled S3 of one workload run (made by :func:`s3_link`). Not thread-safe."""

    server: ThrottledS3
    client: Any  # through the proxy
    direct: Any  # to moto itself (untimed set-up and checks)
    defaults: dict[str, Any]  # the S3BlobStore defaults that shape a transfer

    def traffic(self, fn: Callable[[], T]) -> tuple[T, list[int]]:
        """``fn()`` and the bytes that crossed the proxy meanwhile, ``[up, down]``."""
        up, down = self.server.counters()
        result = fn()
        after_up, after_down = self.server.counters()
        return result, [after_up - up, after_down - down]

    def upload(self, keys: list[str], bodies: list[bytes]) -> float:
        """Seconds to put ``bodies`` under ``keys`` through the proxy, one after the other."""
        config = transfer_config(self.defaults)
        checksum = self.defaults["checksum"]
        extra = {"ChecksumAlgorithm": checksum} if checksum else {}

        def upload() -> None:
            for key, body in zip(keys, bodies, strict=True):
                self.client.upload_fileobj(io.BytesIO(body), BUCKET, key, ExtraArgs=extra, Config=config)

        return clock(upload)[1]

    def download(self, keys: list[str], bodies: list[bytes]) -> tuple[float, bool]:
        """Seconds to get ``keys`` through the proxy, one after the other, and whether they
        came back as ``bodies``."""
        config = transfer_config(self.defaults)

        def download() -> list[io.BytesIO]:
            out = [io.BytesIO() for _ in keys]
            for key, buf in zip(keys, out, strict=True):
                self.client.download_fileobj(BUCKET, key, buf, Config=config)
            return out

        got, seconds = clock(download)
        return seconds, all(b.getbuffer() == o for b, o in zip(got, bodies, strict=True))


@contextmanager
def s3_link(workdir: Path, rate: float, name: str, log: Callable[[str], None]) -> Iterator[S3Link]:
    """Moto behind a ``rate`` bytes/s proxy in a child process, its bucket made and warmed up;
    fake credentials in ``os.environ`` until the block ends (the previous values put back)."""
    defaults = casckpt_transfer_defaults()
    with fake_aws_environment(workdir), throttled_s3(rate) as server:
        log(f"{name}: moto S3 behind a {rate / MB:g} MB/s proxy at {server.endpoint} (child process)")
        client = s3_client(server.endpoint, defaults)
        direct = s3_client(server.direct, defaults)
        try:
            direct.create_bucket(Bucket=BUCKET)
            warm_up(client)
            yield S3Link(server, client, direct, defaults)
        finally:
            client.close()
            direct.close()
