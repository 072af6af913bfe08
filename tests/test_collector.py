"""``casckpt.collector``: the one collector pause commits' snapshots and long listings share."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from casckpt import collector


def test_paused_inside_and_enabled_again_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(KeyError), collector.paused():
        assert not gc.isenabled()
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_program_paused_stays_paused() -> None:
    gc.disable()
    try:
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_of_two_threads_resume_once_the_last_one_ends() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector.paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with collector.paused():
        pass
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_objects_made_while_paused_end_in_the_oldest_generation_and_frozen_ones_stay_frozen() -> None:
    with collector.paused():
        made = [[i] for i in range(1000)]
    assert gc.get_count()[0] < len(made)  # promoted, not left for a young collection to walk
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector.paused():
            more = [[i] for i in range(100)]
        assert gc.get_freeze_count() > frozen // 2  # the program's freeze is not undone (some die)
        assert len(more) == 100
    finally:
        gc.unfreeze()


def test_a_process_forked_inside_a_pause_runs_its_collector_and_the_parent_resumes_once() -> None:
    with collector.paused():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's pause is not its own
            os.close(read)
            enabled = gc.isenabled()
            with collector.paused():
                inner = not gc.isenabled()
            os.write(write, bytes([enabled, inner, gc.isenabled()]))
            os._exit(0)
        os.close(write)
        assert not gc.isenabled()
    assert gc.isenabled()
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == bytes([True, True, True])
