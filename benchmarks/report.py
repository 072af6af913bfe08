"""Ratios against the same-run baseline, targets from BENCHMARKS.md, tables and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks import measure
from benchmarks.catalog import NAME as CATALOG_NAME
from benchmarks.catalog import CatalogResult
from benchmarks.copy_bench import FLOORS as COPY_FLOORS
from benchmarks.copy_bench import MEASURES as COPY_MEASURES
from benchmarks.copy_bench import NAME as COPY_NAME
from benchmarks.copy_bench import NOTES as COPY_NOTES
from benchmarks.copy_bench import TARGETS as COPY_TARGETS
from benchmarks.copy_bench import CopyResult
from benchmarks.copy_bench import raw_table as copy_raw_table
from benchmarks.dcp import NAME as DCP_NAME
from benchmarks.dcp import DcpResult, Pair
from benchmarks.delta import MEASURES as DELTA_MEASURES
from benchmarks.delta import NAME as DELTA_NAME
from benchmarks.delta import NOTES as DELTA_NOTES
from benchmarks.delta import TARGETS as DELTA_TARGETS
from benchmarks.delta import DeltaResult
from benchmarks.delta import tables as delta_tables
from benchmarks.ds_zero import MEASURES as DEEPSPEED_MEASURES
from benchmarks.ds_zero import NAME as DEEPSPEED_NAME
from benchmarks.ds_zero import NOTES as DEEPSPEED_NOTES
from benchmarks.ds_zero import TARGETS as DEEPSPEED_TARGETS
from benchmarks.ds_zero import DeepSpeedResult
from benchmarks.ds_zero import raw_table as deepspeed_raw_table
from benchmarks.encryption import MEASURES as ENCRYPTION_MEASURES
from benchmarks.encryption import NAME as ENCRYPTION_NAME
from benchmarks.encryption import NOTES as ENCRYPTION_NOTES
from benchmarks.encryption import TARGETS as ENCRYPTION_TARGETS
from benchmarks.encryption import EncryptionResult
from benchmarks.encryption import raw_table as encryption_raw_table
from benchmarks.hf import MEASURES as HF_MEASURES
from benchmarks.hf import NAME as HF_NAME
from benchmarks.hf import NOTES as HF_NOTES
from benchmarks.hf import TARGETS as HF_TARGETS
from benchmarks.hf import HfResult
from benchmarks.hf import raw_table as hf_raw_table
from benchmarks.hint import MEASURES as HINT_MEASURES
from benchmarks.hint import NAME as HINT_NAME
from benchmarks.hint import NOTES as HINT_NOTES
from benchmarks.hint import TARGETS as HINT_TARGETS
from benchmarks.hint import HintResult
from benchmarks.hint import raw_table as hint_raw_table
from benchmarks.importing import MEASURES as IMPORT_MEASURES
from benchmarks.importing import NAME as IMPORT_NAME
from benchmarks.importing import NOTES as IMPORT_NOTES
from benchmarks.importing import ImportResult
from benchmarks.importing import raw_table as import_raw_table
from benchmarks.lightning_ckpt import MEASURES as LIGHTNING_MEASURES
from benchmarks.lightning_ckpt import NAME as LIGHTNING_NAME
from benchmarks.lightning_ckpt import NOTES as LIGHTNING_NOTES
from benchmarks.lightning_ckpt import LightningResult
from benchmarks.lightning_ckpt import table as lightning_table
from benchmarks.many import NAME as MANY_NAME
from benchmarks.many import ManyResult, ManyState
from benchmarks.mcore import MEASURES as MEGATRON_MEASURES
from benchmarks.mcore import NAME as MEGATRON_NAME
from benchmarks.mcore import NOTES as MEGATRON_NOTES
from benchmarks.mcore import TARGETS as MEGATRON_TARGETS
from benchmarks.mcore import MegatronResult
from benchmarks.mcore import raw_table as megatron_raw_table
from benchmarks.peers import NAME as PEERS_NAME
from benchmarks.peers import PeersResult
from benchmarks.peers_report import MEASURES as PEERS_MEASURES
from benchmarks.peers_report import NOTES as PEERS_NOTES
from benchmarks.peers_report import TARGETS as PEERS_TARGETS
from benchmarks.peers_report import raw_table as peers_raw_table
from benchmarks.redundancy import EC, RedundancyResult
from benchmarks.redundancy import NAME as REDUNDANCY_NAME
from benchmarks.s3 import NAME as S3_NAME
from benchmarks.s3 import S3Result, Timing
from benchmarks.startup import MEASURES as STARTUP_MEASURES
from benchmarks.startup import NAME as STARTUP_NAME
from benchmarks.startup import NOTES as STARTUP_NOTES
from benchmarks.startup import TARGETS as STARTUP_TARGETS
from benchmarks.startup import StartupResult
from benchmarks.startup import table as startup_table
from benchmarks.suite import WorkloadResult
from benchmarks.tiers import FLOORS as TIERS_FLOORS
from benchmarks.tiers import MEASURES as TIERS_MEASURES
from benchmarks.tiers import NAME as TIERS_NAME
from benchmarks.tiers import NOTES as TIERS_NOTES
from benchmarks.tiers import TARGETS as TIERS_TARGETS
from benchmarks.tiers import TiersResult
from benchmarks.tiers import raw_table as tiers_raw_table

Result = (WorkloadResult | S3Result | CatalogResult | RedundancyResult | DcpResult | DeltaResult
          | ManyResult | HintResult | PeersResult | StartupResult | ImportResult
          | HfResult | LightningResult | EncryptionResult | TiersResult | DeepSpeedResult
          | MegatronResult | CopyResult)
Outcome = Result | str  # a result, or the error that stopped the workload
R = TypeVar("R", WorkloadResult, S3Result, CatalogResult, RedundancyResult, DcpResult, DeltaResult,
            ManyResult, HintResult, PeersResult, StartupResult, ImportResult, HfResult,
            LightningResult, EncryptionResult, TiersResult, DeepSpeedResult, MegatronResult, CopyResult)


@dataclass(frozen=True)
class Metric(Generic[R]):
    """One reported figure: a time ratio, or bytes as a fraction of logical bytes.

    ``alts`` are the same measure against the other file baselines
    (``(baseline name, compute)``: safetensors and DCP), shown beside the value.
    ``waive`` returns why the target does not apply to a result (None: it does).
    """

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[R], float | None]
    alts: tuple[tuple[str, Callable[[R], float | None]], ...] = ()
    waive: Callable[[R], str | None] | None = None


def _over(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


MiB = 1 << 20
ASYNC_MEMORY_SLACK = 256 * MiB  # "extra memory <= changed bytes + 256 MiB"
ALT_BASELINES = ("safetensors", "dcp")
ALT_LABELS = {"safetensors": "vs safetensors", "dcp": "vs DCP"}

WorkloadTime = Callable[[WorkloadResult], float | None]


def _vs_file(key: str, label: str, time_of: WorkloadTime, op: Literal["save", "load"]
             ) -> Metric[WorkloadResult]:
    """``time_of`` over torch.save (or torch.load), with safetensors and DCP beside it."""

    def against(baseline: str) -> WorkloadTime:
        return lambda r: _over(time_of(r), getattr(getattr(r, baseline), f"{op}_s"))

    return Metric(key, label, "ratio", against("baseline"),
                  tuple((b, against(b)) for b in ALT_BASELINES))


def _async_changed(r: WorkloadResult) -> int:
    """The bytes that changed before the async commit: by rows where known (embed), else by tensors."""
    a = r.async_commit
    return a.touched_bytes if a.touched_bytes is not None else a.changed_bytes


def _save_rss_of_logical(baseline: str) -> WorkloadTime:
    return lambda r: _over(getattr(r, baseline).save_peak_extra_rss, r.logical_bytes)


ONE_TENSOR_SHARE = 0.05  # the one-tensor target (<= 0.05x full restore) needs a tensor <= 5% of the state


def _one_tensor_waiver(r: WorkloadResult) -> str | None:
    """The one-tensor target is stated for a 1 GiB tensor in a much larger state: waive it where
    the largest tensor is over 5% of the state (even a reader that fetched exactly its bytes
    could not meet it)."""
    share = r.restore.tensor_bytes / r.logical_bytes if r.logical_bytes else 1.0
    if share <= ONE_TENSOR_SHARE:
        return None
    return f"tensor is {share * 100:.3g}% of the state"


def _branch_new(r: WorkloadResult) -> list[int]:
    return [b.commit.version["new_bytes"] for b in r.branches]


def _branch_mean_s(r: WorkloadResult) -> float | None:
    return sum(b.commit.wall_s for b in r.branches) / len(r.branches) if r.branches else None


METRICS: tuple[Metric[WorkloadResult], ...] = (
    _vs_file("commit_first_vs_save", "commit, first version / torch.save",
             lambda r: r.first.wall_s, "save"),
    _vs_file("commit_next_vs_save", "commit, next version / torch.save",
             lambda r: r.next.wall_s, "save"),
    Metric("commit_next_vs_blake3", "commit, next version / BLAKE3 of the state, all cores", "ratio",
           lambda r: _over(r.next.wall_s, r.blake3_s)),
    _vs_file("async_stall_vs_save", "async commit: stall / torch.save",
             lambda r: r.async_commit.stall_s, "save"),
    _vs_file("async_total_vs_save", "async commit: commit + wait / torch.save",
             lambda r: r.async_commit.total_s, "save"),
    Metric("async_stall_vs_sync", "async commit: stall / blocking commit (next)", "ratio",
           lambda r: _over(r.async_commit.stall_s, r.next.wall_s)),
    Metric("async_total_vs_sync", "async commit: commit + wait / blocking commit (next)", "ratio",
           lambda r: _over(r.async_commit.total_s, r.next.wall_s)),
    _vs_file("restore_vs_load", "restore, full / torch.load", lambda r: r.restore.full_s, "load"),
    Metric("tensor_vs_restore", "load_tensor, largest / full restore", "ratio",
           lambda r: _over(r.restore.tensor_s, r.restore.full_s), waive=_one_tensor_waiver),
    Metric("tensor_share_of_logical", "largest tensor / logical", "fraction",
           lambda r: _over(r.restore.tensor_bytes, r.logical_bytes)),
    Metric("changed_of_logical", "bytes that changed / logical", "fraction",
           lambda r: _over(r.changed_bytes, r.logical_bytes)),
    Metric("touched_of_logical", "bytes that changed, by rows / logical", "fraction",
           lambda r: _over(r.touched_bytes, r.logical_bytes)),
    Metric("new_first_of_logical", "new bytes, first / logical", "fraction",
           lambda r: _over(r.first.version["new_bytes"], r.logical_bytes)),
    Metric("new_next_of_logical", "new bytes, next / logical", "fraction",
           lambda r: _over(r.next.version["new_bytes"], r.logical_bytes)),
    Metric("new_next_vs_changed", "new bytes, next / bytes that changed", "ratio",
           lambda r: _over(r.next.version["new_bytes"], r.changed_bytes)),
    Metric("new_next_vs_touched", "new bytes, next / bytes that changed, by rows", "ratio",
           lambda r: _over(r.next.version["new_bytes"], r.touched_bytes)),
    Metric("new_async_of_logical", "new bytes, async commit / logical", "fraction",
           lambda r: _over(r.async_commit.version["new_bytes"], r.logical_bytes)),
    Metric("stored_first_of_logical", "stored bytes, first / logical", "fraction",
           lambda r: _over(r.first.version["stored_bytes"], r.logical_bytes)),
    Metric("stored_next_of_logical", "stored bytes, next / logical", "fraction",
           lambda r: _over(r.next.version["stored_bytes"], r.logical_bytes)),
    Metric("branch_new_mean_of_logical", "new bytes per branch (mean) / logical", "fraction",
           lambda r: _over(sum(_branch_new(r)) / len(r.branches), r.logical_bytes)
           if r.branches else None),
    Metric("branch_new_max_of_logical", "new bytes per branch (max) / logical", "fraction",
           lambda r: _over(max(_branch_new(r)), r.logical_bytes) if r.branches else None),
    Metric("branch_new_vs_changed", "new bytes, all branches / their changed bytes", "ratio",
           lambda r: _over(sum(_branch_new(r)), sum(b.changed_bytes for b in r.branches))
           if r.branches else None),
    _vs_file("branch_commit_vs_save", "commit per branch (mean) / torch.save", _branch_mean_s, "save"),
    Metric("rss_save_of_logical", "peak extra RSS, torch.save / logical", "fraction",
           lambda r: _over(r.baseline.save_peak_extra_rss, r.logical_bytes),
           tuple((b, _save_rss_of_logical(b)) for b in ALT_BASELINES)),
    Metric("rss_first_of_logical", "peak extra RSS, commit first / logical", "fraction",
           lambda r: _over(r.first.peak_extra_rss, r.logical_bytes)),
    Metric("rss_next_of_logical", "peak extra RSS, commit next / logical", "fraction",
           lambda r: _over(r.next.peak_extra_rss, r.logical_bytes)),
    Metric("rss_async_of_logical", "peak extra RSS, async commit + wait / logical", "fraction",
           lambda r: _over(r.async_commit.peak_extra_rss, r.logical_bytes)),
    Metric("rss_async_vs_budget", "peak extra RSS, async / (changed + 256 MiB)", "ratio",
           lambda r: _over(r.async_commit.peak_extra_rss, _async_changed(r) + ASYNC_MEMORY_SLACK)),
    Metric("staged_async_vs_changed", "async: bytes copied (peak_staged) / changed", "ratio",
           lambda r: _over(r.async_commit.peak_staged, r.async_commit.changed_bytes)),
)

S3_METRICS: tuple[Metric[S3Result], ...] = (
    Metric(
        "commit_vs_raw_upload",
        "commit MB/s / raw boto3 upload MB/s",
        "ratio",
        lambda r: _over(r.commit.mb_per_s, r.raw_upload.mb_per_s),
    ),
    Metric(
        "restore_vs_raw_download",
        "restore MB/s / raw boto3 download MB/s",
        "ratio",
        lambda r: _over(r.restore.mb_per_s, r.raw_download.mb_per_s),
    ),
    Metric(
        "stored_first_of_logical",
        "stored bytes, first / logical",
        "fraction",
        lambda r: _over(r.stored_bytes, r.logical_bytes),
    ),
)

CATALOG_METRICS: tuple[Metric[CatalogResult], ...] = (  # on the tree versions commits write
    Metric("log_s", "Store.log(run), all 10,000 versions", "seconds",
           lambda r: r.trees.log_all.median_s),
    Metric("history_changed_s", "Store.history, tensor changed in every version", "seconds",
           lambda r: r.trees.history_trained.median_s),
    Metric("history_unchanged_s", "Store.history, tensor never changed", "seconds",
           lambda r: r.trees.history_frozen.median_s),
    Metric("history_changed_rows_s", "Store.history, changed every version, format-1 rows", "seconds",
           lambda r: r.history_trained.median_s),
    Metric("log_rows_s", "Store.log(run), format-1 rows", "seconds", lambda r: r.log_all.median_s),
    Metric("log_filtered_s", "Store.log(run, where=2 predicates, min_step, limit=20)", "seconds",
           lambda r: r.log_filtered.median_s),
)


def _scheme_over(num: str, den: str, field: str) -> Callable[[RedundancyResult], float | None]:
    """``field`` of scheme ``num`` over the same field of scheme ``den`` (None if one is absent)."""

    def compute(r: RedundancyResult) -> float | None:
        a, b = r.scheme(num), r.scheme(den)
        return None if a is None or b is None else _over(getattr(a, field), getattr(b, field))

    return compute


def _commit_cpu_over(num: str, den: str) -> Callable[[RedundancyResult], float | None]:
    """CPU seconds of a first commit (the process and its encoding workers), ``num`` / ``den``."""

    def compute(r: RedundancyResult) -> float | None:
        a, b = r.scheme(num), r.scheme(den)
        if a is None or b is None or a.commit_worker_cpu_s is None or b.commit_worker_cpu_s is None:
            return None
        return _over(a.commit_cpu_s + a.commit_worker_cpu_s, b.commit_cpu_s + b.commit_worker_cpu_s)

    return compute


def _ec_over_floor(r: RedundancyResult) -> float | None:
    """The ``ec`` first commit over its floor measured in the same run (benchmarks/ecfloor.py)."""
    run = r.scheme(EC)
    return None if run is None else _over(run.commit_s, r.ec_floor.seconds)


def _scheme_vs(spec: str, field: str, baseline: str) -> Callable[[RedundancyResult], float | None]:
    """``field`` of scheme ``spec`` over the torch baseline's ``baseline`` field."""

    def compute(r: RedundancyResult) -> float | None:
        run = r.scheme(spec)
        return None if run is None else _over(getattr(run, field), getattr(r.baseline, baseline))

    return compute


