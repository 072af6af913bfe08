"""Change hints (``Store.commit(..., unchanged=..., trust_versions=...)``): the tensors a caller
vouches for are not read, only the others are hashed and written; restores stay bit-exact for
a truthful caller; the default path (no hint) hashes everything.

Bytes hashed are counted by wrapping the commit's chunk hasher; every test that writes ends
with ``check(read_data=True)``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.engine.write import commit as commit_engine
from casckpt.engine.write import commitchunks
from casckpt.errors import ChangeHintError, InvalidArgumentError

N = 8192  # fp32 elements: 32 KiB per tensor, above the size small tensors are packed at


class Hashed:
    """Bytes the commit pipeline hashed (chunk ids computed), since the last reset."""

    def __init__(self) -> None:
        self.bytes = 0

    def reset(self) -> None:
        self.bytes = 0


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hashed]:
    counter = Hashed()
    real = commitchunks.hash_chunks  # where a commit hashes tensor bytes (not tree nodes)

    def counting(ctx: Any, views: Sequence[memoryview]) -> list[bytes]:
        counter.bytes += sum(len(v) for v in views)
        return real(ctx, views)

    monkeypatch.setattr(commitchunks, "hash_chunks", counting)
    yield counter


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {name: torch.randn(N, generator=g) for name in ("a", "b", "c")},
            "optim": {"m": torch.randn(N, generator=g)}, "step": seed}


def _equal(restored: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return restored.keys() == expected.keys() and all(_equal(restored[k], v) for k, v in expected.items())
    if isinstance(expected, torch.Tensor):
        return isinstance(restored, torch.Tensor) and restored.dtype == expected.dtype and \
            torch.equal(restored, expected)
    return bool(restored == expected)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("spec", [
    ["model.a", "model.c", "optim.m"],
    ["model.[ac]", "optim.*"],
    lambda path: path != "model.b",
], ids=["paths", "globs", "predicate"])
def test_only_the_tensors_not_declared_unchanged_are_hashed_and_written(
        store: casckpt.Store, hashed: Hashed, spec: Any) -> None:
    state = _state()
    store.commit(state, run="r", step=1)
    state["model"]["b"].add_(1.0)
    hashed.reset()
    v2 = store.commit(state, run="r", step=2, unchanged=spec)
    assert hashed.bytes == _bytes(state["model"]["b"])
    assert v2.new_bytes == _bytes(state["model"]["b"])
    assert _equal(store.restore("r@2"), state)


def test_without_a_hint_every_byte_is_hashed(store: casckpt.Store, hashed: Hashed) -> None:
    state = _state()
    store.commit(state, run="r", step=1)
    hashed.reset()
    v2 = store.commit(state, run="r", step=2)
    assert hashed.bytes == sum(_bytes(t) for t in [*state["model"].values(), state["optim"]["m"]])
    assert v2.new_bytes == 0


def test_a_tensor_new_to_the_run_is_hashed_even_if_declared_unchanged(store: casckpt.Store,
                                                                       hashed: Hashed) -> None:
    state = _state()
    store.commit(state, run="r", step=1, unchanged="*")  # no previous version at all
    assert hashed.bytes == 4 * N * 4
    state["model"]["d"] = torch.ones(N)
    hashed.reset()
    store.commit(state, run="r", step=2, unchanged="*")
    assert hashed.bytes == N * 4  # only the new tensor
    assert _equal(store.restore("r@2"), state)


def test_a_declared_tensor_whose_shape_changed_is_refused_with_nothing_written(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1)
    state["model"]["a"] = torch.zeros(N // 2)
    with pytest.raises(ChangeHintError, match="model.a"):
        store.commit(state, run="r", step=2, unchanged=["model.a"])
    assert [v.step for v in store.log("r")] == [1]
    # the refused commit made no version: the next hint is not about version 1 any more, so it is
    # ignored and every tensor hashed (the float64 tensor is stored, not refused)
    state["model"]["a"] = torch.zeros(N, dtype=torch.float64)
    store.commit(state, run="r", step=2, unchanged=["model.a"])
    assert store.restore("r@2")["model"]["a"].dtype == torch.float64
    state["model"]["a"] = torch.zeros(N)
    with pytest.raises(ChangeHintError, match="float64"):  # declared unchanged against version 2
        store.commit(state, run="r", step=3, unchanged=["model.a"])


def test_a_lying_hint_stores_the_previous_bytes_and_check_reads_it(tmp_path: Path) -> None:
    """Documented failure mode: a wrong hint stores the parent's bytes (nothing is corrupt);
    ``check --read-data`` tells it from the fingerprint the commit took."""
    state = _state()
    before = state["model"]["a"].clone()
    with casckpt.open(tmp_path / "s") as store:
        store.commit(state, run="r", step=1)
        state["model"]["a"].add_(1.0)
        store.commit(state, run="r", step=2, unchanged=["model.a"])
        assert torch.equal(store.restore("r@2")["model"]["a"], before)
        assert store.ops.check().ok  # without reading data nothing is wrong
        found = store.ops.check(read_data=True).problems
        assert [(p.kind, p.subject) for p in found] == [("hint", "r@2:model.a")]


def test_bad_hint_arguments_are_refused(store: casckpt.Store) -> None:
    with pytest.raises(InvalidArgumentError):
        store.commit(_state(), run="r", step=1, unchanged=[1, 2])  # type: ignore[list-item]
    assert not store.runs()


def test_hinted_chunks_the_store_does_not_hold_are_hashed(store: casckpt.Store, hashed: Hashed,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A hint never references a chunk the store has lost (a GC sweep, a stale cache): such
    a tensor is hashed and written again."""
    state = _state()
    store.commit(state, run="r", step=1)
    real = commitchunks.known_chunks
    calls: list[int] = []

    def lost_first(ctx: Any, ids: Any, confirm: bool = False) -> set[bytes]:
        calls.append(len(ids))  # the first lookup is the hinted chunks'
        return set() if len(calls) == 1 else real(ctx, ids, confirm)

    monkeypatch.setattr(commit_engine, "known_chunks", lost_first)
    hashed.reset()
    store.commit(state, run="r", step=2, unchanged="*")
    assert hashed.bytes == 4 * N * 4
    assert _equal(store.restore("r@2"), state)


