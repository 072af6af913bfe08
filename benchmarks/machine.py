"""Describe the machine, software and disk a benchmark ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy
import torch


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _filesystem(path: Path) -> dict[str, str] | None:
    """Device, mount point and type of the filesystem holding ``path``."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    resolved = str(path.resolve())
    best = max(
        (m for m in mounts if resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/")),
        key=lambda m: len(m[1]),
        default=None,
    )
    return None if best is None else {"device": best[0], "mount": best[1], "type": best[2]}


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _casckpt_version() -> str | None:
    try:
        return metadata.version("casckpt")
    except metadata.PackageNotFoundError:
        return None


def machine_info(workdir: Path, repo: Path) -> dict[str, Any]:
    """A JSON-able description of host, software versions, disk and source revision."""
    status = _git(repo, "status", "--porcelain")
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": _mem_total_bytes(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "casckpt": _casckpt_version(),
        "git_commit": _git(repo, "rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "workdir": str(workdir),
        "workdir_filesystem": _filesystem(workdir),
    }
