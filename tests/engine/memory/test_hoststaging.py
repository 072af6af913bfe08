"""Host staging (``engine/memory/hoststaging.py``): a staged state reads as the live one did,
buffers are reused across commits, and a vouched tensor skips its copy only when its buffer
still holds its bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from casckpt.engine.memory.hoststaging import HostStaging, layout
from casckpt.format.state import encode_state


def _stage(host: HostStaging, state: Any, run: str = "r", vouched: Any = None) -> Any:
    root, leaves = encode_state(state)
    plan = layout(leaves)
    target = host.hold(host.idle(run), run)
    staged = host.stage(target, root, leaves, plan, vouched or (lambda _p: False))
    return staged, plan


def test_the_mirror_reads_as_the_state_did_and_keeps_shared_storage() -> None:
    base = torch.arange(64, dtype=torch.float32)
    state = {"base": base, "view": base[3:40:2], "t": base.view(8, 8).t(), "tied": base,
             "np": np.arange(5, dtype=np.int16), "n": 3, "c": torch.randn(4, dtype=torch.complex64).conj()}
    host = HostStaging()
    staged, plan = _stage(host, state)
    mirror = staged.mirror
    base.add_(100)  # the live state moves on; the copy does not
    assert len(plan.groups) == 3  # base and its views share one buffer; np and c have their own
    assert torch.equal(mirror["view"], (torch.arange(64.0))[3:40:2])
    assert mirror["t"].stride() == state["t"].stride()
    assert mirror["tied"].data_ptr() == mirror["base"].data_ptr()
    assert mirror["view"].untyped_storage().data_ptr() == mirror["base"].untyped_storage().data_ptr()
    assert mirror["c"].is_conj() and torch.equal(mirror["c"], state["c"])
    assert (mirror["np"] == state["np"]).all() and mirror["n"] == 3
    assert staged.copied == plan.nbytes


def test_buffers_are_reused_and_vouched_tensors_copied_only_into_a_stale_set() -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(1000)}
    host = HostStaging()
    first, _ = _stage(host, state)
    pointer = first.mirror["a"].data_ptr()
    host.release(first.held)
    again, _ = _stage(host, state, vouched=lambda p: p == "a")
    assert again.mirror["a"].data_ptr() == pointer  # the same buffer, faulted in already
    assert again.copied == state["b"].nbytes and again.skipped == {"a"}
    # the first set is still held: a second one holds nothing yet, so the vouched tensor is copied
    second, _ = _stage(host, state, vouched=lambda p: p == "a")
    assert second.held is not again.held and second.copied == 2 * 4000
    assert host.allocated == 2 * 8000
    host.release(again.held)
    host.forget("r")  # e.g. a commit of the run failed before its copies were all made
    after, _ = _stage(host, state, vouched=lambda p: True)
    assert after.copied == 8000
    host.release(after.held)
    host.release(second.held)
    assert host.free_idle(None) == 2 * 8000 and host.allocated == 0


def test_a_skipped_group_reuses_its_views_only_while_they_describe_the_state() -> None:
    """A group vouched for and still current in its set is neither copied nor viewed anew: the
    mirror reuses the views made when it was staged. A group whose members changed (a new
    alias of the storage) or a tensor now viewed as its conjugate (a bit no version counter
    sees) gets new views of the same buffer."""
    base = torch.arange(64, dtype=torch.float32)
    c = torch.randn(4, dtype=torch.complex64)
    host = HostStaging()
    first, _ = _stage(host, {"base": base, "view": base[8:16], "c": c})
    host.release(first.held)
    again, _ = _stage(host, {"base": base, "view": base[8:16], "c": c}, vouched=lambda _p: True)
    assert again.copied == 0 and again.skipped == {"base", "view", "c"}
    assert again.mirror["view"] is first.mirror["view"] and again.mirror["c"] is first.mirror["c"]
    host.release(again.held)
    state = {"base": base, "view": base[8:16], "alias": base[16:24], "c": c.conj()}
    third, _ = _stage(host, state, vouched=lambda _p: True)
    assert third.copied == 0
    assert torch.equal(third.mirror["alias"], base[16:24]) and torch.equal(third.mirror["view"], base[8:16])
    assert third.mirror["c"].is_conj() and torch.equal(third.mirror["c"], c.conj())
    buffer = first.mirror["base"].untyped_storage().data_ptr()
    assert third.mirror["alias"].untyped_storage().data_ptr() == buffer


def test_a_copied_group_reuses_its_views_only_for_the_same_geometry() -> None:
    """Copied again (nothing vouched): the views of its buffer are reused while each tensor
    has the dtype, shape, strides, offset and bits it had; a tensor viewing another part of
    the same storage gets a new view, reading the bytes it reads."""
    base = torch.arange(64, dtype=torch.float32)
    host = HostStaging()
    first, _ = _stage(host, {"base": base, "part": base[8:16]})
    host.release(first.held)
    base.add_(1)
    again, _ = _stage(host, {"base": base, "part": base[8:16]})
    assert again.copied == first.copied and again.mirror["part"] is first.mirror["part"]
    assert torch.equal(again.mirror["part"], base[8:16])
    host.release(again.held)
    moved, _ = _stage(host, {"base": base, "part": base[16:24].view(2, 4)})
    assert moved.mirror["part"] is not first.mirror["part"]
    assert torch.equal(moved.mirror["part"], base[16:24].view(2, 4))
