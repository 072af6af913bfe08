"""Huge pages for a restore's fresh buffers: advised while they are filled, taken back after,
and never a changed byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import casckpt
from casckpt.engine.read import pages
from casckpt.engine.read.pages import HUGE_PAGE, MIN_BUFFER, huge_pages
from casckpt.errors import CorruptChunkError
from casckpt.format.pack import ENTRY_HEADER_SIZE
from casckpt.testing.internals import internals

needs_madvise = pytest.mark.skipif(pages._madvise() is None,
                                   reason="transparent huge pages are not on `madvise` here")


def _flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (``hg``: advised huge,
    ``nh``: advised not huge)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_madvise
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_whole_pages_are_advised_while_filled_then_taken_back(kind: str) -> None:
    size = MIN_BUFFER + 3 * HUGE_PAGE + 123
    buffer = torch.empty(size, dtype=torch.uint8) if kind == "torch" else np.empty(size, np.uint8)
    address = buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer.ctypes.data
    inner = -(-address // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page inside
    with huge_pages([buffer]):
        assert "hg" in _flags(inner)
        buffer[:] = 5
    assert "hg" not in _flags(inner)  # memory the allocator reuses behaves as before
    assert int(buffer[0]) == 5 and int(buffer[-1]) == 5


@needs_madvise
def test_small_buffers_are_left_alone() -> None:
    small = torch.empty(MIN_BUFFER - 1, dtype=torch.uint8)
    assert pages._whole_pages(small) is None
    with huge_pages([small]):
        small.fill_(1)
    assert bool((small == 1).all())


@needs_madvise
def test_advice_is_taken_back_when_the_fill_fails() -> None:
    buffer = torch.empty(MIN_BUFFER + HUGE_PAGE, dtype=torch.uint8)
    inner = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    with pytest.raises(RuntimeError), huge_pages([buffer]):
        raise RuntimeError("a read failed")
    assert "hg" not in _flags(inner)


def _big_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(3 * MIN_BUFFER // 4 + 17, generator=g),  # 3 MiB-odd: unaligned end
            "arr": np.random.default_rng(3).standard_normal(MIN_BUFFER // 8 + 5),
            "other": torch.randn(MIN_BUFFER // 4, generator=g), "small": torch.arange(10)}


def test_large_tensors_restore_bit_exact_and_unshared(tmp_path: Path) -> None:
    """Every fresh buffer the restore advised holds exactly its own tensor's bytes, and no
    two restored tensors share memory."""
    state = _big_state()
    with casckpt.open(tmp_path / "s", chunk_size=1 << 20) as store:
        store.commit(state, run="r", step=1)
        got = store.restore("r@1")
        assert isinstance(got, dict)
        for key, want in state.items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(got[key], want) and got[key].dtype == want.dtype, key
            else:
                assert isinstance(want, np.ndarray) and np.array_equal(got[key], want), key
        tensors = [got[k] for k in ("big", "other", "small")]
        pointers = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(pointers) == len(tensors)
        got["big"].fill_(0)
        other = state["other"]
        assert isinstance(other, torch.Tensor) and torch.equal(got["other"], other)


@pytest.mark.parametrize("compression", ["0", "1"])
def test_corrupt_chunk_in_a_large_fresh_buffer_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      compression: str) -> None:
    """A flipped byte in a chunk read (raw) or decoded (planes) into an advised buffer raises."""
    monkeypatch.setenv("CASCKPT_COMPRESSION", compression)
    state = _big_state()
    with casckpt.open(tmp_path / "s", chunk_size=1 << 20) as store:
        version = store.commit(state, run="r", step=1)
        manifest = internals(store).manifest(version.id)
        entry = next(t for t in manifest.tensors if t.path == "big")
        cid = manifest.extents[entry.extent].chunks[1].hex()
        loc = internals(store).catalog.find_chunks([cid], live_only=False)[cid]
        assert (loc.codec == 0) == (compression == "0")
        path = tmp_path / "s" / "packs" / loc.pack_id[:2] / loc.pack_id
        path.chmod(0o644)
        at = loc.offset + ENTRY_HEADER_SIZE + 999
        data = bytearray(path.read_bytes())
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError) as info:
            store.restore("r@1")
        assert info.value.chunk_id == cid


@needs_madvise
def test_nothing_is_advised_near_the_cap_on_mappings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose mappings near the kernel's cap gets no advice (each may split one more)."""
    cap = tmp_path / "max_map_count"
    used = Path("/proc/self/maps").read_bytes().count(b"\n")
    cap.write_text(str(2 * used + 2 * pages.MAX_ADVISED - 2))
    monkeypatch.setattr(pages, "_MAP_CAP", str(cap))
    buffer = torch.empty(MIN_BUFFER + HUGE_PAGE, dtype=torch.uint8)
    inner = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    with huge_pages([buffer]):
        assert "hg" not in _flags(inner)
    cap.write_text(str(4 * used + 8 * pages.MAX_ADVISED))
    with huge_pages([buffer]):
        assert "hg" in _flags(inner)