def _scheme_rss(spec: str) -> Callable[[RedundancyResult], float | None]:
    def compute(r: RedundancyResult) -> float | None:
        run = r.scheme(spec)
        return None if run is None else _over(run.commit_peak_extra_rss, r.logical_bytes)

    return compute


def _degraded_over(spec: str) -> Callable[[RedundancyResult], float | None]:
    def compute(r: RedundancyResult) -> float | None:
        run = r.scheme(spec)
        return None if run is None else _over(r.degraded.restore_s, run.restore_s)

    return compute


def _repair_vs_commit(r: RedundancyResult) -> float | None:
    run = r.scheme(EC)
    return None if run is None else _over(r.repair.repair_s, run.commit_s)


def _scrub_mb_per_s(r: RedundancyResult) -> float | None:
    return _over(r.scrub.ec_pack_bytes / 1e6, r.scrub.ec_s)


REDUNDANCY_METRICS: tuple[Metric[RedundancyResult], ...] = (
    Metric("commit_none_vs_save", "commit, none / torch.save", "ratio",
           _scheme_vs("none", "commit_s", "save_s")),
    Metric("commit_ec_vs_save", f"commit, {EC} / torch.save", "ratio",
           _scheme_vs(EC, "commit_s", "save_s")),
    Metric("commit_ec_vs_none", f"commit, {EC} / none", "ratio",
           _scheme_over(EC, "none", "commit_s")),
    Metric("commit_ec_vs_floor", f"commit, {EC} / its floor (encode on all cores + write shards)",
           "ratio", _ec_over_floor),
    Metric("commit_cpu_ec_vs_none", f"commit CPU (process + encoding workers), {EC} / none", "ratio",
           _commit_cpu_over(EC, "none")),
    Metric("commit_replicate_vs_none", "commit, replicate:2 / none", "ratio",
           _scheme_over("replicate:2", "none", "commit_s")),
    Metric("disk_ec_vs_none", f"pack bytes on disk, {EC} / none", "ratio",
           _scheme_over(EC, "none", "pack_bytes_on_disk")),
    Metric("disk_replicate_vs_none", "pack bytes on disk, replicate:2 / none", "ratio",
           _scheme_over("replicate:2", "none", "pack_bytes_on_disk")),
    Metric("rss_commit_none_of_logical", "peak extra RSS, commit none / logical", "fraction",
           _scheme_rss("none")),
    Metric("rss_commit_ec_of_logical", f"peak extra RSS, commit {EC} / logical", "fraction",
           _scheme_rss(EC)),
    Metric("rss_commit_replicate_of_logical", "peak extra RSS, commit replicate:2 / logical",
           "fraction", _scheme_rss("replicate:2")),
    Metric("restore_none_vs_load", "restore, none / torch.load", "ratio",
           _scheme_vs("none", "restore_s", "load_s")),
    Metric("restore_ec_vs_load", f"restore, {EC} healthy / torch.load", "ratio",
           _scheme_vs(EC, "restore_s", "load_s")),
    Metric("restore_ec_vs_none", f"restore, {EC} healthy / none", "ratio",
           _scheme_over(EC, "none", "restore_s")),
    Metric("restore_degraded_vs_none", f"restore, {EC} degraded (2 shards lost) / none", "ratio",
           _degraded_over("none")),
    Metric("restore_degraded_vs_healthy", f"restore, {EC} degraded / {EC} healthy", "ratio",
           _degraded_over(EC)),
    Metric("restore_replicate_vs_none", "restore, replicate:2 / none", "ratio",
           _scheme_over("replicate:2", "none", "restore_s")),
    Metric("scrub_ec_vs_none", f"check(read_data), {EC} / none", "ratio",
           lambda r: _over(r.scrub.ec_s, r.scrub.none_s)),
    Metric("scrub_ec_mb_per_s", f"check(read_data), {EC}: pack MB/s", "mb_per_s", _scrub_mb_per_s),
    Metric("repair_vs_commit_ec", f"repair after losing 1 of 6 locations / commit, {EC}", "ratio",
           _repair_vs_commit),
    Metric("repair_s", "repair after losing 1 of 6 locations", "seconds",
           lambda r: r.repair.repair_s),
    Metric("encode_mb_per_s", "ErasureCode(4, 2).encode, 64 MiB: MB/s", "mb_per_s",
           lambda r: r.codec.encode_mb_per_s),
    Metric("decode_mb_per_s", "ErasureCode(4, 2).decode, 2 data lost: MB/s", "mb_per_s",
           lambda r: r.codec.decode_mb_per_s),
    Metric("encode_vs_copy", "encode MB/s / memory copy MB/s", "ratio",
           lambda r: _over(r.codec.encode_mb_per_s, r.codec.copy_mb_per_s)),
)


