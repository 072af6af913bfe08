"""The GPU commit path: device tensors streamed through two reused (pinned) host buffers.

A CUDA tensor's windows are copied into staging buffers, hashed, looked up, and only
new chunks copied out; these tests compare that path with the direct one a CPU tensor
takes (same chunks, same versions, same restores). They need a CUDA device, but for the
buffers' own windowing, which runs on any host tensor.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.engine.memory.staging import StagingBuffers
from casckpt.engine.write.distributed import TensorPiece, write_pieces
from casckpt.storage.erasure import Redundancy
from casckpt.testing.internals import internals

CHUNK = 4096
cuda = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py); tests/device/run.sh runs them


@given(n=st.integers(0, 20_000), unit=st.sampled_from([1, 16, 4096]),
       total=st.integers(2, 40_000), stop=st.integers(0, 8))
@settings(max_examples=60, deadline=None)
def test_the_buffers_stream_every_byte_once_in_whole_chunks(n: int, unit: int, total: int,
                                                            stop: int) -> None:
    """The windowing every staged tensor goes through (the GPU path's host side): windows
    tile the tensor in order, each a whole number of chunks but the last, through two buffers
    reused from stream to stream; a consumer that stops early leaves the next stream whole."""
    buffers = StagingBuffers(total)
    flat = torch.randint(0, 256, (n,), dtype=torch.uint8)
    stream = buffers.stream(flat, unit)
    for _ in range(stop):  # an early stop, then a full stream on the same buffers
        if next(stream, None) is None:
            break
    stream.close()
    seen, offsets = bytearray(), []
    for offset, view in buffers.stream(flat, unit):
        offsets.append(offset)
        seen += view
    assert bytes(seen) == flat.numpy().tobytes()
    assert offsets == sorted(offsets) and all(o % unit == 0 for o in offsets)
    assert len(buffers._buffers) == 2 and not buffers.pinned  # two buffers, no CUDA here


def _open(path: Path, *, staging_memory: int = 4 * CHUNK, **kwargs: Any) -> Any:
    return casckpt.open(path, chunk_size=CHUNK, staging_memory=staging_memory, **kwargs)


def _state(seed: int, device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(10_000, generator=g).to(device)
    return {
        "w": torch.randn(25_000, generator=g).to(device),   # many windows
        "view": base[1000:3000],                             # a view: shared extent
        "whole": base,
        "bf16": torch.randn(3_333, generator=g).to(torch.bfloat16).to(device),
        "odd": torch.arange(7, dtype=torch.int16).to(device),  # smaller than a chunk
        "empty": torch.empty(0).to(device),
        "t": torch.randn(64, 48, generator=g).to(device).t(),  # non-contiguous
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].cpu(), b[key].cpu()), key


@cuda
def test_staged_commits_equal_direct_ones(tmp_path: Path) -> None:
    """Same chunks, same versions' contents, same bytes counted, same restores."""
    with _open(tmp_path / "direct") as direct, _open(tmp_path / "staged") as staged:
        for step in range(3):
            state = _state(step % 2)  # step 2 repeats step 0: all known
            a = direct.commit(state, run="r", step=step)
            b = staged.commit(_state(step % 2, "cuda"), run="r", step=step)
            assert (a.new_bytes, a.logical_bytes) == (b.new_bytes, b.logical_bytes)
            assert [t.digest for t in direct.show(a.id).tensors] == \
                [t.digest for t in staged.show(b.id).tensors]
            _same(staged.restore(b.id), state)
        assert b.new_bytes == 0
        assert internals(staged).device_buffers.windows > 25_000 * 4 // (2 * CHUNK)
        assert staged.ops.check(read_data=True).ok


@cuda
def test_staged_background_commit_copies_only_changed_chunks(tmp_path: Path) -> None:
    with _open(tmp_path / "s", commit_memory=64 * CHUNK) as store:
        state = {"w": torch.randn(50_000, device="cuda")}
        store.commit(state, run="r", step=0)
        state["w"][:10] += 1  # one chunk changes
        handle = store.commit(state, run="r", step=1, block=False)
        expected = state["w"].clone()
        state["w"].zero_()  # mutate at once: the snapshot holds what it needs
        version = handle.wait(30)
        assert version.new_bytes == CHUNK
        assert internals(store).committer.peak_staged == CHUNK
        assert torch.equal(store.restore("r@1")["w"], expected.cpu())


@cuda
def test_any_window_size_round_trips(tmp_path: Path) -> None:
    # the window size is fixed when a store opens (its engine context is immutable): one store
    # per example, each in its own directory
    tried = iter(range(1_000_000))

    @settings(max_examples=15, deadline=None)
    @given(sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=4),
           buffer_chunks=st.integers(2, 9))
    def round_trips(sizes: list[int], buffer_chunks: int) -> None:
        state = {f"t{i}": torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
                 for i, n in enumerate(sizes)}
        with _open(tmp_path / f"s{next(tried)}", staging_memory=buffer_chunks * CHUNK) as store:
            store.commit(state, run="r", step=0)
            _same(store.restore("r@0"), state)

    round_trips()


