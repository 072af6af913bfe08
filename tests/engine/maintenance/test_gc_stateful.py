"""A stateful property test: commits, tags, forks, retention, deletes, GC and restores interleaved.

Hypothesis drives a real store (SQLite, small chunks and packs, grace 0)
through random sequences and checks, after every step, that every version
the model says survives restores bit-exact, that every removed version is
gone, and after every GC that ``check(read_data=True)`` is clean.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import casckpt
from casckpt.errors import RefNotFoundError

CONTENTS = 5  # few distinct contents, so versions share chunks and GC has real work


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(1500, generator=torch.Generator().manual_seed(seed))


def _state(seeds: tuple[int, int]) -> dict[str, object]:
    return {"a": _tensor(seeds[0]), "b": _tensor(100 + seeds[1]), "meta": {"seeds": list(seeds)}}


class StoreMachine(RuleBasedStateMachine):
    """The model: version id -> (run, step, seeds) for every version that should exist."""

    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="casckpt-stateful-"))
        self.store = casckpt.open(self.dir / "store", chunk_size=2048, pack_size=16 << 10)
        self.alive: dict[str, tuple[str, int, tuple[int, int]]] = {}
        self.gone: set[str] = set()
        self.next_step: dict[str, int] = {}
        self.forked = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(target=runs, name=st.sampled_from(["a", "b"]))
    def new_run(self, name: str) -> str:
        return name

    @rule(run=runs, seeds=st.tuples(st.integers(0, CONTENTS - 1), st.integers(0, CONTENTS - 1)))
    def commit(self, run: str, seeds: tuple[int, int]) -> None:
        step = self.next_step.get(run, 0)
        self.next_step[run] = step + 10
        version = self.store.commit(_state(seeds), run=run, step=step)
        self.alive[version.id] = (run, step, seeds)

    @precondition(lambda self: self.alive)
    @rule(data=st.data(), name=st.sampled_from(["best", "keep"]))
    def tag(self, data: st.DataObject, name: str) -> None:
        version = data.draw(st.sampled_from(sorted(self.alive)))
        self.store.tag(version, name)

    @precondition(lambda self: self.alive)
    @rule(target=runs, data=st.data())
    def fork(self, data: st.DataObject) -> str:
        version = data.draw(st.sampled_from(sorted(self.alive)))
        self.forked += 1
        name = f"fork{self.forked}"
        self.store.fork(version, name)
        return name

    @rule(run=runs, keep=st.integers(1, 3))
    def retention(self, run: str, keep: int) -> None:
        self.store.retention.set(run, keep_last=keep)

    @precondition(lambda self: self.alive)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(sorted(self.alive)))
        self.store.delete(version)
        self.alive.pop(version)
        self.gone.add(version)

    @rule()
    def gc(self) -> None:
        report = self.store.gc(grace=0)
        for plan in report.retention:
            for version in plan.deleted:
                assert version.id in self.alive, "retention removed a version already gone"
                self.alive.pop(version.id)
                self.gone.add(version.id)
        check = self.store.ops.check(read_data=True)
        assert check.ok, check.problems[:3]

    @precondition(lambda self: self.alive)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(sorted(self.alive)))
        _, _, seeds = self.alive[version]
        restored = self.store.restore(version)
        expected = _state(seeds)
        assert torch.equal(restored["a"], expected["a"]) and torch.equal(restored["b"], expected["b"])
        assert restored["meta"] == expected["meta"]

    @invariant()
    def listing_matches_the_model(self) -> None:
        listed = {v.id for v in self.store.log()}
        assert listed == set(self.alive)
        for version in list(self.gone)[:3]:
            try:
                self.store.resolve(version)
            except RefNotFoundError:
                continue
            raise AssertionError(f"removed version {version[:12]} still resolves")


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=15, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