def _dcp_vs_files(op: str) -> Callable[[DcpResult], float | None]:
    """casckpt's time for ``op`` over FileSystemWriter's / FileSystemReader's."""
    return lambda r: _over(r.pairs()[op].casckpt_s, r.pairs()[op].filesystem_s)


def _dcp_bytes(op: str, field: str) -> Callable[[DcpResult], float | None]:
    """``field`` of the Version casckpt's save ``op`` made, over the state's logical bytes."""

    def compute(r: DcpResult) -> float | None:
        version = r.pairs()[op].version
        return None if version is None else _over(version[field], r.logical_bytes)

    return compute


def _dcp_one_rank_vs_boundary(r: DcpResult) -> float | None:
    version = r.reshard_save.version
    return None if version is None else _over(version["new_bytes"], r.boundary_bytes)


DCP_METRICS: tuple[Metric[DcpResult], ...] = (
    Metric("save_first_vs_fs", "dcp.save, first, 2 ranks / FileSystemWriter", "ratio",
           _dcp_vs_files("first")),
    Metric("load_vs_fs", "dcp.load, full, verified, 2 ranks / FileSystemReader", "ratio",
           _dcp_vs_files("load")),
    Metric("save_dense_vs_fs", "dcp.save after a dense update, 2 ranks / FileSystemWriter", "ratio",
           _dcp_vs_files("dense")),
    Metric("save_unchanged_vs_fs", "dcp.save, unchanged, 2 ranks / FileSystemWriter", "ratio",
           _dcp_vs_files("unchanged")),
    Metric("load_one_rank_vs_fs", "dcp.load of the 2-rank save on 1 rank / FileSystemReader", "ratio",
           _dcp_vs_files("reshard_load")),
    Metric("save_one_rank_vs_fs", "dcp.save from 1 rank, full tensors / FileSystemWriter", "ratio",
           _dcp_vs_files("reshard_save")),
    Metric("new_first_of_logical", "new bytes, first / logical", "fraction",
           _dcp_bytes("first", "new_bytes")),
    Metric("new_dense_of_logical", "new bytes, after a dense update / logical", "fraction",
           _dcp_bytes("dense", "new_bytes")),
    Metric("new_unchanged_of_logical", "new bytes, unchanged / logical", "fraction",
           _dcp_bytes("unchanged", "new_bytes")),
    Metric("new_one_rank_of_logical", "new bytes, same state saved from 1 rank / logical", "fraction",
           _dcp_bytes("reshard_save", "new_bytes")),
    Metric("boundary_of_logical", "chunks cut by the 2-rank shard boundaries / logical", "fraction",
           lambda r: _over(r.boundary_bytes, r.logical_bytes)),
    Metric("new_one_rank_vs_boundary", "new bytes, 1-rank save / chunks cut by the boundaries", "ratio",
           _dcp_one_rank_vs_boundary),
    Metric("stored_first_of_logical", "stored bytes, first / logical", "fraction",
           _dcp_bytes("first", "stored_bytes")),
    Metric("stored_dense_of_logical", "stored bytes, after a dense update / logical", "fraction",
           _dcp_bytes("dense", "stored_bytes")),
)

DELTA_METRICS: tuple[Metric[DeltaResult], ...] = tuple(Metric(*m) for m in DELTA_MEASURES)
STARTUP_METRICS: tuple[Metric[StartupResult], ...] = tuple(Metric(*m) for m in STARTUP_MEASURES)
HF_METRICS: tuple[Metric[HfResult], ...] = tuple(Metric(*m) for m in HF_MEASURES)

HINT_METRICS: tuple[Metric[HintResult], ...] = tuple(Metric(*m) for m in HINT_MEASURES)
PEERS_METRICS: tuple[Metric[PeersResult], ...] = tuple(
    Metric(m.key, m.label, m.kind, m.compute, waive=m.waive) for m in PEERS_MEASURES)