@cuda
def test_cuda_tensors_commit_through_pinned_buffers(tmp_path: Path) -> None:
    """... and come back bit for bit onto the GPU (``map_location="cuda"``) or into CUDA tensors."""
    state = {"w": torch.randn(3_000_000, device="cuda"), "b": torch.arange(100, device="cuda"),
             "h": torch.randn(333, 64, device="cuda").to(torch.bfloat16),
             "t": torch.randn(64, 48, device="cuda").t()}  # not contiguous
    with casckpt.open(tmp_path / "s", chunk_size=1 << 16, staging_memory=8 << 20) as store:
        store.commit(state, run="r", step=0)
        assert internals(store).device_buffers.pinned
        back = store.restore("r@0", map_location="cuda")
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        store.restore("r@0", into=into)
    for got in (back, into):
        assert {k: str(v.device) for k, v in got.items()} == dict.fromkeys(state, "cuda:0")
        assert [k for k in state if _bits(got[k]) != _bits(state[k])] == []


def _bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    return t.dtype, tuple(t.shape), t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


@cuda
def test_shards_chunk_alike_staged_or_not_and_share_the_whole_tensors_chunks(tmp_path: Path) -> None:
    """Dim-0 pieces of a tensor are chunked on the whole tensor's grid on both paths (CPU
    pieces direct, CUDA ones staged): every chunk not cut by a piece boundary is one the
    whole tensor has."""
    # two stores for all examples: chunk ids depend on content alone, not on what a store holds
    with _open(tmp_path / "direct", staging_memory=2 * CHUNK) as direct, \
            _open(tmp_path / "staged", staging_memory=2 * CHUNK) as staged:

        @given(rows=st.integers(1, 400), cuts=st.lists(st.integers(1, 399), max_size=3),
               dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        @settings(max_examples=25, deadline=None)
        def chunk_alike(rows: int, cuts: list[int], dtype: torch.dtype) -> None:
            _chunk_alike(direct, staged, rows, cuts, dtype)

        chunk_alike()


def _chunk_alike(direct: casckpt.Store, staged: casckpt.Store, rows: int, cuts: list[int],
                 dtype: torch.dtype) -> None:
    bounds = sorted({0, rows, *(c for c in cuts if c < rows)})
    results = []
    on_cpu = (torch.randn(rows, 33) * 100).to(dtype)
    for store, whole in ((direct, on_cpu), (staged, on_cpu.cuda())):
        pieces = [TensorPiece("w", whole[a:b], tuple(whole.shape), (a, 0))
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        ctx = internals(store).context
        (single,) = write_pieces(ctx, [TensorPiece("w", whole, tuple(whole.shape), (0, 0))],
                                 Redundancy("none")).pieces
        # a small host piece is packed (a staged one never is): the same chunks either way
        wrote = write_pieces(ctx, pieces, Redundancy("none"))
        results.append([replace(s.extent, packed=False) for s in wrote.pieces])
    assert results[0] == results[1]
    grid = set(single.extent.chunks)
    row_bytes = 33 * whole.element_size()
    cut_chunks = sum(1 for b in bounds[1:-1] if (b * row_bytes) % single.extent.chunk_size)
    shard_chunks = [c for extent in results[0] for c in extent.chunks]
    assert sum(1 for c in shard_chunks if c not in grid) <= 2 * cut_chunks
    assert len(shard_chunks) == len(single.extent.chunks) + cut_chunks
