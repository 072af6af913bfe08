"""The tools the ``peers`` workload compares (``benchmarks/peers.py``), one adapter each.

Every adapter writes only under its own directory and has the same life cycle, driven by
the workload: ``save(state, k)`` once per checkpoint (timed by the caller; an asynchronous
tool returns its stall, the time until it handed control back, and waits for the rest
before returning), ``restore(template)`` (timed; returns the state it read),
``disk()`` (bytes on disk), ``prune(keep)`` (timed) and ``close()``. ``after_save`` and
``after_restore`` tidy up outside the clock (staged files, extracted copies).

restic and borg are external programs, installed from Debian packages by
``benchmarks/peers_setup.sh`` (never by casckpt); :func:`find_peers` says which are on
``PATH`` and, where allowed, runs the script first.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sqlite3
import subprocess
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import casckpt
from benchmarks import measure

Log = Callable[[str], None]

SETUP_SCRIPT = Path(__file__).resolve().parent / "peers_setup.sh"
NO_INSTALL_ENV = "CASCKPT_BENCH_NO_INSTALL"
ABSENT = "absent: run benchmarks/peers_setup.sh"
PROGRAMS = {"borg": ("borg", "--version"), "restic": ("restic", "version")}
STAGED = "ckpt.pt"  # the torch.save file borg and restic archive (relative: cwd is its folder)


@dataclass(frozen=True)
class Disk:
    """Bytes of every regular file a tool keeps: what it stores, and its caches apart."""

    stored: int
    aside: int = 0


def _files_bytes(root: Path) -> int:
    if not root.exists():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and not p.is_symlink())


class Tool:
    """One checkpointing tool under test: see the module docstring for the call order."""

    keeps_history = True  # False: only its newest checkpoint is kept (no bytes, no prune)
    verify_after_prune = False  # the workload restores its newest version again after prune

    def __init__(self, root: Path) -> None:
        self.key = root.name  # make_tools names each tool's folder after its key
        self.root = root
        root.mkdir(parents=True)
        self.saved = 0  # the newest checkpoint number

    def save(self, state: Any, k: int) -> float | None:
        """Checkpoint ``state`` as number ``k``; the stall (s) if asynchronous, else None."""
        raise NotImplementedError

    def after_save(self) -> None:
        """Untimed tidying after a save."""

    def restore(self, template: Any) -> Any:
        """The newest checkpoint, read back (``template``: the live state, for shapes only)."""
        raise NotImplementedError

    def after_restore(self) -> None:
        """Untimed tidying after a restore."""

    def disk(self) -> Disk:
        """What the tool keeps on disk now."""
        return Disk(_files_bytes(self.root))

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints, free the space of the others."""
        raise NotImplementedError

    def stored_sum(self) -> int | None:
        """The tool's own count of the bytes it wrote (casckpt: Σ Version.stored_bytes)."""
        return None

    def close(self) -> None:
        """Release what the tool holds open."""


class TorchSave(Tool):
    """``torch.save`` + fsync, one file per checkpoint; restore is ``torch.load``."""

    def _file(self, k: int) -> Path:
        return self.root / f"ckpt-{k}.pt"

    def save(self, state: Any, k: int) -> float | None:
        measure.torch_save_fsync(state, self._file(k))
        self.saved = k
        return None

    def restore(self, template: Any) -> Any:
        return measure.torch_load(self._file(self.saved))

    def prune(self, keep: int) -> None:
        for k in range(1, self.saved - keep + 1):
            self._file(k).unlink(missing_ok=True)


class DcpSync(Tool):
    """``torch.distributed.checkpoint.save`` with ``FileSystemWriter``, one directory each."""

    def _dir(self, k: int) -> Path:
        return self.root / f"ckpt-{k}"

    def save(self, state: Any, k: int) -> float | None:
        measure.dcp_save(state, self._dir(k))
        self.saved = k
        return None

    def restore(self, template: Any) -> Any:
        return measure.dcp_load(template, self._dir(self.saved))

    def prune(self, keep: int) -> None:
        for k in range(1, self.saved - keep + 1):
            shutil.rmtree(self._dir(k), ignore_errors=True)


