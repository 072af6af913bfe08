"""The ``s3`` workload: casckpt on S3 against raw boto3 managed transfer of the same bytes.

Everything runs in this process, on loopback: a moto ``ThreadedMotoServer`` on
127.0.0.1 (a free port), reached with fake credentials that are put into
``os.environ`` for the duration of the workload only (and the previous values
put back afterwards). Real credentials, profiles and endpoints are hidden.

In one run, on one bucket:

* raw: the dense state's tensor bytes, cut into objects of the pack size, go up
  one object after the other with ``upload_fileobj`` and come back with
  ``download_fileobj`` (the same TransferConfig and checksum casckpt uses);
* casckpt: ``Store.commit`` of the same state (first version) to a new store whose
  packs live on the bucket (catalog SQLite in a local directory), then a full
  ``Store.restore`` of it.

Each of ``REPEATS`` rounds runs raw upload, commit, raw download, restore (so
each casckpt step runs right after its raw twin) on fresh keys and a fresh
store, then deletes what it wrote; the report takes the median of each timing.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import shutil
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

import casckpt
from benchmarks import measure
from benchmarks.workloads import build
from casckpt.storage.s3 import S3BlobStore
from casckpt.testing.s3 import fake_aws_environment, moto_server

Log = Callable[[str], None]

NAME = "s3"
MiB = 1 << 20
MB = 1_000_000  # throughputs are in MB/s (10^6 bytes per second)
PACK_SIZE_AT_SCALE_1 = 64 * MiB
MIN_OBJECT_SIZE = 5 * MiB  # S3's smallest multipart part
BUCKET = "casckpt-bench"
PREFIX = "ckpt"
REPEATS = 3  # rounds; the report takes the median of each timing (moto is noisy)

@dataclass(frozen=True)
class Timing:
    """Wall time of one transfer of the state and its bytes per second."""

    wall_s: float
    mb_per_s: float


@dataclass(frozen=True)
class Round:
    """One round, in this order: raw upload, casckpt commit, raw download, casckpt restore."""

    raw_upload_s: float
    commit_s: float
    raw_download_s: float
    restore_s: float
    raw_verified: bool
    restore_verified: bool
    commit_peak_extra_rss: int
    version: dict[str, Any]
    casckpt_objects: int
    casckpt_object_bytes: int


@dataclass(frozen=True)
class S3Result:
    """Every raw number of the ``s3`` workload; the four timings are medians over ``rounds``."""

    name: str
    endpoint: str
    logical_bytes: int
    tensors: int
    object_size: int
    raw_objects: int
    transfer: dict[str, Any]
    rounds: list[Round]
    raw_upload: Timing
    raw_download: Timing
    commit: Timing
    restore: Timing
    stored_bytes: int
    commit_peak_extra_rss: int
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Setup:
    """What every round uses: the server, the state and its raw objects."""

    endpoint: str
    client: Any
    workdir: Path
    state: Any
    objects: list[bytes]
    object_size: int
    defaults: dict[str, Any]


def object_size_for(scale: float) -> int:
    """The pack size, scaled like the state (64 MiB at 1.0), at least 5 MiB."""
    return max(MIN_OBJECT_SIZE, round(PACK_SIZE_AT_SCALE_1 * scale))


def casckpt_transfer_defaults() -> dict[str, Any]:
    """The S3BlobStore defaults that shape a transfer (read from its signature)."""
    params = inspect.signature(S3BlobStore.__init__).parameters
    names = ("multipart_threshold", "multipart_chunksize", "max_concurrency",
             "max_pool_connections", "checksum")
    return {name: params[name].default for name in names}


def split_objects(views: Iterable[memoryview], size: int) -> list[bytes]:
    """Concatenate ``views`` and cut the bytes into objects of ``size`` (the last may be shorter)."""
    objects: list[bytes] = []
    buf = bytearray()
    for view in views:
        pos = 0
        while pos < len(view):
            take = min(size - len(buf), len(view) - pos)
            buf += view[pos : pos + take]
            pos += take
            if len(buf) == size:
                objects.append(bytes(buf))
                buf.clear()
    if buf:
        objects.append(bytes(buf))
    return objects


def s3_client(endpoint: str, defaults: Mapping[str, Any]) -> Any:
    """A boto3 client with the retry mode and connection pool S3BlobStore uses."""
    config = Config(retries={"mode": "standard", "total_max_attempts": 3},
                    max_pool_connections=defaults["max_pool_connections"])
    return boto3.client("s3", endpoint_url=endpoint, config=config)


def transfer_config(defaults: Mapping[str, Any]) -> TransferConfig:
    """boto3's TransferConfig with the thresholds, part size and concurrency S3BlobStore uses."""
    config = TransferConfig(multipart_threshold=defaults["multipart_threshold"],
                            multipart_chunksize=defaults["multipart_chunksize"],
                            max_concurrency=defaults["max_concurrency"])
    config.max_in_memory_upload_chunks = 2 * defaults["max_concurrency"]  # as S3BlobStore
    return config