IMPORT_METRICS: tuple[Metric[ImportResult], ...] = tuple(Metric(*m) for m in IMPORT_MEASURES)
LIGHTNING_METRICS: tuple[Metric[LightningResult], ...] = tuple(Metric(*m) for m in LIGHTNING_MEASURES)
ENCRYPTION_METRICS: tuple[Metric[EncryptionResult], ...] = tuple(Metric(*m) for m in ENCRYPTION_MEASURES)
TIERS_METRICS: tuple[Metric[TiersResult], ...] = tuple(Metric(*m) for m in TIERS_MEASURES)
DEEPSPEED_METRICS: tuple[Metric[DeepSpeedResult], ...] = tuple(Metric(*m) for m in DEEPSPEED_MEASURES)
MEGATRON_METRICS: tuple[Metric[MegatronResult], ...] = tuple(Metric(*m) for m in MEGATRON_MEASURES)
COPY_METRICS: tuple[Metric[CopyResult], ...] = tuple(Metric(*m) for m in COPY_MEASURES)

# (workload or "*", metric key) -> lower limit, from BENCHMARKS.md "Targets".
FLOORS: Mapping[tuple[str, str], float] = {
    (S3_NAME, "commit_vs_raw_upload"): 0.8,
    (S3_NAME, "restore_vs_raw_download"): 0.8,
    **{(TIERS_NAME, key): limit for key, limit in TIERS_FLOORS.items()},
    **{(COPY_NAME, key): limit for key, limit in COPY_FLOORS.items()},
}

# (workload or "*", metric key) -> upper limit, from BENCHMARKS.md "Targets".
MANY_TARGETS = {  # issue 15
    **{f"{n}_commit_first_vs_save": 1.5 for n in ("20k", "100k")},
    **{f"{n}_commit_unchanged_vs_save": 0.25 for n in ("20k", "100k")},
    **{f"{n}_restore_vs_load": 1.0 for n in ("20k", "100k")},
    **{f"{n}_catalog_unchanged_kib": 16.0 for n in ("20k", "100k")},
    "100k_show_s": 0.3, "100k_cli_show_s": 1.0, "100k_load_tensor_s": 0.05, "100k_diff_s": 0.2,
}

TARGETS: Mapping[tuple[str, str], float] = {
    ("unchanged", "commit_next_vs_save"): 0.1,
    ("unchanged", "commit_next_vs_blake3"): 1.3,  # issue 17: the floor of a verified re-commit
    ("lora", "new_next_of_logical"): 0.02,
    ("embed", "new_next_of_logical"): 0.10,  # plain chunk dedup
    # stored bytes per commit with delta coding (XOR + zstd; not in casckpt yet)
    ("dense", "stored_next_of_logical"): 0.7,
    ("dense-bf16", "stored_next_of_logical"): 0.35,
    ("embed", "stored_next_of_logical"): 0.02,
    ("*", "async_stall_vs_sync"): 0.15,
    ("*", "rss_async_vs_budget"): 1.0,
    ("unchanged", "new_next_of_logical"): 0.001,
    ("frozen", "new_next_vs_changed"): 1.15,
    ("frozen", "commit_next_vs_save"): 0.3,
    ("dense", "commit_first_vs_save"): 1.0,
    ("*", "restore_vs_load"): 1.0,
    ("*", "tensor_vs_restore"): 0.05,
    (CATALOG_NAME, "log_s"): 0.100,
    (CATALOG_NAME, "history_changed_s"): 0.200,
    (CATALOG_NAME, "history_unchanged_s"): 0.200,
    # "restore, full, verified <= 1.0x torch.load" holds for every healthy store
    (REDUNDANCY_NAME, "restore_none_vs_load"): 1.0,
    (REDUNDANCY_NAME, "restore_ec_vs_load"): 1.0,
    (REDUNDANCY_NAME, "commit_ec_vs_none"): 1.5,  # issue 17: "ec:4+2 first commit <= 1.5x without"
    (REDUNDANCY_NAME, "commit_ec_vs_floor"): 1.1,  # issue 32: "<= 1.1x its floor, same run"
    # "unchanged re-commit: new bytes <= 0.1% of logical", through DCP on 2 ranks
    (DCP_NAME, "new_unchanged_of_logical"): 0.001,
    **{(DELTA_NAME, key): limit for key, limit in DELTA_TARGETS.items()},
    **{(STARTUP_NAME, key): limit for key, limit in STARTUP_TARGETS.items()},
    **{(HF_NAME, key): limit for key, limit in HF_TARGETS.items()},
    **{(MANY_NAME, key): limit for key, limit in MANY_TARGETS.items()},
    **{(HINT_NAME, key): limit for key, limit in HINT_TARGETS.items()},
    **{(PEERS_NAME, key): limit for key, limit in PEERS_TARGETS.items()},
    **{(ENCRYPTION_NAME, key): limit for key, limit in ENCRYPTION_TARGETS.items()},
    **{(TIERS_NAME, key): limit for key, limit in TIERS_TARGETS.items()},
    **{(DEEPSPEED_NAME, key): limit for key, limit in DEEPSPEED_TARGETS.items()},
    **{(MEGATRON_NAME, key): limit for key, limit in MEGATRON_TARGETS.items()},
    **{(COPY_NAME, key): limit for key, limit in COPY_TARGETS.items()},
}


def target_for(workload: str, key: str) -> tuple[float | None, str | None]:
    """The BENCHMARKS.md limit for ``key`` on ``workload`` and its bound (``<=`` or ``>=``)."""
    floor = FLOORS.get((workload, key), FLOORS.get(("*", key)))
    if floor is not None:
        return floor, ">="
    ceiling = TARGETS.get((workload, key), TARGETS.get(("*", key)))
    return ceiling, None if ceiling is None else "<="


def _many(i: int, of: Callable[[ManyState], float | None]) -> Callable[[ManyResult], float | None]:
    def compute(r: ManyResult) -> float | None:
        state = r.state(i)
        return of(state) if state is not None else None
    return compute


def _many_metrics(i: int, label: str) -> tuple[Metric[ManyResult], ...]:
    return (
        Metric(f"{label}_commit_first_vs_save", f"{label}: first commit / torch.save", "ratio",
               _many(i, lambda s: s.commit_first_s / s.save_s)),
        Metric(f"{label}_commit_unchanged_vs_save", f"{label}: unchanged re-commit / torch.save", "ratio",
               _many(i, lambda s: s.commit_unchanged_s / s.save_s)),
        Metric(f"{label}_commit_changed_vs_save", f"{label}: commit of 10 changed / torch.save", "ratio",
               _many(i, lambda s: s.commit_changed_s / s.save_s)),
        Metric(f"{label}_restore_vs_load", f"{label}: restore, full, verified / torch.load", "ratio",
               _many(i, lambda s: s.restore_s / s.load_s)),
        Metric(f"{label}_catalog_unchanged_kib", f"{label}: catalog + manifest KiB, unchanged re-commit",
               "ratio", _many(i, lambda s: s.catalog_unchanged_bytes / 1024)),
        Metric(f"{label}_catalog_changed_kib", f"{label}: catalog + manifest KiB, 10 tensors changed",
               "ratio", _many(i, lambda s: s.catalog_changed_bytes / 1024)),
        Metric(f"{label}_show_s", f"{label}: Store.show summary", "seconds", _many(i, lambda s: s.show_s)),
        Metric(f"{label}_show_tensors_s", f"{label}: Store.show, every tensor", "seconds",
               _many(i, lambda s: s.show_tensors_s)),
        Metric(f"{label}_cli_show_s", f"{label}: casckpt show (new process)", "seconds",
               _many(i, lambda s: s.cli_show_s)),
        Metric(f"{label}_cli_start_s", f"{label}: casckpt --help (start-up alone)", "seconds",
               _many(i, lambda s: s.cli_start_s)),
        Metric(f"{label}_diff_s", f"{label}: diff of versions 10 tensors apart", "seconds",
               _many(i, lambda s: s.diff_s)),
        Metric(f"{label}_load_tensor_s", f"{label}: load_tensor of one tensor", "seconds",
               _many(i, lambda s: s.load_tensor_s)),
    )


MANY_METRICS: tuple[Metric[ManyResult], ...] = (*_many_metrics(0, "20k"), *_many_metrics(1, "100k"))


def metrics_for(result: Result) -> Sequence[Metric[Any]]:
    """The measures reported for ``result``'s kind of workload."""
    if isinstance(result, ManyResult):
        return MANY_METRICS
    if isinstance(result, CatalogResult):
        return CATALOG_METRICS
    if isinstance(result, RedundancyResult):
        return REDUNDANCY_METRICS
    if isinstance(result, DcpResult):
        return DCP_METRICS
    if isinstance(result, DeltaResult):
        return DELTA_METRICS
    if isinstance(result, HintResult):
        return HINT_METRICS
    if isinstance(result, PeersResult):
        return PEERS_METRICS
    if isinstance(result, StartupResult):
        return STARTUP_METRICS
    if isinstance(result, ImportResult):
        return IMPORT_METRICS
    if isinstance(result, HfResult):
        return HF_METRICS
    if isinstance(result, LightningResult):
        return LIGHTNING_METRICS
    if isinstance(result, EncryptionResult):
        return ENCRYPTION_METRICS
    if isinstance(result, TiersResult):
        return TIERS_METRICS
    if isinstance(result, DeepSpeedResult):
        return DEEPSPEED_METRICS
    if isinstance(result, MegatronResult):
        return MEGATRON_METRICS
    if isinstance(result, CopyResult):
        return COPY_METRICS
    return S3_METRICS if isinstance(result, S3Result) else METRICS