def dcp_group(workdir: Path) -> bool:
    """A one-process gloo group, which ``async_save`` needs; True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    workdir.mkdir(parents=True, exist_ok=True)  # the rendezvous file's folder: else a 5-minute wait
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    return True


class DcpAsync(DcpSync):
    """``async_save`` with ``FileSystemWriter`` in a one-process gloo group.

    ``cached``: one ``DefaultStager`` reused for every save, so its CPU copies (cached by
    source storage) are allocated once; otherwise ``async_save`` makes and closes its own
    stager per call. The files are DCP's, as :class:`DcpSync` writes them: only the newest
    checkpoint is kept (restored and checked), for disk space.
    """

    keeps_history = False

    def __init__(self, root: Path, cached: bool) -> None:
        super().__init__(root)
        self._stager: Any = None
        if cached:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(False, False, False, False))

    def save(self, state: Any, k: int) -> float | None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            future = async_save(state, storage_writer=FileSystemWriter(self._dir(k)),
                                async_stager=self._stager)
            stall = time.perf_counter() - start
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        self.saved = k
        return stall

    def after_save(self) -> None:
        shutil.rmtree(self._dir(self.saved - 1), ignore_errors=True)

    def prune(self, keep: int) -> None:
        raise RuntimeError(f"{self.key} keeps no history to prune")

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


class Casckpt(Tool):
    """A casckpt store of its own: blocking commits, or ``block=False`` (+ ``trust_versions``)."""

    verify_after_prune = True

    def __init__(self, root: Path, run: str, *, block: bool, hint: bool = False) -> None:
        super().__init__(root)
        self.run, self.block, self.hint = run, block, hint
        self.store = casckpt.open(root / "store", cache=root / "cache")  # the host cache, apart
        self.stored = 0

    def save(self, state: Any, k: int) -> float | None:
        if self.block:
            version = self.store.commit(state, run=self.run, step=k)
            stall = None
        else:
            start = time.perf_counter()
            handle = self.store.commit(state, run=self.run, step=k, block=False, trust_versions=self.hint)
            stall = time.perf_counter() - start
            version = handle.wait()
        self.stored += version.stored_bytes
        self.saved = k
        return stall

    def restore(self, template: Any) -> Any:
        return self.store.restore(f"{self.run}@latest")

    def disk(self) -> Disk:
        """The store's files (packs, manifests, catalog with its WAL checkpointed); the index
        cache apart."""
        root = self.root / "store"
        with sqlite3.connect(root / "catalog.db") as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        return Disk(_files_bytes(root), _files_bytes(self.root / "cache"))

    def prune(self, keep: int) -> None:
        self.store.retention.set(self.run, keep_last=keep)
        self.store.gc(grace=0)

    def stored_sum(self) -> int | None:
        return self.stored

    def close(self) -> None:
        self.store.close()


def _command(argv: list[str], cwd: Path, env: Mapping[str, str]) -> None:
    done = subprocess.run(argv, cwd=cwd, env=dict(env), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"peers: `{' '.join(argv)}` exited {done.returncode}: {' / '.join(tail)}")


class _Archiver(Tool):
    """torch.save + fsync to a staged file, then an archiver stores it in its repository."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.repo, self.stage, self.out = root / "repo", root / "stage", root / "out"
        self.stage.mkdir()

    def _env(self) -> dict[str, str]:
        raise NotImplementedError

    def _archive(self, k: int) -> list[str]:
        raise NotImplementedError

    def _extract(self) -> tuple[list[str], Path]:
        """The command that extracts the newest checkpoint, and the folder it runs in."""
        raise NotImplementedError

    def _caches(self) -> Path:
        raise NotImplementedError

    def save(self, state: Any, k: int) -> float | None:
        measure.torch_save_fsync(state, self.stage / STAGED)
        _command(self._archive(k), self.stage, self._env())
        self.saved = k
        return None

    def after_save(self) -> None:
        (self.stage / STAGED).unlink()

    def restore(self, template: Any) -> Any:
        self.out.mkdir()
        argv, cwd = self._extract()
        _command(argv, cwd, self._env())
        found = next(self.out.rglob(STAGED))
        return measure.torch_load(found)

    def after_restore(self) -> None:
        shutil.rmtree(self.out)

    def disk(self) -> Disk:
        return Disk(_files_bytes(self.repo), _files_bytes(self._caches()))


class Borg(_Archiver):
    """``borg create --compression C`` of the torch.save file; unencrypted repository."""

    def __init__(self, root: Path, compression: str) -> None:
        super().__init__(root)
        self.compression = compression
        _command(["borg", "init", "--encryption=none", str(self.repo)], root, self._env())

    def _env(self) -> dict[str, str]:
        return {**os.environ, "BORG_BASE_DIR": str(self.root / "borg-home"),
                "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes"}

    def _archive(self, k: int) -> list[str]:
        return ["borg", "create", "--compression", self.compression, f"{self.repo}::ckpt-{k}", STAGED]

    def _extract(self) -> tuple[list[str], Path]:
        return ["borg", "extract", f"{self.repo}::ckpt-{self.saved}"], self.out

    def _caches(self) -> Path:
        return self.root / "borg-home"

    def prune(self, keep: int) -> None:
        _command(["borg", "prune", "--keep-last", str(keep), str(self.repo)], self.root, self._env())
        _command(["borg", "compact", str(self.repo)], self.root, self._env())  # 1.2 frees on compact


