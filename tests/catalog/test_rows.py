"""``catalog/rows.py``: the collector pause that long listings are built under."""

from __future__ import annotations

import gc

import pytest

from casckpt.catalog.rows import collection_paused


def test_collection_is_paused_inside_and_enabled_again_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(KeyError), collection_paused():
        assert not gc.isenabled()
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused() -> None:
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