def test_background_commits_take_the_hint(store: casckpt.Store, hashed: Hashed) -> None:
    state = _state()
    store.commit(state, run="r", step=1, block=False).wait()  # hashed by the worker
    state["model"]["b"].add_(1.0)
    hashed.reset()
    h2 = store.commit(state, run="r", step=2, block=False, unchanged=["model.a", "model.c", "optim.*"])
    expected = {k: v.clone() for k, v in state["model"].items()}
    state["optim"]["m"].mul_(2.0)  # after the snapshot: the caller may mutate
    state["model"]["c"].add_(3.0)
    h3 = store.commit(state, run="r", step=3, block=False, unchanged=["model.a", "model.b"])
    assert h2.wait().new_bytes == _bytes(state["model"]["b"])
    h3.wait()
    assert hashed.bytes == 3 * N * 4
    assert _equal(store.restore("r@2")["model"], expected)
    assert _equal(store.restore("r@3"), state)


def test_trusted_version_counters_skip_tensors_not_written_since_the_last_commit(
        store: casckpt.Store, hashed: Hashed) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def step() -> None:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    store.commit(state(), run="r", step=1, trust_versions=True)
    step()
    hashed.reset()
    store.commit(state(), run="r", step=2, trust_versions=True)
    frozen = model[0].weight
    changed = sum(_bytes(t) for path, t in _tensors(state()) if "0.weight" not in path
                  and t.numel() * t.element_size() > 16 << 10)
    assert hashed.bytes == changed  # the frozen layer's weight (32 KiB) was not read
    assert _equal(store.restore("r@2")["model"], state()["model"])
    with torch.no_grad():
        frozen.mul_(2.0)  # bumps the counter: hashed
    hashed.reset()
    store.commit(state(), run="r", step=3, trust_versions=["model.*"])
    moments = [t for path, t in _tensors(state()["optim"]) if t.numel() * t.element_size() > 16 << 10]
    assert hashed.bytes == _bytes(frozen) + sum(_bytes(t) for t in moments)  # not trusted: hashed
    assert _equal(store.restore("r@3")["model"], state()["model"])


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _no_grad(f: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], None]:
    def run(t: torch.Tensor) -> None:
        with torch.no_grad():
            f(t)
    return run


def _assign_data(t: torch.Tensor) -> None:
    t.data = torch.full_like(t, 7.0)


def _fused_adamw(p: torch.Tensor) -> None:
    opt = torch.optim.AdamW([p], fused=True)
    p.grad = torch.ones_like(p)
    opt.step()


def _foreach_adamw(p: torch.Tensor) -> None:
    opt = torch.optim.AdamW([p], foreach=True)
    p.grad = torch.ones_like(p)
    opt.step()


def _swap(p: torch.Tensor) -> None:
    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.full_like(p, 7.0)))


