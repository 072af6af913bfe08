"""Huge pages for the fresh buffers a restore fills.

A restore writes every byte of memory nothing has touched yet, and the first write to each
4 KiB page is a page fault that zeroes it: for a large state the faults cost more CPU than
the copy out of the page cache and the hash together (64 MiB buffers, one core: ~0.6 ms of
faults per MiB, ~0.1 ms with 2 MiB pages). ``torch.load`` pays the same faults.

Where transparent huge pages are on ``madvise`` (the common default), :func:`huge_pages`
advises the whole 2 MiB pages of each large fresh buffer huge while it is filled, and takes
the advice back afterwards: the pages already made stay huge, and memory the allocator hands
out again later behaves as it did before (no huge pages), so nothing outside the restore
changes. Under ``always`` the kernel does it anyway; under ``never`` (or off Linux) nothing
is advised. Advice changes no byte: where no huge page is free the kernel uses small ones.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache

import numpy as np
import torch

HUGE_PAGE = 2 << 20
MIN_BUFFER = 4 << 20
"""Smaller buffers are left alone: few whole huge pages fit, and each advised range may split
one of the process's memory mappings in three (their number is capped by the kernel)."""
MAX_ADVISED = 1024
"""The largest buffers of one restore that are advised, for the same cap."""

_MAPS = "/proc/self/maps"
_MAP_CAP = "/proc/sys/vm/max_map_count"

_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_Madvise = Callable[[int, int, int], int]


@cache
def _madvise() -> _Madvise | None:
    """libc's ``madvise``, when advising huge pages changes what the kernel does here."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        with open(_THP_MODE, encoding="ascii") as f:
            mode = f.read()
    except OSError:
        return None
    if "[madvise]" not in mode:  # always: the kernel does it unasked; never: it refuses
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    advise = libc.madvise
    advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise  # type: ignore[no-any-return]


def _whole_pages(buffer: torch.Tensor | np.ndarray) -> tuple[int, int] | None:
    """The 2 MiB-aligned span inside ``buffer``'s bytes: (start address, length), or None."""
    if isinstance(buffer, torch.Tensor):
        address, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    else:
        address, nbytes = buffer.ctypes.data, buffer.nbytes
    if nbytes < MIN_BUFFER:
        return None
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


def _room_for_splits() -> bool:
    """Whether the process's memory mappings stay far below the kernel's cap on them when
    each advised range splits one in three. A buffer in the allocator's heap keeps its
    range's advice (and its split) after it is freed: a long-lived process restoring again
    and again could pile them up, and at the cap any further ``mmap`` of the process fails."""
    try:
        with open(_MAP_CAP, encoding="ascii") as f:
            cap = int(f.read())
        with open(_MAPS, "rb") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return False
    return used + 2 * MAX_ADVISED < cap // 2


@contextmanager
def huge_pages(buffers: Sequence[torch.Tensor | np.ndarray]) -> Iterator[None]:
    """Advise the whole 2 MiB pages of ``buffers`` (fresh, contiguous CPU buffers nothing has
    written yet) huge while the block runs; then take the advice back (see the module
    docstring). A refused advice (an old kernel) leaves small pages."""
    advise = _madvise()
    spans = [] if advise is None else [s for b in buffers if (s := _whole_pages(b)) is not None]
    if spans and not _room_for_splits():
        spans = []
    spans.sort(key=lambda span: -span[1])
    advised = [span for span in spans[:MAX_ADVISED]
               if advise is not None and advise(*span, mmap.MADV_HUGEPAGE) == 0]
    try:
        yield
    finally:
        for span in advised:
            advise(*span, mmap.MADV_NOHUGEPAGE)  # type: ignore[misc]  # advised: advise is set
