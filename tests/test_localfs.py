"""casckpt.localfs: a local file is replaced whole or left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from casckpt.localfs import replace_atomically, replace_bytes


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    target.write_bytes(b"global_step10")

    def half(tmp: Path) -> None:
        tmp.write_bytes(b"global_st")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        replace_atomically(target, half)
    assert target.read_bytes() == b"global_step10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_the_new_file_gets_the_umask_mode_whatever_write_creates(tmp_path: Path) -> None:
    target = tmp_path / "f"
    old = os.umask(0o022)
    try:
        replace_atomically(target, lambda tmp: tmp.chmod(0o600) or tmp.write_bytes(b"x"), durable=True)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"x"
    assert target.stat().st_mode & 0o777 == 0o644


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    target = tmp_path / "marker"
    target.symlink_to(outside)
    replace_bytes(target, b"new")
    assert outside.read_bytes() == b"keep"
    assert not target.is_symlink() and target.read_bytes() == b"new"
