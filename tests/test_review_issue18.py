"""Hostile review of issue 18 (directory snapshots, import, export): each test is an attack
that once worked (or a guarantee that was only claimed), kept so it stays closed."""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import casckpt
from casckpt.errors import (
    RestoreTargetError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFileError,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with casckpt.open(tmp_path / "store") as s:
        yield s
        assert s.check(read_data=True).ok


def _str(op: bytes, text: str) -> bytes:
    data = text.encode()
    return op + len(data).to_bytes(1, "little") + data


def dotted_global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: ``module`` / ``name`` by STACK_GLOBAL (a dotted name walks attributes), called
    with ``arg``."""
    return (b"\x80\x04" + _str(b"\x8c", module) + _str(b"\x8c", name) + b"\x93"
            + _str(b"\x8c", arg) + b"\x85R.")


# -- import ------------------------------------------------------------------------------


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


# -- add_dir -----------------------------------------------------------------------------


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
    from casckpt.engine import dirscan

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


# -- export ------------------------------------------------------------------------------


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
