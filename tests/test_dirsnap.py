"""Directory snapshots: ``Store.add_dir`` then ``Store.checkout`` is byte-identical.

Names (unicode, spaces, leading dots), sizes, permission bits, bytes, empty files, empty and
nested directories and symbolic links (stored as links, never followed) come back exactly;
targets that are not new or empty are refused untouched; a damaged store or a forged listing
leaves nothing at the target and never writes outside it; special files are refused.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.errors import (
    CheckoutMismatchError,
    CheckoutTargetError,
    CorruptChunkError,
    IntegrityError,
    InvalidArgumentError,
    NotADirectorySnapshotError,
    UnsupportedFileError,
)

PROPERTY = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok


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
    from casckpt.engine import checkout as checkout_engine

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


CHECKOUT_CHILD = Path(__file__).resolve().parent / "helpers" / "checkout_child.py"


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
