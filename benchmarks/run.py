"""casckpt benchmark: commit / restore against file baselines in the same run.

The local workloads (dense, dense-bf16, frozen, lora, embed, unchanged, branch)
compare blocking and background commits, full and one-tensor restores with
torch.save / torch.load, safetensors save_file / load_file and
torch.distributed.checkpoint save / load of the same state, in the same
directory. The ``s3`` workload instead compares casckpt on an in-process moto S3 server
with raw boto3 managed transfer of the same bytes; the ``catalog`` workload
times history queries (log, tensor history) on a 10,000-version catalog; the
``redundancy`` workload compares erasure-coded (ec:4+2) and replicated stores
with a single-copy one: commit, stored bytes, healthy and degraded restore,
scrub, repair, and the raw erasure code; the ``dcp`` workload saves and loads
a DTensor state on 2 ranks with torch.distributed.checkpoint through casckpt
and through DCP's own FileSystemWriter/Reader; the ``delta`` workload commits
the same sequences with delta coding on and off: stored bytes, commit time,
and restore at the end of a delta chain against a keyframe; the ``hint`` workload
times an unchanged re-commit against BLAKE3 of the state on all cores, commits
with change hints against torch.save, and the background-commit stall against
``torch.distributed.checkpoint.async_save``'s; the ``peers`` workload saves the same
training run with torch.save, DCP (sync and async), casckpt, borg and restic side by side in
three regimes (full fine-tune, frozen backbone, LoRA-like): save, bytes, restore, stall and
prune, every restore checked bit for bit; the ``startup``
workload times CLI commands, ``casckpt.open`` and cold restores in fresh processes; the
``import`` workload imports a folder of fine-tuning ``.pt`` checkpoints one by one (stored vs
logical bytes, import vs torch.load time); the ``hf``
workload runs a Hugging Face Trainer fine-tune (full, frozen backbone, LoRA) with and without
``casckpt.integrations.transformers.CasckptCallback``: checkpoint-directory bytes vs stored
bytes, time per save, ``checkout_for_resume`` vs ``shutil.copytree``; the ``lightning`` workload trains a
LightningModule with casckpt's CheckpointIO and with Lightning's default one: .ckpt bytes
against stored bytes, save and resume times; the ``tiers`` workload commits to a store with a fast local tier
that drains to S3 throttled to 50 MB/s by a loopback proxy, against a local-only store, the same S3
without the tier, torch.save / torch.load and raw boto3 through the same proxy; the ``deepspeed``
workload trains a 106M-parameter decoder with DeepSpeed ZeRO-2 on 2 gloo ranks and saves it with
DeepSpeed's TorchCheckpointEngine and with casckpt's engine (full and frozen-backbone regimes, 10
saves each: time, bytes, verified resumes); the ``megatron`` workload saves and loads a TP-2 sharded
state with Megatron-Core's dist_checkpointing through casckpt's strategies and torch_dist's format; the
``copy`` workload copies a 10-version fine-tune between stores with ``Store.copy``: bytes new at the
destination (incremental and full) and throughput local <-> throttled S3 against raw boto3.

Usage::

    python benchmarks/run.py [--scale S]
                             [--workloads dense,dense-bf16,frozen,lora,embed,unchanged,
                                          branch,s3,catalog,redundancy,dcp,delta,hint,peers,startup,
                                          import,hf,lightning,encryption,tiers,deepspeed,
                                          megatron,copy]
                             [--out FILE] [--dir TMPDIR] [--no-install-peers]

Prints a table of ratios with pass/miss against BENCHMARKS.md targets and writes
every raw number as JSON. Exits non-zero only when a workload crashed; missed
targets are reported, not failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # measure the casckpt of this checkout
    sys.path.insert(0, str(REPO_ROOT))

from rich.console import Console  # noqa: E402

from benchmarks.catalog import NAME as CATALOG_NAME  # noqa: E402
from benchmarks.catalog import run_catalog  # noqa: E402
from benchmarks.copy_bench import NAME as COPY_NAME  # noqa: E402
from benchmarks.copy_bench import run_copy  # noqa: E402
from benchmarks.dcp import NAME as DCP_NAME  # noqa: E402
from benchmarks.dcp import run_dcp  # noqa: E402
from benchmarks.delta import NAME as DELTA_NAME  # noqa: E402
from benchmarks.delta import run_delta  # noqa: E402
from benchmarks.ds_zero import NAME as DEEPSPEED_NAME  # noqa: E402
from benchmarks.ds_zero import run_deepspeed  # noqa: E402
from benchmarks.encryption import NAME as ENCRYPTION_NAME  # noqa: E402
from benchmarks.encryption import run_encryption  # noqa: E402
from benchmarks.hf import NAME as HF_NAME  # noqa: E402
from benchmarks.hf import run_hf  # noqa: E402
from benchmarks.hint import NAME as HINT_NAME  # noqa: E402
from benchmarks.hint import run_hint  # noqa: E402
from benchmarks.importing import NAME as IMPORT_NAME  # noqa: E402
from benchmarks.importing import run_import  # noqa: E402
from benchmarks.lightning_ckpt import NAME as LIGHTNING_NAME  # noqa: E402
from benchmarks.lightning_ckpt import run_lightning  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.many import NAME as MANY_NAME  # noqa: E402
from benchmarks.many import run_many  # noqa: E402
from benchmarks.mcore import NAME as MEGATRON_NAME  # noqa: E402
from benchmarks.mcore import run_megatron  # noqa: E402
from benchmarks.peers import NAME as PEERS_NAME  # noqa: E402
from benchmarks.peers import run_peers  # noqa: E402
from benchmarks.peers_tools import NO_INSTALL_ENV  # noqa: E402
from benchmarks.redundancy import NAME as REDUNDANCY_NAME  # noqa: E402
from benchmarks.redundancy import run_redundancy  # noqa: E402
from benchmarks.report import Outcome, print_report, write_json  # noqa: E402
from benchmarks.s3 import NAME as S3_NAME  # noqa: E402
from benchmarks.s3 import run_s3  # noqa: E402
from benchmarks.startup import NAME as STARTUP_NAME  # noqa: E402
from benchmarks.startup import run_startup  # noqa: E402
from benchmarks.suite import Log, run_workload  # noqa: E402
from benchmarks.tiers import NAME as TIERS_NAME  # noqa: E402
from benchmarks.tiers import run_tiers  # noqa: E402
from benchmarks.workloads import WORKLOADS as LOCAL_WORKLOADS  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "latest.json"
WORKLOADS = (*LOCAL_WORKLOADS, S3_NAME, CATALOG_NAME, REDUNDANCY_NAME, DCP_NAME, DELTA_NAME, MANY_NAME,
             HINT_NAME, PEERS_NAME, STARTUP_NAME, IMPORT_NAME, HF_NAME,
             LIGHTNING_NAME, ENCRYPTION_NAME, TIERS_NAME, DEEPSPEED_NAME, MEGATRON_NAME, COPY_NAME)


def _workload_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(WORKLOADS)}"
        )
    return names


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("scale must be > 0")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale",
        type=_positive,
        default=1.0,
        help="workload size; 1.0 is ~1 GiB of state (default 1.0)",
    )
    parser.add_argument(
        "--workloads",
        type=_workload_list,
        default=list(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="JSON results file (default benchmarks/results/latest.json)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd(),
        help="directory for the temporary stores and baseline files; a "
        "subdirectory is created there and removed afterwards "
        "(default: the current directory)",
    )
    parser.add_argument(
        "--no-install-peers",
        action="store_true",
        help="the peers workload never runs benchmarks/peers_setup.sh (installs restic and borg with "
        f"apt-get where missing and root); {NO_INSTALL_ENV}=1 does the same; missing tools are "
        "reported absent",
    )
    return parser.parse_args(argv)


def _run_one(name: str, scale: float, workdir: Path, log: Log, install_peers: bool = True) -> Outcome:
    if name == PEERS_NAME:
        return run_peers(scale, workdir, log, install=install_peers)
    if name == S3_NAME:
        return run_s3(scale, workdir, log)
    if name == CATALOG_NAME:
        return run_catalog(scale, workdir, log)
    if name == REDUNDANCY_NAME:
        return run_redundancy(scale, workdir, log)
    if name == DCP_NAME:
        return run_dcp(scale, workdir, log)
    if name == DELTA_NAME:
        return run_delta(scale, workdir, log)
    if name == MANY_NAME:
        return run_many(scale, workdir, log)
    if name == HINT_NAME:
        return run_hint(scale, workdir, log)
    if name == STARTUP_NAME:
        return run_startup(scale, workdir, log)
    if name == IMPORT_NAME:
        return run_import(scale, workdir, log)
    if name == HF_NAME:
        return run_hf(scale, workdir, log)
    if name == LIGHTNING_NAME:
        return run_lightning(scale, workdir, log)
    if name == ENCRYPTION_NAME:
        return run_encryption(scale, workdir, log)
    if name == TIERS_NAME:
        return run_tiers(scale, workdir, log)
    if name == DEEPSPEED_NAME:
        return run_deepspeed(scale, workdir, log)
    if name == MEGATRON_NAME:
        return run_megatron(scale, workdir, log)
    if name == COPY_NAME:
        return run_copy(scale, workdir, log)
    return run_workload(name, scale, workdir, log)


def run_all(args: argparse.Namespace, base: Path, console: Console) -> dict[str, Outcome]:
    """Run each requested workload in a fresh directory under ``base``; keep going on errors."""
    outcomes: dict[str, Outcome] = {}
    for name in args.workloads:
        workdir = base / name
        workdir.mkdir()
        try:
            outcomes[name] = _run_one(name, args.scale, workdir, console.log,
                                      install_peers=not args.no_install_peers)
        except Exception as exc:  # reported, then turned into the exit status
            console.print(traceback.format_exc(), markup=False, highlight=False)
            outcomes[name] = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every workload ran, 1 when one crashed."""
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)
    args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=".casckpt-bench-", dir=args.dir))
    os.environ["XDG_CACHE_HOME"] = str(base / "cache")  # stores' per-host caches go with the scratch
    started = datetime.now(timezone.utc)
    try:
        header = {
            "schema": 1,
            "started_at": started.isoformat(),
            "scale": args.scale,
            "workloads": args.workloads,
            "machine": machine_info(base, REPO_ROOT),
        }
        outcomes = run_all(args, base, console)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    header["duration_s"] = (datetime.now(timezone.utc) - started).total_seconds()
    print_report(console, outcomes, args.scale)
    write_json(args.out, outcomes, header)
    console.print(f"results written to {args.out}")
    return 1 if any(isinstance(r, str) for r in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
