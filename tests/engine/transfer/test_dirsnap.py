"""Directory snapshots: ``Store.add_dir`` then ``Store.checkout`` is byte-identical.

Names (unicode, spaces, leading dots), sizes, permission bits, bytes, empty files, empty and
nested directories and symbolic links (stored as links, never followed) come back exactly;
targets that are not new or empty are refused untouched; a damaged store or a forged listing
leaves nothing at the target and never writes outside it; special files are refused.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from doubles import ForkedPython
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import (
    CasckptError,
    CheckoutMismatchError,
    CheckoutTargetError,
    CorruptChunkError,
    IntegrityError,
    InvalidArgumentError,
    NotADirectorySnapshotError,
    RestoreTargetError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFileError,
)

PROPERTY = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def listing(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root``: kind, permission bits, and bytes or link target."""
    out: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                out[rel] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return out


def sample_tree(root: Path) -> Path:
    """A directory with every kind of entry add_dir keeps."""
    rng = np.random.default_rng(0)
    (root / "nested" / "deeper" / "empty").mkdir(parents=True)
    (root / "nested" / "deeper" / "w.bin").write_bytes(rng.bytes(3 << 20))
    (root / "nested" / "ü ñ spaced name.txt").write_text("hello\n")
    (root / ".hidden").write_bytes(b"")
    (root / "exec.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "exec.sh", 0o750)
    os.chmod(root / "nested" / "deeper", 0o711)
    os.symlink("nested/deeper/w.bin", root / "link")
    os.symlink("/nonexistent/elsewhere", root / "dangling")
    os.symlink("nested", root / "dirlink")  # a link to a directory: kept as a link, not walked
    return root


def test_a_directory_comes_back_byte_identical(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    version = store.add_dir(src, run="d", step=1, metrics={"loss": 1.0}, tags=("first",))
    assert version.metadata["casckpt.dir"] == {"files": 4, "dirs": 3, "links": 3, "bytes": (3 << 20) + 16}
    out = store.checkout("tag:first", tmp_path / "out")
    assert out == tmp_path / "out"
    assert listing(out) == listing(src)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary left


def test_checkout_into_an_existing_empty_directory(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    store.add_dir(src, run="d", step=1)
    (tmp_path / "empty").mkdir()
    store.checkout("d@1", tmp_path / "empty")
    assert listing(tmp_path / "empty") == listing(src)


def test_re_adding_an_unchanged_directory_writes_nothing(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    first = store.add_dir(src, run="d", step=1)
    again = store.add_dir(src, run="d", step=2)
    assert first.new_bytes >= 3 << 20
    assert again.new_bytes == 0


def test_checkout_streams_in_bounded_batches(store: casckpt.Store, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine.read import checkout as checkout_engine

    monkeypatch.setattr(checkout_engine, "BATCH_BYTES", 100 << 10)  # a 3 MiB file in 31 pieces
    monkeypatch.setattr(checkout_engine, "BATCH_FILES", 1)
    reads: list[int] = []
    real = checkout_engine.read_ranges

    def counted(ctx: Any, manifest: Any, pieces: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(sum(end - start for _, start, end in pieces))
        return real(ctx, manifest, pieces, *args, **kwargs)

    monkeypatch.setattr(checkout_engine, "read_ranges", counted)
    src = sample_tree(tmp_path / "src")
    store.add_dir(src, run="d", step=1)
    phases: list[tuple[str, int, int]] = []
    out = store.checkout("d@1", tmp_path / "out", progress=lambda *p: phases.append(p))
    assert listing(out) == listing(src)
    assert len(reads) > 30 and max(reads) <= 100 << 10
    assert phases[-1] == ("write", (3 << 20) + 16, (3 << 20) + 16)


def test_add_dir_reports_progress_and_refuses_a_store_inside(tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    phases: list[str] = []
    with casckpt.open(tmp_path / "store") as store:
        store.add_dir(src, run="d", step=1, progress=lambda phase, done, total: phases.append(phase))
    assert "scan" in phases
    with casckpt.open(src / "nested" / "store") as inner:
        with pytest.raises(InvalidArgumentError, match="inside"):
            inner.add_dir(src, run="d", step=1)


def test_background_add_dir(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    handle = store.add_dir(src, run="d", step=1, block=False)
    version = handle.wait()
    assert version.step == 1
    assert listing(store.checkout(version, tmp_path / "out")) == listing(src)


# -- hypothesis: any tree ---------------------------------------------------------------

_NAME = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"), min_size=1, max_size=12,
).filter(lambda n: n not in (".", "..") and len(n.encode()) < 200)
_MODES = st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o700, 0o640])
_DIR_MODES = st.sampled_from([0o755, 0o700, 0o711, 0o555])
_CONTENT = st.one_of(st.binary(max_size=64),
                     st.integers(0, 600_000).map(lambda n: bytes(range(256)) * (n // 256)))

Tree = dict[str, Any]
_TREES: st.SearchStrategy[Tree] = st.recursive(
    st.dictionaries(_NAME, st.one_of(st.tuples(st.just("file"), _CONTENT, _MODES),
                                     st.tuples(st.just("link"), _NAME)), max_size=4),
    lambda inner: st.dictionaries(_NAME, st.one_of(
        st.tuples(st.just("file"), _CONTENT, _MODES), st.tuples(st.just("dir"), inner, _DIR_MODES),
    ), max_size=4),
    max_leaves=12,
)


def build(root: Path, tree: Tree) -> None:
    root.mkdir()
    dirs: list[tuple[Path, int]] = []
    for name, node in tree.items():
        path = root / name
        if node[0] == "file":
            path.write_bytes(node[1])
            os.chmod(path, node[2])
        elif node[0] == "link":
            os.symlink(node[1], path)
        else:
            build(path, node[1])
            dirs.append((path, node[2]))
    for path, mode in dirs:
        os.chmod(path, mode)


@PROPERTY
@given(tree=_TREES)
def test_any_tree_round_trips(tmp_path: Path, tree: Tree) -> None:
    work = Path(os.path.join(tmp_path, os.urandom(6).hex()))
    work.mkdir()
    with casckpt.open(work / "store") as store:
        build(work / "src", tree)
        version = store.add_dir(work / "src", run="h", step=1)
        out = store.checkout(version, work / "out")
        assert listing(out) == listing(work / "src")
    for folder, dirs, _ in os.walk(work):  # let the temp dir go, read-only dirs included
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o700)


# -- refusals ---------------------------------------------------------------------------


def test_checkout_refuses_a_non_empty_target_untouched(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    store.add_dir(src, run="d", step=1)
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(CheckoutTargetError, match="not empty"):
        store.checkout("d@1", target)
    assert listing(target) == {"keep.txt": ("file", 0o644, b"mine")}
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckoutTargetError, match="not a directory"):
        store.checkout("d@1", tmp_path / "afile")


def test_checkout_reuses_only_a_target_that_holds_exactly_the_snapshot(
        store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    store.add_dir(src, run="d", step=1)
    assert store.checkout("d@1", src, reuse=True) == src  # the very directory that was added
    before = {p: p.lstat().st_mtime_ns for p in src.rglob("*")}
    store.checkout("d@1", src, reuse=True)
    assert {p: p.lstat().st_mtime_ns for p in src.rglob("*")} == before  # nothing written

    def refused(change: Any, why: str) -> None:
        target = tmp_path / "copy"
        store.checkout("d@1", target)
        change(target)
        after = listing(target)
        with pytest.raises(CheckoutMismatchError, match=why):
            store.checkout("d@1", target, reuse=True)
        assert listing(target) == after  # untouched
        _make_writable(target)
        shutil.rmtree(target)

    weights = "nested/deeper/w.bin"

    def flip(t: Path) -> None:  # same size, same mtime: only the bytes tell
        path = t / weights
        stamp = path.stat().st_mtime_ns
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        path.chmod(stat.S_IMODE((src / weights).stat().st_mode))
        os.utime(path, ns=(stamp, stamp))

    refused(flip, "the bytes of 'nested/deeper/w.bin' differ")
    refused(lambda t: (t / ".hidden").write_bytes(b"x"), "'.hidden' holds 1 bytes, not 0")
    refused(lambda t: (t / "exec.sh").chmod(0o755), "'exec.sh' has mode 755, not 750")
    refused(lambda t: (t / "extra").write_text("x"), "'extra' is not in the snapshot")
    refused(lambda t: (t / "exec.sh").unlink(), "'exec.sh' is missing")
    refused(lambda t: ((t / "link").unlink(), os.symlink("exec.sh", t / "link")), "points elsewhere")
    refused(lambda t: ((t / "dirlink").unlink(), (t / "dirlink").mkdir()), "'dirlink' is not a link")
    with pytest.raises(CheckoutTargetError, match="not empty"):  # reuse is asked for, never assumed
        store.checkout("d@1", src)


def test_reuse_in_an_encrypted_store_compares_keyed_digests(tmp_path: Path) -> None:
    key = tmp_path / "key"
    casckpt.generate_key_file(key)
    src = sample_tree(tmp_path / "src")
    with casckpt.open(tmp_path / "store", key_file=key) as store:
        store.add_dir(src, run="d", step=1)
        assert store.checkout("d@1", src, reuse=True) == src
        (src / "nested" / "ü ñ spaced name.txt").write_text("hellO\n")
        with pytest.raises(CheckoutMismatchError, match="bytes of 'nested/ü ñ spaced name.txt' differ"):
            store.checkout("d@1", src, reuse=True)


def _make_writable(root: Path) -> None:
    for folder, dirs, _ in os.walk(root):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o700)


def test_checkout_of_a_state_version_says_what_to_use(store: casckpt.Store, tmp_path: Path) -> None:
    store.commit({"w": np.arange(4)}, run="s", step=1)
    with pytest.raises(NotADirectorySnapshotError, match="restore"):
        store.checkout("s@1", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_add_dir_refuses_a_fifo_naming_it(store: casckpt.Store, tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    os.mkfifo(src / "nested" / "pipe")
    with pytest.raises(UnsupportedFileError, match="pipe.*fifo"):
        store.add_dir(src, run="d", step=1)
    assert store.runs() == []


def test_add_dir_refuses_a_file_and_the_reserved_metadata_key(store: casckpt.Store, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        store.add_dir(tmp_path / "f", run="d", step=1)
    (tmp_path / "d").mkdir()
    with pytest.raises(InvalidArgumentError, match="reserved"):
        store.add_dir(tmp_path / "d", run="d", step=1, metadata={"casckpt.dir": 1})


def test_a_corrupt_pack_leaves_no_partial_directory(tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    with casckpt.open(tmp_path / "store") as store:
        store.add_dir(src, run="d", step=1)
        packs = [p for p in (tmp_path / "store").rglob("packs/*/*") if p.is_file()]
        assert packs
        for pack in packs:  # flip bytes in the middle of every pack
            data = bytearray(pack.read_bytes())
            for i in range(len(data) // 3, len(data) // 3 + 64):
                data[i] ^= 0xFF
            pack.write_bytes(bytes(data))
        store.ops.rebuild_cache()
        with pytest.raises(IntegrityError):
            store.checkout("d@1", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_corrupt_chunk_error_is_an_integrity_error() -> None:
    assert issubclass(CorruptChunkError, IntegrityError)


def test_an_unreadable_file_is_a_typed_error(store: casckpt.Store, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    src = sample_tree(tmp_path / "src")
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith("exec.sh"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(UnsupportedFileError, match="exec.sh.*Permission denied"):
        store.add_dir(src, run="d", step=1)
    monkeypatch.undo()
    assert store.runs() == []


def test_a_failed_write_leaves_nothing_and_is_typed(store: casckpt.Store, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    src = sample_tree(tmp_path / "src")
    store.add_dir(src, run="d", step=1)
    real_write = os.write
    calls = {"n": 0}

    def full(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(CheckoutTargetError, match="No space left"):
        store.checkout("d@1", tmp_path / "out")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]


def test_setuid_bits_are_recorded_but_not_applied(store: casckpt.Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "tool", 0o4755)
    version = store.add_dir(src, run="d", step=1)
    files = store.restore(version)["files"]
    assert files[0]["mode"] == 0o4755
    out = store.checkout(version, tmp_path / "out")
    assert stat.S_IMODE((out / "tool").stat().st_mode) == 0o755


CHECKOUT_CHILD = Path(__file__).resolve().parents[2] / "helpers" / "checkout_child.py"


def _checkout_stopped(root: Path, target: Path, ready: Path) -> subprocess.Popen[bytes]:
    """A process in the middle of checking out d@1 into ``target`` (files written, not renamed)."""
    child = subprocess.Popen([sys.executable, str(CHECKOUT_CHILD), str(root), "d@1", str(target), str(ready)])
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert child.poll() is None, "the checkout ended before it wrote anything"
        assert time.monotonic() < deadline, "the checkout never started writing"
        time.sleep(0.05)
    return child


def _work_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".checkout-" in p.name)


def test_a_killed_checkouts_folder_is_reclaimed_and_a_live_ones_is_not(tmp_path: Path) -> None:
    src = sample_tree(tmp_path / "src")
    with casckpt.open(tmp_path / "store") as store:
        store.add_dir(src, run="d", step=1)
    first, second = tmp_path / "jobs", tmp_path / "other"
    live = _checkout_stopped(tmp_path / "store", first / "live", tmp_path / "live.ready")
    try:
        killed = _checkout_stopped(tmp_path / "store", first / "out", tmp_path / "out.ready")
        killed.kill()
        killed.wait()
        assert any(n.startswith(".out.checkout-") for n in _work_dirs(first))  # what the kill left
        live_dirs = _work_dirs(first)
        with casckpt.open(tmp_path / "store", create=False) as store:
            store.checkout("d@1", first / "again")  # the next checkout into that parent
            assert listing(first / "again") == listing(src)
            assert [n for n in _work_dirs(first) if not n.startswith(".live.")] == []
            assert [n for n in live_dirs if n.startswith(".live.")] == _work_dirs(first)  # kept

            elsewhere = _checkout_stopped(tmp_path / "store", second / "out", tmp_path / "other.ready")
            elsewhere.kill()
            elsewhere.wait()
            assert _work_dirs(second) != []
            report = store.gc()
            assert _work_dirs(second) == [] and report.leftovers_deleted >= 1
            assert [n for n in live_dirs if n.startswith(".live.")] == _work_dirs(first)  # gc too
            assert store.ops.check(read_data=True).ok
    finally:
        live.kill()
        live.wait()


def _str(op: bytes, text: str) -> bytes:
    data = text.encode()
    return op + len(data).to_bytes(1, "little") + data


def dotted_global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: ``module`` / ``name`` by STACK_GLOBAL (a dotted name walks attributes), called
    with ``arg``."""
    return (b"\x80\x04" + _str(b"\x8c", module) + _str(b"\x8c", name) + b"\x93"
            + _str(b"\x8c", arg) + b"\x85R.")


def test_dcp_metadata_cannot_reach_os_through_the_metadata_module(store: casckpt.Store,
                                                                  tmp_path: Path) -> None:
    """``torch.distributed.checkpoint.metadata`` imports ``os``: a dotted name
    (``os.mkdir``) under that module was admitted and called."""
    planted = tmp_path / "planted"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    (tmp_path / "dcp" / ".metadata").write_bytes(
        dotted_global_pickle("torch.distributed.checkpoint.metadata", "os.mkdir", str(planted)))
    with pytest.raises(UnsafeCheckpointError, match="os.mkdir"):
        store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    assert not planted.exists()
    assert store.runs() == []


def test_dcp_metadata_cannot_read_a_file_outside_the_checkpoint(store: casckpt.Store,
                                                                tmp_path: Path) -> None:
    """A ``.metadata`` whose storage items name ``../other/__0_0.distcp`` made the import read
    (and store) another checkpoint's file outside the directory."""
    secret = {"w": torch.full((3,), 42.0)}
    dcp.save(secret, storage_writer=dcp.FileSystemWriter(str(tmp_path / "other")), no_dist=True)
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    meta_path = tmp_path / "dcp" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # our own file: trusted here
    for info in meta.storage_data.values():
        info.relative_path = "../other/" + info.relative_path
    meta_path.write_bytes(pickle.dumps(meta))
    with pytest.raises(UnreadableCheckpointError, match="outside"):
        store.import_checkpoint(tmp_path / "dcp", run="d", step=1)
    assert store.runs() == []


def test_add_dir_never_reads_a_fifo_named_dot_metadata(store: casckpt.Store, tmp_path: Path) -> None:
    """A fifo named ``.metadata`` beside a ``.distcp`` file was opened and read before the walk
    refused it: ``add_dir`` hung until someone wrote to the fifo."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "__0_0.distcp").write_bytes(b"x" * 100)
    fifo = src / ".metadata"
    os.mkfifo(fifo)
    unblocked = threading.Event()

    def unblock() -> None:  # the watchdog: the test never hangs, it fails
        unblocked.set()
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    timer = threading.Timer(5.0, unblock)
    timer.start()
    try:
        with pytest.raises(UnsupportedFileError, match="fifo"):
            store.add_dir(src, run="r", step=1)
    finally:
        timer.cancel()
    assert not unblocked.is_set(), "add_dir blocked opening the fifo"


def test_add_dir_does_not_follow_a_dot_metadata_link_out(store: casckpt.Store, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``.metadata`` as a link to a file outside the directory was followed and read."""
    from casckpt.engine.transfer import dirscan

    outside = tmp_path / "outside.metadata"
    outside.write_bytes(b"not a pickle")
    src = tmp_path / "src"
    src.mkdir()
    (src / "__0_0.distcp").write_bytes(b"x" * 100)
    os.symlink(outside, src / ".metadata")
    read: list[Path] = []
    real = dirscan.dcp_items
    monkeypatch.setattr(dirscan, "dcp_items", lambda p: read.append(p) or real(p))
    store.add_dir(src, run="r", step=1)
    assert read == []
    out = store.checkout("r@1", tmp_path / "out")
    assert os.readlink(out / ".metadata") == str(outside)


def test_export_never_deletes_a_directory_it_did_not_create(store: casckpt.Store, tmp_path: Path) -> None:
    """The temporary directory had a fixed name (``.<target>.<pid>.export``); when one existed
    the export failed and then removed it, with the user's files."""
    store.commit({"w": np.zeros(3, np.float32)}, run="e", step=1)
    mine = tmp_path / f".out.{os.getpid()}.export"
    mine.mkdir()
    (mine / "keep").write_text("mine")
    store.export("e@1", tmp_path / "out")
    assert (mine / "keep").read_text() == "mine"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_export_refuses_a_target_that_is_a_link(store: casckpt.Store, tmp_path: Path) -> None:
    """``--to`` naming a link to a directory elsewhere wrote (and with --force replaced) files
    out there."""
    store.commit({"w": np.zeros(3, np.float32)}, run="e", step=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"precious")
    os.symlink(elsewhere, tmp_path / "link")
    with pytest.raises(RestoreTargetError, match="link"):
        store.export("e@1", tmp_path / "link", overwrite=True)
    assert (elsewhere / "model.safetensors").read_bytes() == b"precious"


def test_export_to_the_current_directory_is_not_a_crash(store: casckpt.Store, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--to .`` raised ValueError (``Path('.')`` has no name to put the temporary beside)."""
    store.commit({"w": np.zeros(3, np.float32)}, run="e", step=1)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    store.export("e@1", ".")
    assert (tmp_path / "here" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "store"]


def test_export_force_replaces_a_link_not_what_it_points_to(store: casckpt.Store, tmp_path: Path) -> None:
    """(Held.) --force over a directory whose model.safetensors is a link: the link is replaced,
    the file it pointed to is untouched; other files are kept."""
    store.commit({"w": np.zeros(3, np.float32)}, run="e", step=1)
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(precious, out / "model.safetensors")
    (out / "notes.txt").write_text("keep")
    store.export("e@1", out, overwrite=True)
    assert precious.read_bytes() == b"precious"
    assert not (out / "model.safetensors").is_symlink()
    assert (out / "notes.txt").read_text() == "keep"


def test_hf_directory_code_and_pickles_are_kept_as_bytes_never_run(store: casckpt.Store,
                                                                    tmp_path: Path) -> None:
    """(Held.) A Hugging Face directory's ``*.py`` and ``training_args.bin`` are stored as
    bytes: importing and exporting it runs neither."""
    from safetensors.torch import save_file

    planted = tmp_path / "planted"
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "gpt2", "auto_map": {"AutoModel": "evil.M"}}')
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    (src / "evil.py").write_text(f"import os\nos.mkdir({str(planted)!r})\n")
    (src / "training_args.bin").write_bytes(
        dotted_global_pickle("os", "mkdir", str(planted)))
    store.import_checkpoint(src, run="hf", step=1)
    result = store.export("hf@1", tmp_path / "out")
    assert not planted.exists()
    for name in ("evil.py", "training_args.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert result.huggingface


def _stored_zip(entries: list[tuple[str, bytes]], *, zip64: bool, deflate_every: int) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i, (name, data) in enumerate(entries):
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if deflate_every and i % deflate_every == 0 \
                else zipfile.ZIP_STORED
            with archive.open(info, "w", force_zip64=zip64) as f:
                f.write(data)
    return buffer.getvalue()


def _duplicate_central_record(blob: bytes) -> bytes:
    """A zip whose central directory lists its first entry twice (two entries, one data range)."""
    eocd = blob.rindex(b"PK\x05\x06")
    count, cd_size, cd_offset = struct.unpack("<HII", blob[eocd + 10 : eocd + 20])
    first = blob[cd_offset : cd_offset + 46]
    name_len, extra_len, comment_len = struct.unpack("<HHH", first[28:34])
    record = blob[cd_offset : cd_offset + 46 + name_len + extra_len + comment_len]
    tail = struct.pack("<HHII", count + 1, count + 1, cd_size + len(record), cd_offset)
    return (blob[:cd_offset] + record + blob[cd_offset : eocd] + blob[eocd : eocd + 8] + tail
            + blob[eocd + 20 :])


def _safetensors_like(entries: list[tuple[str, str, list[int], int, int]], data: bytes) -> bytes:
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
              for name, dtype, shape, begin, end in entries}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


_BYTES = st.binary(max_size=2048)


_ZIPS = st.builds(
    _stored_zip,
    st.lists(st.tuples(st.text("abc/.", min_size=1, max_size=8), _BYTES), min_size=1, max_size=4,
             unique_by=lambda entry: entry[0]),
    zip64=st.booleans(), deflate_every=st.integers(0, 2),
)


_HOSTILE_ZIPS = st.one_of(
    _ZIPS,
    _ZIPS.map(_duplicate_central_record),
    st.tuples(_ZIPS, st.lists(st.tuples(st.integers(0, 4096), st.binary(min_size=1, max_size=8)),
                              max_size=4)).map(
        lambda z: bytes(_patch(z[0], z[1]))),
)


_SAFETENSORS = st.builds(
    _safetensors_like,
    st.lists(st.tuples(st.text("xyz", min_size=1, max_size=3),
                       st.sampled_from(["F32", "BF16", "I8", "C64", "F64", "BOOL", "U16"]),
                       st.lists(st.integers(0, 9), max_size=3) | st.just([1] * 70),
                       st.integers(-2, 300), st.integers(-2, 300)), max_size=4),
    _BYTES,
)


def _patch(blob: bytes, patches: list[tuple[int, bytes]]) -> bytearray:
    out = bytearray(blob)
    for at, data in patches:
        at %= max(len(out), 1)
        out[at : at + len(data)] = data
    return out


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path_factory.mktemp("fuzz") / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok


_STEP = iter(range(1, 1 << 30))


def _dcp_dir(root: Path, blob: bytes, items: list[tuple[int, int]]) -> None:
    """A directory with ``__0_0.distcp`` = ``blob`` and a .metadata naming ``items`` in it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    storage = {MetadataIndex(f"k{i}"): _StorageInfo("__0_0.distcp", offset, length)
               for i, (offset, length) in enumerate(items)}
    (root / ".metadata").write_bytes(pickle.dumps(Metadata({}, storage_data=storage)))
    (root / "__0_0.distcp").write_bytes(blob)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(zipped=_HOSTILE_ZIPS, safetensors=_SAFETENSORS, inner=_ZIPS,
       items=st.lists(st.tuples(st.integers(-5, 6000), st.integers(-5, 3000)), max_size=4),
       filler=st.binary(max_size=700))
def test_files_that_look_like_a_format_round_trip_byte_identical(
        fuzz_store: casckpt.Store, tmp_path_factory: pytest.TempPathFactory, zipped: bytes,
        safetensors: bytes, inner: bytes, items: list[tuple[int, int]], filler: bytes) -> None:
    """Forged zips (overlapping entries, zip64, patched bytes), safetensors headers with hostile
    offsets and shapes, and .distcp files whose metadata names arbitrary items (a torch.save
    zip inside one): whatever the cut, checkout gives the same bytes (or add_dir refuses, typed)."""
    root = tmp_path_factory.mktemp("src")
    src = root / "src"
    src.mkdir()
    (src / "a.pt").write_bytes(zipped)
    (src / "b.safetensors").write_bytes(safetensors)
    (src / "c.bin").write_bytes(filler + zipped)
    distcp = filler + inner + filler
    _dcp_dir(src, distcp, items + [(len(filler), len(inner))])
    step = next(_STEP)
    try:
        fuzz_store.add_dir(src, run="fuzz", step=step)
    except CasckptError:
        return
    out = fuzz_store.checkout(f"fuzz@{step}", root / "out")
    for name in ("a.pt", "b.safetensors", "c.bin", "__0_0.distcp", ".metadata"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


def test_add_dir_metadata_with_a_dotted_global_never_runs(store: casckpt.Store, tmp_path: Path) -> None:
    """(Held.) add_dir's own .metadata reader refuses the dotted name that broke import."""
    planted = tmp_path / "planted"
    src = tmp_path / "src"
    src.mkdir()
    (src / ".metadata").write_bytes(
        dotted_global_pickle("torch.distributed.checkpoint.metadata", "os.mkdir", str(planted)))
    (src / "__0_0.distcp").write_bytes(b"x" * 1000)
    store.add_dir(src, run="r", step=1)
    assert not planted.exists()
    assert (store.checkout("r@1", tmp_path / "out") / ".metadata").read_bytes() == \
        (src / ".metadata").read_bytes()


@pytest.mark.xfail(strict=True, reason=(
    "add_dir hashes each file at scan time and the commit reads the memory map later: a file "
    "rewritten in place in between is published with bytes that do not match the recorded "
    "BLAKE3, and only checkout finds out. Needs a design choice (re-verify after the commit and "
    "retract the version, or hash what the commit chunked)"))
def test_a_file_rewritten_in_place_during_add_dir_is_not_published(
        store: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine.transfer import dirscan

    src = tmp_path / "src"
    src.mkdir()
    big = src / "w.bin"
    big.write_bytes(np.random.default_rng(0).bytes(1 << 20))  # over READ_WHOLE: memory-mapped
    real = dirscan.scan

    def scan_then_rewrite(*args: object, **kwargs: object) -> object:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        with open(big, "r+b") as f:  # same size: no SIGBUS, other bytes
            f.write(b"\xff" * 4096)
        return found

    monkeypatch.setattr(dirscan, "scan", scan_then_rewrite)
    try:
        store.add_dir(src, run="r", step=1)
    except CasckptError:
        return  # refused, typed: fine
    store.checkout("r@1", tmp_path / "out")  # published: it must then check out


def _tree_bytes(root: Path) -> dict[str, bytes | str]:
    return {p.relative_to(root).as_posix(): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def test_snapshots_survive_gc_retention_delete_and_a_lost_catalog(tmp_path: Path) -> None:
    """(Held.) gc and retention keep what live snapshots need and reclaim the rest;
    check --read-data reads them; undelete works; after the catalog is lost and rebuilt,
    checkout still writes every snapshot back; log, show and diff read them."""
    from safetensors.torch import save_file

    root = tmp_path / "store"
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    shared = rng.bytes(3 << 20)
    expected: dict[int, dict[str, bytes | str]] = {}
    with casckpt.open(root) as store:
        for step in (1, 2, 3):
            save_file({"w": torch.from_numpy(rng.standard_normal(70_000).astype(np.float32)),
                       "frozen": torch.arange(50_000, dtype=torch.float32)}, src / "model.safetensors")
            (src / "sub" / "shared.bin").write_bytes(shared)
            (src / "sub" / f"only{step}.bin").write_bytes(rng.bytes(1 << 20))
            if not (src / "link").is_symlink():
                os.symlink("sub/shared.bin", src / "link")
            store.add_dir(src, run="snap", step=step)
            expected[step] = _tree_bytes(src)
            (src / "sub" / f"only{step}.bin").unlink()
        store.delete("snap@1")
        store.gc(grace=0)
        store.retention.set("snap", keep_last=1)
        store.gc(grace=0)
        assert [v.step for v in store.log("snap")] == [3]
        assert store.ops.check(read_data=True).ok
        assert _tree_bytes(store.checkout("snap@3", tmp_path / "out3")) == expected[3]
        store.retention.clear("snap")
        store.delete("snap@3")
        store.undelete("snap@3")
        assert store.resolve("snap@3").metadata["casckpt.dir"]["files"] == 3
        assert store.show("snap@3").tensors and store.diff("snap@3", "snap@3") is not None
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):  # the catalog is lost
        (root / name).unlink(missing_ok=True)
    with casckpt.open(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert store.resolve("snap@3").metadata["casckpt.dir"]["files"] == 3
        assert _tree_bytes(store.checkout("snap@3", tmp_path / "rebuilt")) == expected[3]
        assert store.ops.check(read_data=True).ok


_KILLED_MID_CHECKOUT = """
import os, signal, sys
import casckpt
from casckpt.engine.read import checkout
checkout.BATCH_BYTES = 1 << 20
def progress(stage, done, total):
    if stage == "write" and done >= 2 << 20:
        os.kill(os.getpid(), signal.SIGKILL)
with casckpt.open(sys.argv[1]) as store:
    store.checkout("r@1", sys.argv[2], progress=progress)
"""


def test_kill_9_mid_checkout_leaves_the_target_absent(
        store: casckpt.Store, tmp_path: Path, forked_python: ForkedPython) -> None:
    """(Held.) A checkout killed with SIGKILL after writing part of a file leaves no target;
    what remains is its hidden temporary sibling ``.out.checkout-*`` (mode 0700) and its lock,
    which the next checkout into the same parent removes (issue 30); that checkout works."""

    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(np.random.default_rng(1).bytes(6 << 20))
    store.add_dir(src, run="r", step=1)
    store.close()
    done = forked_python.run(["-c", _KILLED_MID_CHECKOUT, str(tmp_path / "store"), str(tmp_path / "out")],
                             timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.checkout-") and p.is_dir()]
    assert len(left) == 1 and stat.S_IMODE(left[0].stat().st_mode) == 0o700
    with casckpt.open(tmp_path / "store") as again:
        assert (again.checkout("r@1", tmp_path / "out") / "w.bin").read_bytes() == \
            (src / "w.bin").read_bytes()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.checkout-")] == []


def test_hf_import_does_not_copy_a_file_linked_from_outside(store: casckpt.Store, tmp_path: Path) -> None:
    """read_hf_dir kept every other top-level file by following links: a model directory from
    an untrusted source (git keeps links) with tokenizer.json -> ../credentials copied the
    secret into the store and into every export. Links may not lead out of the directory."""
    from safetensors.torch import save_file

    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = hunter2\n")
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "gpt2"}')
    save_file({"w": torch.ones(2)}, src / "model.safetensors")
    os.symlink("../credentials", src / "tokenizer.json")
    try:
        store.import_checkpoint(src, run="hf", step=1)
    except CasckptError:
        return  # refused, typed: fine
    files = store.restore("hf@1")["files"]
    assert b"hunter2" not in files.get("tokenizer.json", b"")


def test_export_force_that_fails_leaves_the_old_files(store: casckpt.Store, tmp_path: Path) -> None:
    """--force replaced the files one by one: when one could not be replaced (a directory of
    that name is in the way) the ones before it were already gone, and the export failed with
    the directory half old, half new. Now it is refused before anything is replaced."""
    store.commit({"w": torch.ones(3)}, run="e", step=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".metadata").write_bytes(b"old metadata")
    (out / "__0_0.distcp").mkdir()
    (out / "__0_0.distcp" / "mine").write_text("keep")
    with pytest.raises(RestoreTargetError, match="__0_0.distcp"):
        store.export("e@1", out, format="dcp", overwrite=True)
    assert (out / ".metadata").read_bytes() == b"old metadata"
    assert (out / "__0_0.distcp" / "mine").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]  # no temporary left


def test_export_that_fails_before_replacing_leaves_the_target(store: casckpt.Store, tmp_path: Path) -> None:
    """(Held.) A state the format cannot hold (DCP saves a dict; this is a list) fails before
    --force touches anything, and leaves no temporary directory."""
    from casckpt.errors import UnsupportedStateError

    store.commit([torch.ones(3)], run="e", step=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".metadata").write_bytes(b"old")
    with pytest.raises(UnsupportedStateError):
        store.export("e@1", out, format="dcp", overwrite=True)
    assert [p.name for p in out.iterdir()] == [".metadata"] and (out / ".metadata").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]


def _nest(root: Path, depth: int) -> Path:
    folder = root
    folder.mkdir()
    for _ in range(depth):
        folder = folder / "a"
        folder.mkdir()
    return folder


def test_a_too_deep_tree_is_refused_typed_and_the_deepest_allowed_round_trips(
        store: casckpt.Store, tmp_path: Path) -> None:
    """A tree ~1000 directories deep made add_dir raise RecursionError (untyped)."""
    from casckpt.format.dirsnap import MAX_DEPTH

    (_nest(tmp_path / "deep", MAX_DEPTH + 40) / "f").write_bytes(b"x")
    with pytest.raises(UnsupportedFileError, match="deep"):
        store.add_dir(tmp_path / "deep", run="d", step=1)
    (_nest(tmp_path / "ok", MAX_DEPTH - 1) / "f").write_bytes(b"x")
    out = store.checkout(store.add_dir(tmp_path / "ok", run="d", step=2), tmp_path / "out")
    assert (out / ("a/" * (MAX_DEPTH - 1)) / "f").read_bytes() == b"x"


def test_a_deep_forged_listing_that_fails_leaves_nothing(store: casckpt.Store, tmp_path: Path) -> None:
    """A forged listing 1100 directories deep whose file does not match its hash: the removal
    of the temporary checkout raised RecursionError, which replaced the hash error, and the
    temporary directory stayed beside the target."""
    import blake3

    from casckpt.errors import CorruptManifestError

    dirs = ["/".join(["a"] * n) for n in range(1, 1101)]
    files = [{"path": d, "kind": "dir", "mode": 0o755, "size": 0, "blake3": None, "target": None,
              "parts": []} for d in dirs]
    files.append({"path": dirs[-1] + "/f", "kind": "file", "mode": 0o644, "size": 2,
                  "blake3": blake3.blake3(b"no").hexdigest(), "target": None,
                  "parts": [np.frombuffer(b"hi", np.uint8)]})
    store.commit({"casckpt.dir": 1, "files": files}, run="f", step=1)
    with pytest.raises(CorruptManifestError):
        store.checkout("f@1", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


_PARTS = st.sampled_from(["a", "A", "b", "..", ".", "", "a\0", "é", "e\u0301"])


_FORGED_PATHS = st.lists(_PARTS, min_size=1, max_size=3).map("/".join) | st.sampled_from(
    ["/abs", "//a", "a/", "/", "bait/x", "bait/../x"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(entries=st.lists(st.tuples(st.sampled_from(["dir", "file", "link"]), _FORGED_PATHS,
                                  st.sampled_from(["BAIT", "..", "/", "a", "../.."])),
                        min_size=1, max_size=6))
def test_forged_listings_never_write_outside_the_target(
        fuzz_store: casckpt.Store, tmp_path_factory: pytest.TempPathFactory,
        entries: list[tuple[str, str, str]]) -> None:
    """(Held.) Random listings of dirs, files and links (links to a bait directory outside,
    names with .., NUL, case and normalisation twins, entries under links): checkout either
    writes inside the target only or refuses, typed, leaving nothing."""
    import blake3

    root = tmp_path_factory.mktemp("forged")
    bait = root / "bait"
    bait.mkdir()
    files = []
    for kind, path, target in entries:
        data = b"x" if kind == "file" else b""
        digest = blake3.blake3(data).hexdigest() if kind == "file" else None
        files.append({"path": path, "kind": kind, "mode": 0o755 if kind == "dir" else 0o644,
                      "size": len(data), "blake3": digest,
                      "target": (str(bait) if target == "BAIT" else target) if kind == "link" else None,
                      "parts": [np.frombuffer(data, np.uint8)] if data else []})
    step = next(_STEP)
    fuzz_store.commit({"casckpt.dir": 1, "files": files}, run="forged", step=step)
    try:
        out = fuzz_store.checkout(f"forged@{step}", root / "t" / "out")
    except CasckptError:
        assert sorted(p.name for p in root.iterdir()) in (["bait"], ["bait", "t"])
        assert not (root / "t").exists() or list((root / "t").iterdir()) == []
    else:
        assert sorted(p.name for p in (root / "t").iterdir()) == ["out"]
        for p in out.rglob("*"):
            assert p.is_symlink() or os.path.realpath(p).startswith(str(out) + os.sep)
    assert list(bait.iterdir()) == []


def test_a_safetensors_tensor_of_many_dimensions_round_trips(store: casckpt.Store, tmp_path: Path) -> None:
    """A valid safetensors file holding a 65-dimensional tensor (64 KiB+, so not merged into a
    byte run) made add_dir raise ValueError: numpy arrays have at most 64 dimensions."""
    n = 1 << 15
    src = tmp_path / "src"
    src.mkdir()
    for rank in (33, 65):
        header = json.dumps({"t": {"dtype": "F32", "shape": [1] * (rank - 1) + [n],
                                   "data_offsets": [0, 4 * n]}}).encode()
        header += b" " * (-(len(header) + 8) % 8)
        (src / f"x{rank}.safetensors").write_bytes(
            struct.pack("<Q", len(header)) + header + np.arange(n, dtype=np.float32).tobytes())
    out = store.checkout(store.add_dir(src, run="r", step=1), tmp_path / "out")
    for name in ("x33.safetensors", "x65.safetensors"):
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_a_single_file_export_never_truncates_a_file_or_link_at_its_temporary_name(
        store: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary file beside an exported safetensors file had a predictable name
    (``.<name>.<pid>.tmp``) opened with O_TRUNC and no O_NOFOLLOW, then unlinked: a file of
    that name was emptied and deleted, a link planted there (a shared directory) truncated
    what it pointed to."""
    from casckpt.engine.transfer import exporters

    store.commit({"w": np.zeros(3, np.float32)}, run="e", step=1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(exporters.secrets, "token_hex", lambda n: "0" * (2 * n))
    planted = [tmp_path / f".x.safetensors.{os.getpid()}.tmp",  # the old name, and the new one
               tmp_path / f".x.safetensors.{os.getpid()}.{'0' * 8}.tmp"]
    for link in planted:
        os.symlink(victim, link)
    tree = store.restore("e@1")
    with pytest.raises(RestoreTargetError):
        exporters.export_safetensors(tree, store.resolve("e@1"), tmp_path / "x.safetensors")
    assert victim.read_bytes() == b"precious" and all(link.is_symlink() for link in planted)
    monkeypatch.undo()
    exporters.export_safetensors(tree, store.resolve("e@1"), tmp_path / "x.safetensors")
    assert (tmp_path / "x.safetensors").is_file() and victim.read_bytes() == b"precious"


def test_a_directory_swapped_for_a_link_mid_walk_is_not_followed_out(
        store: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """add_dir listed a directory, then opened its children by path: a subdirectory replaced by
    a link to a directory elsewhere between the two (someone else writing there) was walked,
    and the files out there were stored in the snapshot."""
    from casckpt.engine.transfer import dirscan

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("hunter2")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "ok.txt").write_text("fine")
    real = dirscan._entry

    def swap_after_listing(path: str, kind: str, *args: object, **kwargs: object) -> object:
        if path == "sub" and kind == "dir":  # listed as a directory: now swap it for a link
            os.rename(src / "sub", tmp_path / "moved")
            os.symlink(outside, src / "sub")
        return real(path, kind, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dirscan, "_entry", swap_after_listing)
    try:
        version = store.add_dir(src, run="r", step=1)
    except UnsupportedFileError:
        return  # refused, typed: fine
    assert "hunter2" not in str(store.restore(version))
    out = store.checkout(version, tmp_path / "out")
    assert not (out / "sub" / "secret.txt").exists()


def test_a_failed_checkout_removes_the_parents_it_created(store: casckpt.Store, tmp_path: Path) -> None:
    """A checkout into a/b/out that failed (a file not matching its hash) left a/b behind."""
    import blake3

    from casckpt.errors import FileHashMismatchError

    files = [{"path": "f", "kind": "file", "mode": 0o644, "size": 2, "target": None,
              "blake3": blake3.blake3(b"no").hexdigest(), "parts": [np.frombuffer(b"hi", np.uint8)]}]
    store.commit({"casckpt.dir": 1, "files": files}, run="f", step=1)
    (tmp_path / "a").mkdir()
    with pytest.raises(FileHashMismatchError):
        store.checkout("f@1", tmp_path / "a" / "b" / "c" / "out")
    assert list((tmp_path / "a").iterdir()) == []  # "a" was there before: kept


def test_hf_hub_cache_snapshots_import_through_their_links(store: casckpt.Store, tmp_path: Path) -> None:
    """The rule above keeps the Hugging Face hub cache working: every file of
    ``<repo>/snapshots/<rev>/`` is a link to ``../../blobs/<hash>``."""
    from safetensors.torch import save_file

    repo = tmp_path / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "c0").write_text('{"model_type": "gpt2"}')
    save_file({"w": torch.arange(4.0)}, blobs / "w0")
    (blobs / "t0").write_text('{"tok": 1}')
    for name, blob in (("config.json", "c0"), ("model.safetensors", "w0"), ("tokenizer.json", "t0")):
        os.symlink(f"../../blobs/{blob}", snap / name)
    store.import_checkpoint(snap, run="hub", step=1)
    state = store.restore("hub@1")
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert state["files"] == {"tokenizer.json": b'{"tok": 1}'}


def test_dcp_import_refuses_a_data_file_linked_from_outside(store: casckpt.Store, tmp_path: Path) -> None:
    """A DCP directory whose ``.distcp`` file (or ``.metadata``) is a link out of it: the import
    would read another checkpoint's (or any) file. Refused, nothing committed."""
    import torch.distributed.checkpoint as dcp

    src, other = tmp_path / "dcp", tmp_path / "other"
    for where, value in ((src, 1.0), (other, 2.0)):
        dcp.save({"w": torch.full((4,), value)}, checkpoint_id=str(where), no_dist=True)
    data = sorted(src.glob("*.distcp"))
    assert data
    for file in data:
        file.unlink()
        os.symlink(other / file.name, file)
    with pytest.raises(UnreadableCheckpointError, match="outside the imported directory"):
        store.import_checkpoint(src, run="d", step=1)
    meta = src / ".metadata"
    meta.unlink()
    os.symlink(other / ".metadata", meta)
    with pytest.raises(UnreadableCheckpointError, match="outside the imported directory"):
        store.import_checkpoint(src, run="d", step=1)
    assert store.runs() == []


def test_export_of_a_directory_snapshot_points_to_checkout(store: casckpt.Store, tmp_path: Path) -> None:
    """export (and `restore --to`) of an add_dir version wrote its files' raw pieces as tensors
    of a safetensors file; it is refused, naming checkout, and nothing is written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 100)
    store.add_dir(src, run="snap", step=1)
    with pytest.raises(InvalidArgumentError, match="checkout"):
        store.export("snap@1", tmp_path / "out", format="pt")
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["--store", str(store.path), "restore", "snap@1", "--to",
                                      str(tmp_path / "x.safetensors")])
    assert result.exit_code == 2 and "checkout" in result.output
    assert not (tmp_path / "x.safetensors").exists()