# (mutation, caught by trust_versions) -- the table in Store.commit's docstring and
# docs/ARCHITECTURE.md ("Change hints"); a change in torch's behaviour fails here first
MUTATIONS: dict[str, tuple[Callable[[torch.Tensor], None], bool]] = {
    "in-place op under no_grad": (_no_grad(lambda t: t.add_(1.0)), True),
    "in-place op on .detach()": (lambda t: t.detach().add_(1.0), True),
    "copy_ into a view": (_no_grad(lambda t: t.view(-1)[:10].copy_(torch.ones(10))), True),
    "optimizer step (foreach)": (_foreach_adamw, True),
    "set_()": (_no_grad(lambda t: t.set_(torch.full((N,), 7.0))), True),
    ".data = (assignment)": (_assign_data, True),
    "torch.utils.swap_tensors": (_swap, True),
    "in-place op on .data": (lambda t: t.data.add_(1.0), False),
    "write through .numpy()": (lambda t: t.detach().numpy().__setitem__(0, 9.0), False),
    "write through DLPack": (lambda t: np.from_dlpack(t.detach()).__setitem__(0, 9.0), False),
    "untyped_storage().copy_": (lambda t: t.untyped_storage().copy_(
        torch.full((N,), 9.0).untyped_storage()), False),
    "ctypes.memmove": (lambda t: ctypes.memmove(t.data_ptr(), torch.full((N,), 9.0).data_ptr(), 16), False),
    "optimizer step (fused=True)": (_fused_adamw, False),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_which_mutations_trusted_version_counters_see(tmp_path: Path, name: str) -> None:
    mutate, caught = MUTATIONS[name]
    param = torch.nn.Parameter(torch.randn(N))
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"p": param.detach()}, run="r", step=1, trust_versions=True)
        before = param.detach().clone()
        mutate(param)
        assert not torch.equal(param.detach(), before)
        store.commit({"p": param.detach()}, run="r", step=2, trust_versions=True)
        restored = store.restore("r@2")["p"]
        assert torch.equal(restored, param.detach() if caught else before)
        found = store.ops.check(read_data=True).problems  # a mutation the counters miss: caught here
        assert [(p.kind, p.subject) for p in found] == ([] if caught else [("hint", "r@2:p")])


def test_counters_are_trusted_only_after_a_trusted_commit_of_the_same_parent(
        store: casckpt.Store, hashed: Hashed) -> None:
    state = _state()
    store.commit(state, run="r", step=1)  # no counters recorded
    hashed.reset()
    store.commit(state, run="r", step=2, trust_versions=True)
    assert hashed.bytes == 4 * N * 4
    store.commit(state, run="other", step=1, trust_versions=True)  # another run's counters
    hashed.reset()
    store.commit(state, run="r", step=3, trust_versions=True)
    assert hashed.bytes == 0
    assert _equal(store.restore("r@3"), state)


_mutation = st.sampled_from(["none", "add", "replace", "reshape", "drop", "new"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(0, 3 * N), min_size=1, max_size=5),
       mutations=st.lists(st.lists(_mutation, min_size=5, max_size=5), min_size=1, max_size=3),
       hinted=st.booleans())