class Restic(_Archiver):
    """``restic backup`` of the torch.save file, its defaults (compression auto; always encrypted)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        _command(self._restic("init", "--repository-version", "2"), root, self._env())

    def _env(self) -> dict[str, str]:
        return {**os.environ, "RESTIC_PASSWORD": "bench"}

    def _restic(self, *args: str) -> list[str]:
        return ["restic", "-r", str(self.repo), "--cache-dir", str(self._caches()), "-q", *args]

    def _archive(self, k: int) -> list[str]:
        return self._restic("backup", "--host", "bench", STAGED)

    def _extract(self) -> tuple[list[str], Path]:
        return self._restic("restore", "latest", "--target", str(self.out)), self.root

    def _caches(self) -> Path:
        return self.root / "restic-cache"

    def prune(self, keep: int) -> None:
        _command(self._restic("forget", "--keep-last", str(keep), "--prune"), self.root, self._env())


# ---- which tools exist -------------------------------------------------------------------------


def _may_install(install: bool) -> str | None:
    """Why peers_setup.sh is not run (None: it may be)."""
    if not install or os.environ.get(NO_INSTALL_ENV):
        return f"installing is off (--no-install-peers or {NO_INSTALL_ENV})"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("apt-get") is None:
        return "no apt-get"
    return None


def find_peers(install: bool, log: Log) -> tuple[dict[str, str | None], str | None]:
    """``({program: version line, or None if absent}, the install command run or None)``.

    Runs ``benchmarks/peers_setup.sh`` first when a program is missing, we are root, apt-get
    exists and installing is not turned off; its failure is logged, not raised.
    """
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    ran = None
    if missing:
        why_not = _may_install(install)
        if why_not is None:
            ran = f"bash {SETUP_SCRIPT.name}"
            log(f"peers: {', '.join(missing)} missing: running {ran}")
            done = subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                log(f"peers: {ran} exited {done.returncode}: {done.stderr.strip()[-300:]}")
        else:
            log(f"peers: {', '.join(missing)} missing, not installed ({why_not}): {ABSENT}")
    versions: dict[str, str | None] = {}
    for program, (exe, flag) in PROGRAMS.items():
        if shutil.which(exe) is None:
            versions[program] = None
            continue
        done = subprocess.run([exe, flag], capture_output=True, text=True, check=False)
        versions[program] = (done.stdout.strip().splitlines() or [f"{exe} (version unknown)"])[0]
    return versions, ran


def make_tools(root: Path, run: str, keys: list[str]) -> list[Tool]:
    """Fresh adapters for ``keys`` (in that order), each in its own folder under ``root``."""
    makers: dict[str, Callable[[Path], Tool]] = {
        "torch": TorchSave,
        "dcp": DcpSync,
        "dcp-async": lambda d: DcpAsync(d, cached=False),
        "dcp-async-cached": lambda d: DcpAsync(d, cached=True),
        "casckpt": lambda d: Casckpt(d, run, block=True),
        "casckpt-bg": lambda d: Casckpt(d, run, block=False),
        "casckpt-hint": lambda d: Casckpt(d, run, block=False, hint=True),
        "borg-zstd": lambda d: Borg(d, "zstd,1"),
        "borg-none": lambda d: Borg(d, "none"),
        "restic": Restic,
    }
    tools: list[Tool] = []
    try:
        for key in keys:
            tools.append(makers[key](root / key))
    except BaseException:
        for tool in tools:
            tool.close()
        raise
    return tools


TOOL_KEYS = ("torch", "dcp", "dcp-async", "dcp-async-cached", "casckpt", "casckpt-bg", "casckpt-hint",
             "borg-zstd", "borg-none", "restic")
NEEDS = {"borg-zstd": "borg", "borg-none": "borg", "restic": "restic"}  # tool -> external program
LABELS = {
    "torch": "torch.save", "dcp": "DCP", "dcp-async": "DCP async", "dcp-async-cached": "DCP async, cached",
    "casckpt": "casckpt", "casckpt-bg": "casckpt bg", "casckpt-hint": "casckpt bg, hint",
    "borg-zstd": "borg zstd,1", "borg-none": "borg none", "restic": "restic",
}
