"""Device-to-host staging: stream a GPU tensor's bytes through a reused pair of pinned buffers.

A commit never copies a whole GPU tensor to the host. Its bytes come over in
windows (a whole number of chunks each) into two page-locked host buffers,
alternately: while the commit hashes window ``i`` and copies out the chunks
the store does not hold, the device-to-host copy of window ``i + 1`` runs on
its own CUDA stream. So the host memory a GPU tensor costs is the two
buffers (``staging_memory`` in all, allocated once per store) plus its
changed chunks.

Without CUDA the same code runs with ordinary host buffers (a CPU tensor can
be staged too, which is how the tests exercise this path on machines
without a GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the first tensor is staged: opening a store needs no torch
    import torch


class StagingBuffers:
    """Two reusable host buffers, ``total`` bytes together, for streaming device tensors: each
    window is at most half, rounded down to a whole number of chunks. One stream at a time."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.windows = 0  # windows streamed so far (for tests and benchmarks)

    @property
    def pinned(self) -> bool:
        """Whether the buffers are page-locked host memory (False until the first stream allocates them)."""
        buffers = self._buffers
        return bool(buffers) and buffers[0].is_pinned()

    def _allocate(self) -> list[torch.Tensor]:
        import torch

        if not self._buffers:
            pinned = torch.cuda.is_available()
            self._buffers = [torch.empty(max(1, self.total // 2), dtype=torch.uint8, pin_memory=pinned)
                             for _ in range(2)]
        return self._buffers

    def stream(self, flat: torch.Tensor, unit: int) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(offset, host bytes)`` windows covering the 1-D uint8 tensor ``flat``.

        Each window is a multiple of ``unit`` bytes (the chunk size) except
        the last. A yielded view is valid until the generator is resumed.
        """
        import torch

        with self._lock:
            buffers = self._allocate()
            window = max(unit, (len(buffers[0]) // unit) * unit)
            if window > len(buffers[0]):  # one chunk larger than a buffer: grow both
                buffers[:] = [torch.empty(window, dtype=torch.uint8, pin_memory=buffers[0].is_pinned())
                              for _ in range(2)]
            yield from self._windows(flat, buffers, window)

    def _windows(self, flat: torch.Tensor, buffers: list[torch.Tensor],
                 window: int) -> Iterator[tuple[int, memoryview]]:
        import torch

        n = flat.numel()
        count = -(-n // window)
        cuda = flat.device.type == "cuda"
        side = torch.cuda.Stream(flat.device) if cuda else None  # type: ignore[no-untyped-call]
        events: list[torch.cuda.Event | None] = [None, None]

        def issue(i: int) -> None:
            start = i * window
            end = min(n, start + window)
            target = buffers[i % 2][: end - start]
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(flat.device))  # the data is ready
                with torch.cuda.stream(side):
                    target.copy_(flat[start:end], non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(side)
                events[i % 2] = event
            else:
                target.copy_(flat[start:end])

        try:
            if count:
                issue(0)
            for i in range(count):
                if i + 1 < count:
                    issue(i + 1)  # into the buffer the consumer finished with before resuming us
                event = events[i % 2]
                if event is not None:
                    event.synchronize()
                start = i * window
                end = min(n, start + window)
                self.windows += 1
                yield start, memoryview(buffers[i % 2][: end - start].numpy())  # type: ignore[arg-type]
        finally:
            if side is not None:  # the consumer stopped early: no copy may still land in a buffer
                flat.record_stream(side)  # nor may the caching allocator reuse the source meanwhile
                side.synchronize()
