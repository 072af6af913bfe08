"""``load_plain``: the plain values ``torch.save`` writes come back exactly; nothing else loads.

It replaces ``torch.load(weights_only=True)`` inside ``torch.serialization.safe_globals([bytes])``
for DCP's non-tensor values: that allow-list is one for the whole process, so it must be left
as the user set it, whatever thread saves.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import casckpt
from casckpt.errors import UnsupportedStateError
from casckpt.format.plainpickle import RefusedValue, load_plain

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from exact import exact_differences  # noqa: E402


def saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
           | st.floats(allow_nan=True) | st.text() | st.binary() | st.binary().map(bytearray))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.lists(inner, max_size=4).map(tuple)
                      | st.dictionaries(st.text() | st.integers(), inner, max_size=4)
                      | st.dictionaries(st.text(), inner, max_size=3).map(collections.OrderedDict)
                      | st.dictionaries(st.text(), st.integers(), max_size=3).map(collections.Counter),
                      max_leaves=12)


@given(values)
def test_every_plain_value_comes_back_exactly(value: Any) -> None:
    # an OrderedDict / Counter comes back as load_plain's subclass of it
    assert exact_differences(load_plain(saved(value)), value, subclasses=True) == []


class Forged:
    def __init__(self, reduced: Any) -> None:
        self.reduced = reduced

    def __reduce__(self) -> Any:
        return self.reduced


class Named:
    pass


@pytest.mark.parametrize(("value", "what"), [
    (torch.ones(2), "tensor"),
    ((torch.ones(2), 1), "tensor"),
    (Named(), "a test_plainpickle.Named"),
    ({1}, "a builtins.set"),
    (torch.float32, "a torch.float32"),
    (Forged((bytes, (10**12,))), "bytes(...)"),  # would allocate a terabyte
    (Forged((bytes, (b"abc",))), "bytes(...)"),
    (Forged((bytearray, (7,))), "bytearray(...)"),
    (Forged((eval, ("1",))), "a builtins.eval"),
    (torch.nn.Parameter(torch.ones(1)), "tensor"),
    (Forged((collections.Counter, (5,))), "Counter(...)"),
])
def test_anything_but_a_plain_value_is_refused_by_name(value: Any, what: str) -> None:
    with pytest.raises(RefusedValue) as refused:
        load_plain(saved(value))
    assert what in refused.value.what


def test_bytes_that_are_not_a_torch_save_value_are_refused() -> None:
    for data in (b"", b"not a zip", pickle.dumps({"a": 1}), saved(1)[:40]):
        with pytest.raises(RefusedValue, match="not"):
            load_plain(data)


def test_dicts_with_attributes_are_refused() -> None:
    """pickle gives an OrderedDict's attributes to BUILD; a forged Counter could too."""
    ordered = collections.OrderedDict(a=1)
    ordered.seen = 5  # type: ignore[attr-defined]
    for value in (ordered, Forged((collections.Counter, ({"a": 1},), {"seen": 5}))):
        with pytest.raises(RefusedValue, match="attributes"):
            load_plain(saved(value))


def test_a_compressed_member_is_refused_unread() -> None:
    """torch.save stores its members as they are; a deflated data.pkl could be gigabytes."""
    pickled = pickle.dumps({"a": b"x" * 10**6}, protocol=2)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", pickled)
    with pytest.raises(RefusedValue, match="not one torch.save pickle"):
        load_plain(buffer.getvalue())


def test_a_dcp_save_leaves_torchs_allow_list_as_the_user_set_it(tmp_path: Any) -> None:
    """A b'' value made the writer enter ``safe_globals([bytes])``; leaving it dropped the
    user's own ``bytes`` entry, and their next weights-only load of b'' failed."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([bytes])
    try:
        with casckpt.open(tmp_path / "s") as store:
            dcp.save({"w": torch.ones(2), "blob": b"", "more": bytearray()},
                     storage_writer=store.dcp_writer(run="r", step=1))
            assert store.restore("r@1")["blob"] == b""
        assert bytes in torch.serialization.get_safe_globals()
        assert torch.load(io.BytesIO(saved(b"")), weights_only=True) == b""
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_values_checked_on_many_threads_never_refuse_each_other() -> None:
    """dcp.async_save checks values on a background thread: with a process-wide allow-list one
    thread's exit refused another's valid b''."""
    from casckpt.dcp import _value_node

    data, errors = saved({"x": b"", "y": [b"", bytearray()]}), []

    def check() -> None:
        try:
            for _ in range(300):
                _value_node("v", io.BytesIO(data))
        except UnsupportedStateError as exc:  # pragma: no cover - the failure being guarded
            errors.append(exc)

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
