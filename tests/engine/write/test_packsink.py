"""The packer's sink thread: jobs in order, every job called once, the first error stops the
rest and reaches the producer, the queue is bounded by bytes."""

from __future__ import annotations

import threading

import pytest

from casckpt.engine.write.packsink import ABORTED, Job, PackSink


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, BaseException | None]] = []

    def job(self, n: int, fail: bool = False, gate: threading.Event | None = None) -> Job:
        def run(error: BaseException | None) -> None:
            if gate is not None:
                gate.wait()
            self.calls.append((n, error))
            if fail and error is None:
                raise OSError(f"job {n} failed")
        return run


def test_jobs_run_in_order_on_another_thread() -> None:
    rec, threads = Recorder(), set()
    sink = PackSink(limit=10)

    def where(error: BaseException | None) -> None:
        threads.add(threading.current_thread())

    for i in range(50):
        sink.put(rec.job(i), 3)
    sink.put(where)
    sink.stop()
    assert rec.calls == [(i, None) for i in range(50)]
    assert threads and threading.current_thread() not in threads


def test_the_first_error_stops_the_rest_and_reaches_the_producer() -> None:
    rec, gate = Recorder(), threading.Event()
    sink = PackSink(limit=100)
    sink.put(rec.job(0, fail=True, gate=gate))
    sink.put(rec.job(1))
    sink.put(rec.job(2, fail=True))
    gate.set()
    with pytest.raises(OSError, match="job 0 failed"):
        sink.stop()
    assert [n for n, _ in rec.calls] == [0, 1, 2]
    first = rec.calls[1][1]
    assert isinstance(first, OSError) and rec.calls[2][1] is first  # told, not run


def test_a_put_after_an_error_raises_it_and_drops_the_job() -> None:
    rec = Recorder()
    sink = PackSink(limit=100)
    sink.put(rec.job(0, fail=True))
    while not rec.calls:  # the job runs on the sink thread
        threading.Event().wait(0.01)
    late = Recorder()
    with pytest.raises(OSError, match="job 0 failed"):
        for _ in range(1000):  # the error is recorded just after the job returns
            sink.put(late.job(1))
            threading.Event().wait(0.001)
    with pytest.raises(OSError):
        sink.stop()
    assert all(error is not None for _, error in late.calls)


def test_stop_with_discard_tells_every_queued_job_and_raises_nothing() -> None:
    rec, gate, running = Recorder(), threading.Event(), threading.Event()

    def first(error: BaseException | None) -> None:
        running.set()
        gate.wait()
        rec.calls.append((0, error))

    sink = PackSink(limit=100)
    sink.put(first)
    assert running.wait(30), "the sink thread never ran the first job"  # else stop() would discard it
    for i in range(1, 5):
        sink.put(rec.job(i))
    stopper = threading.Thread(target=lambda: sink.stop(discard=True))
    stopper.start()
    while not any(n == 1 for n, _ in rec.calls):  # the queued ones are told at once
        threading.Event().wait(0.01)
    gate.set()  # the running job ends as it would
    stopper.join()
    assert sorted(rec.calls, key=lambda c: c[0]) == [(0, None)] + [(i, ABORTED) for i in range(1, 5)]


def test_the_queue_is_bounded_by_bytes() -> None:
    rec, gate = Recorder(), threading.Event()
    sink = PackSink(limit=10)
    sink.put(rec.job(0, gate=gate), 6)  # runs, and holds its 6 bytes until it is done
    sink.put(rec.job(1), 4)  # fits beside it
    queued = threading.Thread(target=lambda: sink.put(rec.job(2), 1))
    queued.start()
    queued.join(0.3)
    assert queued.is_alive(), "a put past the bound did not wait"
    gate.set()
    queued.join()
    sink.stop()
    assert [n for n, _ in rec.calls] == [0, 1, 2]


def test_a_job_larger_than_the_bound_waits_for_an_empty_queue_and_then_goes() -> None:
    rec = Recorder()
    sink = PackSink(limit=4)
    sink.put(rec.job(0), 3)
    sink.put(rec.job(1), 100)
    sink.stop()
    assert [n for n, _ in rec.calls] == [0, 1]