def evaluate(result: Result) -> dict[str, dict[str, Any]]:
    """``{metric: {"value", "target", "bound", "met"[, "vs"]}}``; ``met`` is None without a target or value.

    ``bound`` is ``<=`` for an upper limit, ``>=`` for a lower one (S3 throughput ratios).
    ``vs`` (measures timed against a file baseline): the same measure against the
    safetensors and DCP baselines, ``{"safetensors": value, "dcp": value}``; the
    target applies to ``value`` (against torch.save / torch.load) only.
    """
    out: dict[str, dict[str, Any]] = {}
    for metric in metrics_for(result):
        value = metric.compute(result)
        target, bound = target_for(result.name, metric.key)
        waived = metric.waive(result) if metric.waive is not None and target is not None else None
        if waived is not None:
            target = bound = None
        met = None
        if value is not None and target is not None:
            met = value >= target if bound == ">=" else value <= target
        out[metric.key] = {"value": value, "target": target, "bound": bound, "met": met}
        if waived is not None:
            out[metric.key]["waived"] = waived
        if metric.alts:
            out[metric.key]["vs"] = {name: compute(result) for name, compute in metric.alts}
    return out


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "seconds":
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
    if kind == "mb_per_s":
        return f"{value:.0f} MB/s"
    return f"{value:.3g}x" if kind == "ratio" else f"{value * 100:.3g}%"


def _verdict(met: bool | None) -> str:
    return {True: "[green]pass[/]", False: "[red]miss[/]", None: ""}[met]


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s < 10 else f"{s:.1f} s"


def _is_s3(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, S3Result) or (isinstance(outcome, str) and name == S3_NAME)


def _is_catalog(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, CatalogResult) or (isinstance(outcome, str) and name == CATALOG_NAME)


def _is_redundancy(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, RedundancyResult) or (isinstance(outcome, str) and name == REDUNDANCY_NAME)


def _is_dcp(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, DcpResult) or (isinstance(outcome, str) and name == DCP_NAME)


def _is_many(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, ManyResult) or (isinstance(outcome, str) and name == MANY_NAME)


def _is_delta(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, DeltaResult) or (isinstance(outcome, str) and name == DELTA_NAME)


def _is_startup(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, StartupResult) or (isinstance(outcome, str) and name == STARTUP_NAME)


def _is_lightning(name: str, outcome: Outcome) -> bool:
    return isinstance(outcome, LightningResult) or (isinstance(outcome, str) and name == LIGHTNING_NAME)


def _local(outcomes: Mapping[str, Outcome]) -> dict[str, WorkloadResult | str]:
    return {n: r for n, r in outcomes.items()
            if isinstance(r, (WorkloadResult, str)) and not _is_s3(n, r) and not _is_catalog(n, r)
            and not _is_redundancy(n, r) and not _is_dcp(n, r) and not _is_delta(n, r)
            and not _is_many(n, r) and not _is_startup(n, r) and not _is_lightning(n, r)
            and not (isinstance(r, str) and n in (HINT_NAME, PEERS_NAME, IMPORT_NAME, HF_NAME,
                                                        ENCRYPTION_NAME, TIERS_NAME, DEEPSPEED_NAME,
                                                        MEGATRON_NAME, COPY_NAME))}


def _delta(outcomes: Mapping[str, Outcome]) -> dict[str, DeltaResult | str]:
    return {n: r for n, r in outcomes.items() if isinstance(r, (DeltaResult, str)) and _is_delta(n, r)}


def _dcp(outcomes: Mapping[str, Outcome]) -> dict[str, DcpResult | str]:
    return {n: r for n, r in outcomes.items() if isinstance(r, (DcpResult, str)) and _is_dcp(n, r)}


DCP_OPERATIONS = {  # DcpResult.pairs() key -> what the row measured
    "first": "save, first (step 1)",
    "load": "load, full, checked (step 1)",
    "dense": "save after a dense update (step 2)",
    "unchanged": "save, unchanged (step 3)",
    "reshard_load": "load of step 3 onto 1 rank, checked",
    "reshard_save": "save from 1 rank, full tensors (step 4)",
}


def _dcp_row(pair: Pair) -> list[str]:
    v = pair.version
    return [str(pair.ranks), _seconds(pair.casckpt_s), _seconds(pair.filesystem_s),
            _fmt(_over(pair.casckpt_s, pair.filesystem_s), "ratio"),
            "" if v is None else measure.fmt_bytes(v["new_bytes"]),
            "" if v is None else measure.fmt_bytes(v["stored_bytes"]),
            "" if pair.filesystem_bytes is None else measure.fmt_bytes(pair.filesystem_bytes),
            "" if pair.verified is None else _yes(pair.verified)]