def _raw_upload(setup: _Setup, keys: list[str]) -> float:
    """Seconds to upload every object, one after the other, with upload_fileobj."""
    config = transfer_config(setup.defaults)
    checksum = setup.defaults["checksum"]
    extra = {"ChecksumAlgorithm": checksum} if checksum else {}

    def upload() -> None:
        for key, body in zip(keys, setup.objects, strict=True):
            setup.client.upload_fileobj(io.BytesIO(body), BUCKET, key, ExtraArgs=extra, Config=config)

    return measure.timed(upload)[1]


def _raw_download(setup: _Setup, keys: list[str]) -> tuple[float, bool]:
    """Seconds to download every object with download_fileobj, and whether all bytes match."""
    config = transfer_config(setup.defaults)

    def download() -> list[io.BytesIO]:
        out = [io.BytesIO() for _ in keys]
        for key, buf in zip(keys, out, strict=True):
            setup.client.download_fileobj(BUCKET, key, buf, Config=config)
        return out

    got, seconds = measure.timed(download)
    return seconds, all(b.getbuffer() == o for b, o in zip(got, setup.objects, strict=True))


def remove_prefix(client: Any, prefix: str) -> tuple[int, int]:
    """Delete every object under ``prefix``; returns how many there were and their bytes."""
    count = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        contents = page.get("Contents", [])
        count += len(contents)
        size += sum(int(obj["Size"]) for obj in contents)
        if contents:
            keys = [{"Key": obj["Key"]} for obj in contents]
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
    return count, size


def _round(setup: _Setup, index: int) -> Round:
    """Raw upload, commit, raw download, restore: each casckpt step next to its raw twin."""
    keys = [f"raw-{index}/{i:06d}" for i in range(len(setup.objects))]
    prefix, where = f"{PREFIX}-{index}", setup.workdir / f"round-{index}"
    state = setup.state
    with casckpt.open(where / "store", blobs=f"s3://{BUCKET}/{prefix}", cache=where / "cache",
                      pack_size=setup.object_size, s3={"endpoint_url": setup.endpoint}) as store:
        up_s = _raw_upload(setup, keys)
        version, commit_s, rss = measure.timed_with_rss(lambda: store.commit(state, run=NAME, step=1))
        down_s, raw_ok = _raw_download(setup, keys)
        restored, restore_s = measure.timed(lambda: store.restore(version.id))
        restore_ok = measure.trees_equal(state, restored)
        del restored
    remove_prefix(setup.client, f"raw-{index}/")
    count, nbytes = remove_prefix(setup.client, prefix + "/")
    shutil.rmtree(where, ignore_errors=True)
    return Round(up_s, commit_s, down_s, restore_s, raw_ok, restore_ok, rss, version.to_dict(),
                 count, nbytes)


def warm_up(client: Any) -> None:
    """One small put and get, so neither side pays for the first connection."""
    client.put_object(Bucket=BUCKET, Key="warm-up", Body=b"x" * 1024)
    client.get_object(Bucket=BUCKET, Key="warm-up")["Body"].read()
    client.delete_object(Bucket=BUCKET, Key="warm-up")


def _timing(nbytes: int, seconds: list[float]) -> Timing:
    wall = statistics.median(seconds)
    return Timing(wall, nbytes / MB / wall if wall > 0 else float("inf"))


def _summarize(setup: _Setup, endpoint: str, rounds: list[Round]) -> S3Result:
    logical = measure.logical_bytes(setup.state)
    return S3Result(
        name=NAME, endpoint=endpoint, logical_bytes=logical,
        tensors=sum(1 for _ in measure.tensor_leaves(setup.state)),
        object_size=setup.object_size, raw_objects=len(setup.objects), transfer=setup.defaults,
        rounds=rounds,
        raw_upload=_timing(logical, [r.raw_upload_s for r in rounds]),
        raw_download=_timing(logical, [r.raw_download_s for r in rounds]),
        commit=_timing(logical, [r.commit_s for r in rounds]),
        restore=_timing(logical, [r.restore_s for r in rounds]),
        stored_bytes=rounds[0].version["stored_bytes"],
        commit_peak_extra_rss=max(r.commit_peak_extra_rss for r in rounds),
        verified=all(r.raw_verified and r.restore_verified for r in rounds),
    )


def run_s3(scale: float, workdir: Path, log: Log, repeats: int = REPEATS) -> S3Result:
    """Measure the ``s3`` workload at ``scale``; ``workdir`` must be an empty directory."""
    log(f"{NAME}: building the dense state")
    state = build("dense", scale).state()
    size = object_size_for(scale)
    objects = split_objects((measure.raw_bytes(t) for _, t in measure.tensor_leaves(state)), size)
    defaults = casckpt_transfer_defaults()
    with fake_aws_environment(workdir), moto_server() as endpoint:
        log(f"{NAME}: moto S3 server at {endpoint} (in-process, loopback)")
        client = s3_client(endpoint, defaults)
        client.create_bucket(Bucket=BUCKET)
        warm_up(client)
        setup = _Setup(endpoint, client, workdir, state, objects, size, defaults)
        rounds = []
        for index in range(repeats):
            log(f"{NAME}: round {index + 1}/{repeats}: boto3 upload ({len(objects)} objects), "
                "casckpt commit, boto3 download, casckpt restore")
            rounds.append(_round(setup, index))
        client.close()
    return _summarize(setup, endpoint, rounds)