def test_random_states_and_mutations_restore_bit_exact(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                                       sizes: list[int], mutations: list[list[str]],
                                                       hinted: bool) -> None:
    """The default path stays bit-exact whatever changes; so does a truthful hint (naming the
    tensors the step did not touch) and trusted counters."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    with casckpt.open(tmp_path_factory.mktemp("s") / "s") as store:
        store.commit(state, run="r", step=0, trust_versions=hinted)
        for step, plan in enumerate(mutations, 1):
            untouched = []
            for name, how in zip(list(state), plan, strict=False):
                t = state[name]
                if how == "none":
                    untouched.append(name)
                elif how == "add" and t.numel():
                    t.view(-1)[int(torch.randint(t.numel(), (1,), generator=g))] += 1.0
                elif how == "replace":
                    state[name] = torch.randn(t.numel(), generator=g)
                elif how == "reshape" and t.numel() % 2 == 0 and t.numel():
                    state[name] = t.reshape(2, -1)
                elif how == "drop":
                    del state[name]
            state[f"n{step}"] = torch.randn(int(sizes[0]), generator=g)
            hint: dict[str, Any] = {"unchanged": untouched, "trust_versions": True} if hinted else {}
            store.commit(state, run="r", step=step, **hint)
            assert _equal(store.restore(f"r@{step}"), state)
        assert store.ops.check(read_data=True).ok


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
def test_hinted_device_tensors_are_not_staged(tmp_path: Path, hashed: Hashed) -> None:
    """CUDA tensors stream through staging buffers: hinted ones are neither streamed nor
    hashed, restores stay exact."""
    state = _state()
    for part in ("model", "optim"):
        state[part] = {name: t.cuda() for name, t in state[part].items()}
    with casckpt.open(tmp_path / "s", chunk_size=8192, staging_memory=4 * 8192) as store:
        store.commit(state, run="r", step=1, trust_versions=True)
        state["model"]["b"].add_(1.0)
        hashed.reset()
        store.commit(state, run="r", step=2, unchanged=["model.a"], trust_versions=True)
        assert hashed.bytes == _bytes(state["model"]["b"])
        assert _equal(store.restore("r@2", map_location="cuda"), state)
        assert store.ops.check(read_data=True).ok


def test_a_hint_after_a_background_commit_that_failed_before_its_hash_is_ignored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller vouches for its tensors since its LAST commit; when that one failed before
    making a version (a catalog blip while hashing), the run's parent is an older version whose
    bytes differ: the next hinted commit must hash, never reuse the older chunks."""
    from casckpt.engine.write import commit as commit_engine
    from casckpt.errors import CatalogUnavailableError

    with casckpt.open(tmp_path / "s", cache=tmp_path / "c") as store:
        x, y = torch.zeros(300_000), torch.ones(300_000)
        state = {"x": x, "y": y}
        store.commit(state, run="r", step=1, block=False, trust_versions=True).wait()
        x.add_(1)  # changes between version 1 and the failed commit 2
        real = commit_engine.known_chunks

        def blip(*args: object, **kwargs: object) -> object:
            raise CatalogUnavailableError("the catalog blinked")

        monkeypatch.setattr(commit_engine, "known_chunks", blip)
        with pytest.raises(CatalogUnavailableError):
            store.commit(state, run="r", step=2, block=False, trust_versions=True).wait()
        monkeypatch.setattr(commit_engine, "known_chunks", real)
        store.commit(state, run="r", step=3, block=False, trust_versions=True).wait()  # x untouched since 2
        assert torch.equal(store.restore("r@3")["x"], x)
        store.commit(state, run="r", step=4, unchanged=["x"])  # a blocking one: the same rule
        assert torch.equal(store.restore("r@4")["x"], x)


def test_an_unchanged_promise_after_another_handle_committed_the_run_stores_the_live_bytes(
        tmp_path: Path) -> None:
    """A background commit's staging holds the bytes of ITS last staging; a version another
    handle (a group or DCP save, another process) made from newer bytes is the parent of the
    next commit, so a true ``unchanged`` promise about that parent must not keep the staged copy."""
    with casckpt.open(tmp_path / "s", cache=tmp_path / "c") as store:
        x, y = torch.zeros(300_000), torch.ones(300_000)
        state = {"x": x, "y": y}
        store.commit(state, run="r", step=1, block=False).wait()  # staging now holds x = 0
        x.add_(1)
        with casckpt.open(tmp_path / "s", cache=tmp_path / "c2", create=False) as other:
            other.commit(state, run="r", step=2)  # the run's newest version holds x = 1
        store.commit(state, run="r", step=3, block=False, unchanged=["x"]).wait()  # true: x as at 2
        assert torch.equal(store.restore("r@3")["x"], x)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(70_000),
    lambda: torch.randn(70_000).to(torch.bfloat16),
    lambda: torch.randint(-100, 100, (90_000,), dtype=torch.int8),
    lambda: torch.randn(90_000) > 0,
    lambda: torch.randn(200_000)[1_000:150_000],  # a view with a storage offset
    lambda: torch.randn(300, 400).t(),  # not contiguous
    lambda: torch.randn(20_000, dtype=torch.complex64).conj(),  # a lazy conj view
    lambda: np.arange(50_000, dtype=">f8"),
], ids=["f32", "bf16", "i8", "bool", "offset", "transposed", "conj", "numpy"])
def test_the_sample_is_of_the_bytes_a_commit_stores(make: Callable[[], Any]) -> None:
    """The fingerprint's sample is cut from what the extent holds: the tensor's values,
    contiguous, as they read (conj resolved), whatever its layout."""
    from casckpt.engine.write.hint import sample
    from casckpt.format.hintsample import sample_spans

    value = make()
    if isinstance(value, np.ndarray):
        stored = value.tobytes()
    else:
        stored = value.resolve_conj().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    spans = sample_spans("r", 3, "w", len(stored))
    assert b"".join(sample("r", 3, "w", value) or ()) == b"".join(stored[s:e] for s, e in spans)