def dcp_raw_table(outcomes: Mapping[str, DcpResult | str]) -> Table:
    """DCP workload: each operation through casckpt and through FileSystemWriter/Reader."""
    table = Table(title="DCP raw measurements (gloo on 127.0.0.1; wall = slowest rank; "
                  "FS = FileSystemWriter/Reader, files fsync'd; same directory)")
    for column in ("workload", "operation", "ranks", "casckpt", "FS", "casckpt / FS", "new bytes",
                   "stored bytes", "FS files", "ok"):
        table.add_column(column, justify="left" if column in ("workload", "operation") else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        label = f"{name} ({measure.fmt_bytes(r.logical_bytes)})"
        for key, pair in r.pairs().items():
            table.add_row(label, DCP_OPERATIONS[key], *_dcp_row(pair))
            label = ""
    return table


def _redundancy(outcomes: Mapping[str, Outcome]) -> dict[str, RedundancyResult | str]:
    return {n: r for n, r in outcomes.items()
            if isinstance(r, (RedundancyResult, str)) and _is_redundancy(n, r)}


def _yes(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[red]NO[/]"


def _redundancy_rows(r: RedundancyResult) -> list[tuple[str, str, str, float, int, str]]:
    """(operation, locations, bytes, seconds, bytes the MB/s is of, verified) per measured step."""
    logical = r.logical_bytes
    rows = [("torch.save + fsync", "1 file", measure.fmt_bytes(r.baseline.file_bytes), r.baseline.save_s,
             logical, ""),
            ("torch.load", "1 file", "", r.baseline.load_s, logical, "")]
    fl = r.ec_floor
    each = " ".join(f"{x:.2f}" for x in r.ec_floor_rounds_s)
    rows.append((f"floor of {EC}: encode on {fl.workers} cores + write shards, overlapped (median of "
                 f"{each})", f"{fl.k + fl.m} dirs", measure.fmt_bytes(fl.shard_bytes), fl.seconds,
                 logical, ""))
    for spec, run in r.schemes.items():
        where = f"{run.locations} ({run.pack_files} files)"
        rows.append((f"commit, {spec}", where, measure.fmt_bytes(run.pack_bytes_on_disk), run.commit_s,
                     logical, ""))
    for spec, run in r.schemes.items():
        each = " ".join(f"{x:.2f}" for x in run.restore_rounds_s)
        rows.append((f"restore, {spec} (median of {each})", str(run.locations), "", run.restore_s,
                     logical, _yes(run.restore_verified)))
    d = r.degraded
    rows.append((f"restore, {EC} degraded (shards {','.join(map(str, d.lost_shards))} of every "
                 f"pack deleted; {d.files_healed}/{d.files_deleted} healed)", "6",
                 f"-{measure.fmt_bytes(d.bytes_deleted)}", d.restore_s, logical, _yes(d.verified)))
    sc = r.scrub
    rows.append((f"check(read_data=True), {EC}", "6", measure.fmt_bytes(sc.ec_shard_bytes), sc.ec_s,
                 sc.ec_pack_bytes, _yes(sc.ec_problems == 0)))
    rows.append(("check(read_data=True), none", "1", measure.fmt_bytes(sc.none_pack_bytes), sc.none_s,
                 sc.none_pack_bytes, _yes(sc.none_problems == 0)))
    rp = r.repair
    rows.append((f"repair, {rp.failed_location} deleted + failed ({rp.report['shards_rewritten']} "
                 "shards rewritten)", "5", f"-{measure.fmt_bytes(rp.bytes_deleted)}", rp.repair_s,
                 rp.bytes_deleted, _yes(not rp.report["unrepaired"])))
    rows.append((f"restore, {EC} after repair", "5", "", rp.restore_s, logical, _yes(rp.verified)))
    c = r.codec
    buf = measure.fmt_bytes(c.buffer_bytes)
    rows.append((f"ErasureCode({c.k}, {c.m}).encode ({c.algorithm})", "", buf, c.encode_s,
                 c.buffer_bytes, ""))
    rows.append(("ErasureCode.decode, 2 data fragments lost", "", buf, c.decode_s, c.buffer_bytes,
                 _yes(c.verified)))
    rows.append(("bytearray(buffer): one memory copy", "", buf, c.copy_s, c.buffer_bytes, ""))
    return rows


def redundancy_raw_table(outcomes: Mapping[str, RedundancyResult | str]) -> Table:
    """Redundancy workload: every store, restore, scrub, repair and codec timing."""
    table = Table(title="Redundancy raw measurements (dense state; all locations on the same disk)")
    for column in ("workload", "operation", "locations", "bytes", "wall", "MB/s", "verified"):
        table.add_column(column, justify="left" if column in ("workload", "operation") else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        label = f"{name} ({measure.fmt_bytes(r.logical_bytes)})"
        for op, where, size, seconds, nbytes, ok in _redundancy_rows(r):
            mb_s = f"{nbytes / 1e6 / seconds:.0f}" if seconds > 0 else "n/a"
            table.add_row(label, escape(op), where, size, _seconds(seconds), mb_s, ok)
            label = ""
    return table


def _catalog(outcomes: Mapping[str, Outcome]) -> dict[str, CatalogResult | str]:
    return {n: r for n, r in outcomes.items()
            if isinstance(r, (CatalogResult, str)) and _is_catalog(n, r)}


def catalog_raw_table(outcomes: Mapping[str, CatalogResult | str]) -> Table:
    """Catalog workload: the synthetic catalog and each query's timings."""
    table = Table(title="Catalog raw measurements (SQLite, warm; median of each query's rounds)")
    for column in ("workload", "catalog", "query", "results", "median", "each round"):
        table.add_column(column, justify="left" if column in ("workload", "query") else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        size = (f"{r.versions} versions, {r.tensor_rows} tensor rows, {r.content_rows} contents, "
                f"built in {_seconds(r.build_s)}")
        floor = r.rows_floor.median_s
        for label, q in (("log, all versions", r.log_all), ("log, filtered", r.log_filtered),
                         ("floor: the tensor's rows, sqlite3 alone", r.rows_floor),
                         (f"history, changed every version ({r.history_trained.median_s / floor:.1f}x floor)",
                          r.history_trained),
                         ("history, never changed", r.history_frozen),
                         ("best(run, loss)", r.best), ("tree()", r.tree)):
            table.add_row(name, size, label, str(q.results), f"{q.median_s * 1000:.1f} ms",
                          " ".join(f"{s * 1000:.0f}" for s in q.rounds_s))
            name = size = ""
        t = r.trees
        size = f"{t.versions} tree versions, committed in {_seconds(t.commits_s)}"
        for label, q in (("trees: log, all versions", t.log_all),
                         ("trees: history, changed every version", t.history_trained),
                         ("trees: history, never changed", t.history_frozen)):
            table.add_row("", size, label, str(q.results), f"{q.median_s * 1000:.1f} ms",
                          " ".join(f"{s * 1000:.0f}" for s in q.rounds_s))
            size = ""
    return table


def _s3(outcomes: Mapping[str, Outcome]) -> dict[str, S3Result | str]:
    return {n: r for n, r in outcomes.items()
            if isinstance(r, (S3Result, str)) and _is_s3(n, r)}


def _s3_rows(r: S3Result) -> list[tuple[str, str, int, Timing, list[float], bool]]:
    """(operation, objects, bytes sent, median timing, each round's seconds, verified) per step."""
    first = r.rounds[0]
    raw_objects = f"{r.raw_objects} x {measure.fmt_bytes(r.object_size)}"
    packs = f"{first.casckpt_objects} incl. manifest"
    raw_ok = all(x.raw_verified for x in r.rounds)
    ours_ok = all(x.restore_verified for x in r.rounds)
    return [
        ("boto3 upload", raw_objects, r.logical_bytes, r.raw_upload,
         [x.raw_upload_s for x in r.rounds], raw_ok),
        ("casckpt commit", packs, first.casckpt_object_bytes, r.commit,
         [x.commit_s for x in r.rounds], ours_ok),
        ("boto3 download", raw_objects, r.logical_bytes, r.raw_download,
         [x.raw_download_s for x in r.rounds], raw_ok),
        ("casckpt restore", packs, first.casckpt_object_bytes, r.restore,
         [x.restore_s for x in r.rounds], ours_ok),
    ]


def s3_raw_table(outcomes: Mapping[str, S3Result | str]) -> Table:
    """S3 workload: raw boto3 transfer and casckpt of the same state, times and MB/s."""
    table = Table(title="S3 raw measurements (moto in-process on loopback; same run, same bucket)")
    for column in ("workload", "operation", "objects", "bytes sent", "wall (median)",
                   "MB/s of state", "each round", "verified"):
        table.add_column(column, justify="left" if column in ("workload", "operation") else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        for op, objects, sent, timing, each, ok in _s3_rows(r):
            table.add_row(
                name, op, objects, measure.fmt_bytes(sent), _seconds(timing.wall_s),
                f"{timing.mb_per_s:.0f}", " ".join(f"{s:.2f}" for s in each),
                "[green]yes[/]" if ok else "[red]NO[/]",
            )
        table.add_section()
    return table


def baseline_table(outcomes: Mapping[str, WorkloadResult | str]) -> Table:
    """The three file baselines of each workload: bytes on disk, save (fsync'd) and load times."""
    table = Table(title="Baselines on the first state (same run, same directory; saves fsync'd; "
                  "st = safetensors, tensors only)")
    for column in ("workload", "logical", "torch save", "torch load", "torch file", "st save",
                   "st load", "st file", "DCP save", "DCP load", "DCP files"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        cells = [name, measure.fmt_bytes(r.logical_bytes)]
        for b in (r.baseline, r.safetensors, r.dcp):
            cells += [_seconds(b.save_s), _seconds(b.load_s), measure.fmt_bytes(b.file_bytes)]
        table.add_row(*cells)
    return table


def raw_table(outcomes: Mapping[str, WorkloadResult | str]) -> Table:
    """Absolute sizes and times of casckpt, for reading the ratios against."""
    table = Table(title="casckpt raw measurements (same run, same directory; see benchmarks/README.md)")
    for column in ("workload", "changed", "commit 1st", "commit next", "async stall",
                   "async total", "staged", "restore", "1 tensor", "its size", "ok"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        verified = r.restore.full_matches and r.restore.tensor_matches
        a = r.async_commit
        table.add_row(
            name,
            measure.fmt_bytes(r.changed_bytes),
            _seconds(r.first.wall_s),
            _seconds(r.next.wall_s),
            _seconds(a.stall_s),
            _seconds(a.total_s),
            "n/a" if a.peak_staged is None else measure.fmt_bytes(a.peak_staged),
            _seconds(r.restore.full_s),
            _seconds(r.restore.tensor_s),
            measure.fmt_bytes(r.restore.tensor_bytes),
            "[green]yes[/]" if verified else "[red]NO[/]",
        )
    return table


def branch_table(outcomes: Mapping[str, WorkloadResult | str]) -> Table | None:
    """One row per branch of the ``branch`` workload (None when no workload has branches)."""
    rows = [(name, r) for name, r in outcomes.items() if isinstance(r, WorkloadResult) and r.branches]
    if not rows:
        return None
    table = Table(title="Branches (each forked from the base version, one interval, committed)")
    for column in ("workload", "run", "logical", "changed", "new bytes", "new / logical",
                   "stored bytes", "commit", "commit / torch.save"):
        table.add_column(column, justify="left" if column in ("workload", "run") else "right")
    for name, r in rows:
        for b in r.branches:
            v = b.commit.version
            table.add_row(name, b.run, measure.fmt_bytes(r.logical_bytes), measure.fmt_bytes(b.changed_bytes),
                          measure.fmt_bytes(v["new_bytes"]),
                          _fmt(_over(v["new_bytes"], r.logical_bytes), "fraction"),
                          measure.fmt_bytes(v["stored_bytes"]), _seconds(b.commit.wall_s),
                          _fmt(_over(b.commit.wall_s, r.baseline.save_s), "ratio"))
            name = ""
    return table


def ratio_table(outcomes: Mapping[str, Outcome], scale: float) -> Table:
    """Every metric of every workload, with its BENCHMARKS.md target and pass/miss.

    ``value`` is against torch.save / torch.load (where a measure is timed
    against a file baseline); the same measure against safetensors and DCP is
    shown beside it. Rows with no value and no target (e.g. branch measures of
    other workloads) are left out, unless the target was waived (a peer tool absent).
    """
    table = Table(title=f"casckpt vs same-run baselines (scale {scale:g})")
    for column in ("workload", "measure", "value", *ALT_LABELS.values(), "target", "result"):
        table.add_column(column, justify="left" if column in ("workload", "measure", "result")
                         else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, f"[red]crashed: {escape(r)}[/]")
            continue
        scores = evaluate(r)
        for metric in metrics_for(r):
            score = scores[metric.key]
            target = score["target"]
            if score["value"] is None and target is None and "waived" not in score:
                continue
            alts = score.get("vs", {})
            table.add_row(
                name,
                metric.label,
                _fmt(score["value"], metric.kind),
                *(_fmt(alts[b], metric.kind) if b in alts else "" for b in ALT_LABELS),
                "" if target is None else f"{score['bound']} {_fmt(target, metric.kind)}",
                "[dim]waived[/]" if "waived" in score else _verdict(score["met"]),
            )
        table.add_section()
    return table


def print_report(console: Console, outcomes: Mapping[str, Outcome], scale: float) -> None:
    """Print the raw table(s) of the workloads that ran, then the ratio table."""
    local, s3, catalog = _local(outcomes), _s3(outcomes), _catalog(outcomes)
    redundancy, dcp = _redundancy(outcomes), _dcp(outcomes)
    if local:
        console.print(baseline_table(local))
        console.print(raw_table(local))
        branches = branch_table(local)
        if branches is not None:
            console.print(branches)
    if s3:
        console.print(s3_raw_table(s3))
    if catalog:
        console.print(catalog_raw_table(catalog))
    if redundancy:
        console.print(redundancy_raw_table(redundancy))
    if dcp:
        console.print(dcp_raw_table(dcp))
    for table in delta_tables(_delta(outcomes)):
        console.print(table)
    many = {n: r for n, r in outcomes.items() if isinstance(r, ManyResult)}
    if many:
        console.print(many_raw_table(many))
    hint = {n: r for n, r in outcomes.items() if isinstance(r, HintResult)}
    if hint:
        console.print(hint_raw_table(hint))
    peers = {n: r for n, r in outcomes.items() if isinstance(r, PeersResult)}
    if peers:
        console.print(peers_raw_table(peers))
    imported = {n: r for n, r in outcomes.items() if isinstance(r, ImportResult)}
    if imported:
        console.print(import_raw_table(imported))
    startup = startup_table({n: r for n, r in outcomes.items() if isinstance(r, StartupResult)})
    if startup is not None:
        console.print(startup)
    hf = {n: r for n, r in outcomes.items() if isinstance(r, HfResult)}
    if hf:
        console.print(hf_raw_table(hf))
    lightning = {n: r for n, r in outcomes.items() if isinstance(r, LightningResult)}
    if lightning:
        console.print(lightning_table(lightning))
    encryption = {n: r for n, r in outcomes.items() if isinstance(r, EncryptionResult)}
    if encryption:
        console.print(encryption_raw_table(encryption))
    tiers = {n: r for n, r in outcomes.items() if isinstance(r, TiersResult)}
    if tiers:
        console.print(tiers_raw_table(tiers))
    deepspeed = {n: r for n, r in outcomes.items() if isinstance(r, DeepSpeedResult)}
    if deepspeed:
        console.print(deepspeed_raw_table(deepspeed))
    megatron = {n: r for n, r in outcomes.items() if isinstance(r, MegatronResult)}
    if megatron:
        console.print(megatron_raw_table(megatron))
    copies = {n: r for n, r in outcomes.items() if isinstance(r, CopyResult)}
    if copies:
        console.print(copy_raw_table(copies))
    console.print(ratio_table(outcomes, scale))


def many_raw_table(outcomes: Mapping[str, ManyResult]) -> Table:
    """many-tensors: each state's raw times and catalog growth."""
    table = Table(title="many-tensors raw measurements (fp32, flat dict; SQLite catalog; same directory)")
    for column in ("state", "torch.save", "torch.load", "commit", "unchanged", "10 changed", "restore",
                   "show", "show all", "CLI show", "CLI start", "diff", "load_tensor", "catalog +unchanged",
                   "catalog +10",
                   "store"):
        table.add_column(column, justify="left" if column == "state" else "right")
    for r in outcomes.values():
        for s in r.states:
            table.add_row(
                f"{s.tensors:,} x {s.elements} ({measure.fmt_bytes(s.logical_bytes)})",
                *(_seconds(t) for t in (s.save_s, s.load_s, s.commit_first_s, s.commit_unchanged_s,
                                        s.commit_changed_s, s.restore_s, s.show_s, s.show_tensors_s,
                                        s.cli_show_s, s.cli_start_s, s.diff_s, s.load_tensor_s)),
                measure.fmt_bytes(s.catalog_unchanged_bytes), measure.fmt_bytes(s.catalog_changed_bytes),
                measure.fmt_bytes(s.store_bytes))
    return table


NOTES = {
    "ratios": "every time is divided by a baseline measured in the same run, same directory; "
    "bytes are fractions of the state's logical (tensor) bytes; a metric's 'value' is against "
    "torch.save / torch.load, its 'vs' the same measure against safetensors and DCP; targets "
    "apply to 'value'",
    "baselines": "on the first state: torch.save to a file + flush + fsync, torch.load("
    "weights_only=True); safetensors save_file of the state's tensors flattened to "
    "{dotted path: tensor} + fsync, load_file(backend='pread') (the default mmap backend reads "
    "lazily); torch.distributed.checkpoint save / load with FileSystemWriter (sync_files=True: "
    "each file fsync'd; one thread) / FileSystemReader, one process, no process group "
    "(no_dist=True), loading into a tree of empty tensors allocated inside the timed call",
    "safetensors_tensors_only": "safetensors stores tensors only: the optimizer's param_groups "
    "(lr, betas, ...), int keys, tuples and other plain values are not saved or restored, so its "
    "save and load do less than torch.save, DCP and casckpt",
    "restore_cache": "restore is warm-cache for baselines and casckpt alike: each load reads the "
    "file(s) just written, Store.restore the packs just committed (dropping the page cache is "
    "not possible here)",
    "versions": "step 1: first state, blocking commit; step 2: after one interval, blocking "
    "commit ('next'); step 3: after one more interval, Store.commit(block=False) then "
    "handle.wait() at once ('async'); restore and load_tensor read step 3 and are checked "
    "against the live state",
    "async": "stall_s: until commit(block=False) returned (what training waits for); total_s: "
    "until handle.wait() returned; the stall target compares the stall with the blocking "
    "commit of the previous interval (same kind of change); peak_extra_rss sampled over both; "
    "peak_staged: internals(store).committer.peak_staged, the bytes the background commit copied out of "
    "the state; memory target: peak extra RSS <= that interval's changed bytes (embed: by rows) "
    "+ 256 MiB",
    "changed_bytes": "total size of tensors whose content (BLAKE3 of dtype, shape, data) "
    "differs between the first and next state",
    "touched_bytes": "embed: as changed_bytes, but the embedding table counted by the rows the "
    "interval's lookups touched (unique ids x row bytes)",
    "branch": "base = step 1 of run 'branch'; branches 'branch-0'..'branch-3' forked from it "
    "with Store.fork, each reset to the base, one interval with its own lr and data seed, "
    "committed as step 2; 'next' is branch-0; the async commit is branch-3 step 3",
    "delta_targets": "the stored-bytes targets (dense <= 70%, dense-bf16 <= 35%, embed <= 2% "
    "per commit) assume delta coding (XOR against the previous version + zstd): the step-2 "
    "commit is delta-coded with the store's default chain; the delta workload measures it "
    "against delta coding off",
    "one_tensor": "BENCHMARKS.md states the one-tensor target (<= 0.05x full restore) for a "
    "1 GiB tensor, in a state many times larger; this uses the largest tensor of the state, and "
    "waives the target where that tensor is over 5% of the state (embed: the table is ~99%), "
    "since no reader could meet it there",
    "peak_extra_rss": "max RSS sampled every 2 ms from /proc/self/statm minus RSS at the start",
    "bound": "'<=': the target is an upper limit; '>=': a lower limit",
}

S3_NOTES = {
    "server": "moto ThreadedMotoServer, an in-process Python (werkzeug) server on 127.0.0.1, "
    "sharing this process's CPUs and GIL with the client; absolute MB/s reflect moto's speed, "
    "not S3's or the network's: the casckpt / raw boto3 ratios are what matters",
    "credentials": "fake, set in os.environ for the duration of the workload only",
    "raw": "the dense state's tensor bytes cut into objects of the pack size (64 MiB x scale, "
    "at least 5 MiB), uploaded one after the other with upload_fileobj and downloaded with "
    "download_fileobj, with S3BlobStore's default TransferConfig (multipart threshold, part "
    "size, concurrency) and checksum algorithm; bodies are built before the clock starts",
    "casckpt": "Store.commit of the same state (first version; hashing, compression, staging "
    "file + fsync and upload included) with pack_size = the raw object size, blobs on the "
    "same bucket, catalog SQLite local; then a full Store.restore of that version",
    "rounds": "each round runs raw upload, casckpt commit, raw download, casckpt restore, in "
    "that order, on fresh keys and a fresh store, then deletes what it wrote; raw_upload, "
    "raw_download, commit and restore are the medians over the rounds (each in rounds)",
    "throughput": "logical (tensor) bytes / wall seconds, MB = 10^6 bytes, for all four; "
    "casckpt may upload fewer bytes (compression), counted in casckpt_object_bytes",
    "peak_extra_rss": "commit_peak_extra_rss includes the in-process moto server's buffers, so it "
    "is not reported as a casckpt measure",
}


CATALOG_NOTES = {
    "catalog": "synthetic SQLite catalog written through Catalog.write() (no tensor data): one run "
    "of 10,000 versions x 50 tensors (40 change one chunk of 4 in every version, 10 never do), "
    "metrics, metadata, a random manifest blob of a real manifest's size per version, a tag "
    "every 1,000 versions; --scale does not change it",
    "queries": "through the public Store API of a freshly opened store; one warm-up call, then "
    "5 rounds; medians reported; the history target (200 ms) is checked on both tensors",
    "postgresql": "not measured here; the same queries run on PostgreSQL in "
    "tests/engine/read/test_history.py",
}


REDUNDANCY_NOTES = {
    "state": "the dense workload's state (GPT-style decoder + AdamW, one step taken) at --scale; "
    "default pack size and settings",
    "locations": "plain directories side by side in the work directory, on the same disk: the "
    "figures are the CPU and I/O the redundancy engine adds, not what separate failure domains "
    "(disks, hosts, buckets) would give; ec:4+2 writes 1.5x the bytes to the one disk",
    "schemes": "one fresh store per scheme (none: 1 location, ec:4+2: 6, replicate:2: 2); "
    "first commit of the state (one run each), then 3 rounds of a full restore (warm cache, each "
    "checked) of every store in turn, so drift over the run hits all schemes alike; restore_s is "
    "the median, restore_rounds_s each round",
    "peak_extra_rss": "commit_peak_extra_rss: as for the other workloads (max RSS sampled every "
    "2 ms minus RSS at the start of Store.commit)",
    "pack_bytes_on_disk": "every file under packs/ of the store's locations (whole packs, copies, "
    "shards with their headers)",
    "degraded": "shard files .s0 and .s1 (data shards) of every ec pack deleted behind casckpt's "
    "back, then a full restore: each pack is rebuilt from 2 data + 2 parity shards, verified, "
    "and its 2 lost shards written back (heal on read); casckpt's warnings are counted, not shown",
    "scrub": "store.ops.check(read_data=True) after the degraded restore healed the store: every "
    "shard read in full and checked, every pack rebuilt and verified, every chunk decoded; "
    "MB/s is of the packs' bytes (CheckReport.bytes_read); the none store's check is the baseline",
    "repair": "one location's directory (loc0) deleted, store.locations.fail, then store.ops.repair(); "
    "with 5 active domains for 6 shards, the re-created shard shares a domain with another of "
    "its pack (casckpt warns); a full restore after it checks the result",
    "codec": "casckpt.storage.erasure.ErasureCode(4, 2) on a random 64 MiB buffer: encode (with "
    "casckpt's systematic-layout check) and decode from fragments 2..5; bytearray(buffer) is "
    "one plain memory copy in the same run; medians of 3 rounds; MB = 10^6 bytes",
}


DCP_NOTES = {
    "ranks": "2 spawned processes, torch.distributed gloo on 127.0.0.1, torch.set_num_threads(1) "
    "each (as torchrun sets OMP_NUM_THREADS=1); every rank builds the full tensors from the seed "
    "and keeps its Shard(0) piece (DTensor on a 2-rank CPU DeviceMesh); the optimizer's scalar "
    "step stays a plain replicated tensor",
    "state": "the decoder of the dense workload at --scale (weights as initialised) + AdamW-like "
    "exp_avg / exp_avg_sq of the same shapes and a step per parameter; param_groups as a value",
    "timing": "each rank: gc, barrier, then the clock around dcp.save / dcp.load (writer or "
    "reader construction and, for loads, allocating the target included); the figure is the "
    "slowest rank's; process start-up, imports and building the state are not timed; one tiny "
    "untimed save + load of each kind first",
    "baseline": "FileSystemWriter(dir, sync_files=True) (its default: each file and the metadata "
    "fsync'd; one file per rank, one thread) to a new directory per step; FileSystemReader; "
    "FileSystemWriter first, then casckpt, for every operation",
    "checks": "every load is compared byte for byte with the saved state (tensors) and for "
    "equality (values); a mismatch fails the workload",
    "dense_update": "x * 0.999 + 1e-7 on every element of every tensor, step + 1: every element "
    "and every chunk changes",
    "one_rank": "in the benchmark process (no_dist=True): the full tensors rebuilt from the seed "
    "with the same update; load of the 2-rank step 3 (DCP reshards 2 -> 1) and save as step 4; "
    "boundary_bytes: the chunks the 2-rank shard boundaries cut, on the whole tensor's chunk "
    "grid (the chunk holding each boundary; a tensor under one chunk counts whole): what the "
    "1-rank save cannot share",
}


def write_json(path: Path, outcomes: Mapping[str, Outcome], header: dict[str, Any]) -> None:
    """Write header, notes, raw numbers and evaluated metrics as JSON to ``path``."""
    results: dict[str, Any] = {}
    for name, r in outcomes.items():
        if isinstance(r, str):
            results[name] = {"error": r}
        else:
            results[name] = {"raw": r.to_dict(), "metrics": evaluate(r)}
    notes: dict[str, Any] = dict(NOTES)
    if _s3(outcomes):
        notes[S3_NAME] = S3_NOTES
    if _catalog(outcomes):
        notes[CATALOG_NAME] = CATALOG_NOTES
    if _redundancy(outcomes):
        notes[REDUNDANCY_NAME] = REDUNDANCY_NOTES
    if _dcp(outcomes):
        notes[DCP_NAME] = DCP_NOTES
    if _delta(outcomes):
        notes[DELTA_NAME] = DELTA_NOTES
    if any(isinstance(r, StartupResult) for r in outcomes.values()):
        notes[STARTUP_NAME] = STARTUP_NOTES
    if any(isinstance(r, ManyResult) for r in outcomes.values()):
        notes[MANY_NAME] = "see benchmarks/many.py; KiB figures are kibibytes, not ratios"
    if any(isinstance(r, HintResult) for r in outcomes.values()):
        notes[HINT_NAME] = HINT_NOTES
    if any(isinstance(r, PeersResult) for r in outcomes.values()):
        notes[PEERS_NAME] = PEERS_NOTES
    if any(isinstance(r, ImportResult) for r in outcomes.values()):
        notes[IMPORT_NAME] = IMPORT_NOTES
    if any(isinstance(r, HfResult) for r in outcomes.values()):
        notes[HF_NAME] = HF_NOTES
    if any(isinstance(r, LightningResult) for r in outcomes.values()):
        notes[LIGHTNING_NAME] = LIGHTNING_NOTES
    if any(isinstance(r, EncryptionResult) for r in outcomes.values()):
        notes[ENCRYPTION_NAME] = ENCRYPTION_NOTES
    if any(isinstance(r, TiersResult) for r in outcomes.values()):
        notes[TIERS_NAME] = TIERS_NOTES
    if any(isinstance(r, DeepSpeedResult) for r in outcomes.values()):
        notes[DEEPSPEED_NAME] = DEEPSPEED_NOTES
    if any(isinstance(r, MegatronResult) for r in outcomes.values()):
        notes[MEGATRON_NAME] = MEGATRON_NOTES
    if any(isinstance(r, CopyResult) for r in outcomes.values()):
        notes[COPY_NAME] = COPY_NOTES
    document = {**header, "notes": notes, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
