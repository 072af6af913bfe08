"""The encode policy (issue 32): tensors' roles, lessons that skip probes and deltas whose
outcome is known, and the delta policies ``off | balanced | max``: every one restores
bit-exact, and every chain it stores stays within its restore-cost bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

import casckpt
from casckpt.catalog import schema
from casckpt.catalog.deltas import DEFAULT_DELTA_CHAIN
from casckpt.engine.memory.deltabase import BaseCache, CachedChunk, ChainPolicy, level_cost
from casckpt.engine.write.encodepolicy import POLICIES, EncodePlan, Role, role
from casckpt.errors import InvalidArgumentError
from casckpt.format.codecs import CODECS, CompressionPolicy, Delta, decode_chunk
from casckpt.format.manifest import ExtentEntry, TensorEntry
from casckpt.testing.internals import internals

CHUNK = 16 << 10


def _open(path: Path) -> casckpt.Store:
    return casckpt.open(path, chunk_size=CHUNK, pack_size=256 << 10)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("path, want", [
    ("model/layers.0.weight", Role.WEIGHT), ("model.tok.weight", Role.WEIGHT),
    ("optimizer/state/3/exp_avg", Role.MOMENT1), ("optimizer/state/0/momentum_buffer", Role.MOMENT1),
    ("optimizer/state/3/exp_avg_sq", Role.MOMENT2), ("optimizer/state/3/step", Role.OTHER),
    ("optimizer/param_groups/0/lr", Role.OTHER),
])
def test_roles_follow_the_state_dict_names(path: str, want: Role) -> None:
    assert role(path) is want


def _plan(bases: BaseCache, ids: list[bytes], path: str = "model/w") -> EncodePlan:
    plan = EncodePlan(bases, "r", {}, set(), None, POLICIES["off"], CompressionPolicy())
    plan.name([TensorEntry(path, "torch", "float32", (1,), 0)], [ExtentEntry(0, CHUNK, tuple(ids))])
    return plan


def test_a_known_tensor_skips_its_probes_but_one_chunk_in_sixteen_and_still_round_trips() -> None:
    rng = np.random.default_rng(0)
    bases = BaseCache(1 << 20)
    chunks = [(rng.standard_normal(CHUNK // 4) * 0.02).astype(np.float32).tobytes() for _ in range(64)]
    ids = [bytes([i]) + bytes(31) for i in range(64)]  # ids drawn so 4 of 64 re-probe
    first = _plan(bases, ids)
    for cid, data in zip(ids, chunks, strict=True):
        first.encode(cid, memoryview(data), 4, False)
    assert first.probes_skipped == 0  # nothing known yet: every chunk probed
    lesson = bases.lessons("r")["model/w"]
    assert lesson.probe is not None and lesson.probe.mask == 0b1000 and lesson.codec == 10
    second = _plan(bases, ids)
    for cid, data in zip(ids, chunks, strict=True):
        codec, payload, base = second.encode(cid, memoryview(data), 4, False)
        assert base is None and bytes(decode_chunk(codec, payload, len(data))) == data
    assert second.probes_skipped == 64 - 4


def test_a_known_tensor_whose_planes_stop_paying_is_stored_raw() -> None:
    bases = BaseCache(1 << 20)
    ids = [bytes([1]) + bytes(31)]
    normal = (np.random.default_rng(1).standard_normal(CHUNK // 4) * 0.02).astype(np.float32).tobytes()
    _plan(bases, ids).encode(ids[0], memoryview(normal), 4, False)
    noise = np.random.default_rng(2).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    codec, payload, _ = _plan(bases, ids).encode(ids[0], memoryview(noise), 4, False)  # lesson says planes
    assert CODECS[codec].stored_as_is and bytes(payload) == noise  # the saving is checked, not assumed


def _rows(store: casckpt.Store) -> dict[str, Any]:
    with internals(store).catalog.read() as conn:
        return {row.id: row for row in conn.execute(select(schema.chunks))}


def _chain_costs(store: casckpt.Store) -> list[tuple[int, float]]:
    """Every stored chain's (depth, estimated restore cost over a keyframe's)."""
    rows = _rows(store)
    out = []
    for row in rows.values():
        depth, cost, node = 0, 0.0, row
        while node.base_id is not None:
            depth += 1
            cost += level_cost(node.raw_len, node.stored_len, CODECS[node.codec].delta is Delta.SPARSE)
            node = rows[node.base_id]
        out.append((depth, cost))
    return out


def _state(g: torch.Generator) -> dict[str, Any]:
    return {"model": {"emb": torch.randn(64, 256, generator=g),
                      "w": torch.randn(4 * CHUNK // 2, generator=g).bfloat16()},
            "optimizer": {"exp_avg": torch.randn(2 * CHUNK // 4, generator=g) * 1e-3,
                          "exp_avg_sq": torch.rand(2 * CHUNK // 4, generator=g) * 1e-6}}


def _flat(state: dict[str, Any]) -> dict[str, bytes]:
    return {f"{k}.{j}": _bits(t) for k, inner in state.items() for j, t in inner.items()}


def _step(state: dict[str, Any], g: torch.Generator) -> dict[str, Any]:
    model, opt = dict(state["model"]), dict(state["optimizer"])
    emb = model["emb"].clone()
    rows = torch.randperm(64, generator=g)[:1]
    emb[rows] += 1e-2 * torch.randn(1, 256, generator=g)  # one row: sparse
    w = model["w"].float()
    model["emb"], model["w"] = emb, (w * (1 + 1e-3 * torch.randn(w.shape, generator=g))).bfloat16()  # dense
    opt["exp_avg"] = 0.9 * opt["exp_avg"] + 1e-4 * torch.randn(2 * CHUNK // 4, generator=g)
    opt["exp_avg_sq"] = 0.999 * opt["exp_avg_sq"]
    return {"model": model, "optimizer": opt}


@pytest.mark.parametrize("policy", ["off", "balanced", "max"])
def test_a_40_commit_chain_holds_its_policys_restore_bound(tmp_path: Path, policy: str) -> None:
    g = torch.Generator().manual_seed(40)
    state = _state(g)
    kept = []
    with _open(tmp_path / "s") as store:
        if policy != "balanced":
            store.ops.set_delta_policy(policy)
        assert store.ops.delta_policy() == policy and store.ops.delta_policy("r") == policy
        for step in range(40):
            kept.append(_flat(state))
            store.commit(state, run="r", step=step)
            state = _step(state, g)
        costs = _chain_costs(store)
        bound = POLICIES[policy].restore_bound
        assert max(cost for _, cost in costs) <= bound + 1e-9
        assert max(depth for depth, _ in costs) <= DEFAULT_DELTA_CHAIN
        longest = store.ops.stats().longest_chain
        if policy == "off":
            assert longest == 0
        else:
            assert longest >= 2  # the embedding's sparse deltas chain
        rows = _rows(store)
        if policy == "balanced":  # moments are never delta-coded under balanced
            moments = {c for step in range(40) for c in _chunk_ids(store, f"r@{step}", "optimizer.")}
            assert all(rows[c.hex()].base_id is None for c in moments)
        for step in (0, 17, 39):
            back = store.restore(f"r@{step}")
            assert _flat(back) == kept[step]


def _chunk_ids(store: casckpt.Store, ref: str, prefix: str) -> set[bytes]:
    manifest = internals(store).manifest(ref)
    return {c for t in manifest.tensors if t.path.startswith(prefix)
            for c in manifest.extents[t.extent].chunks}


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(sorted(POLICIES)), dtype=st.sampled_from(DTYPES),
       name=st.sampled_from(["model.w", "optimizer.exp_avg", "optimizer.exp_avg_sq", "buffers.count"]),
       update=st.sampled_from([0.0, 1e-6, 1e-4, 1e-2, 1e-1, -1.0]), seed=st.integers(0, 1000))
def test_every_policy_restores_every_dtype_and_role_bit_exact(
        tmp_path_factory: pytest.TempPathFactory, policy: str, dtype: torch.dtype, name: str, update: float,
        seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 3 * CHUNK // 8 + 5  # a ragged tail chunk
    value = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype) if dtype.is_floating_point \
        else torch.randint(0, 100, (n,), generator=g).to(dtype)
    kept = []
    with _open(tmp_path_factory.mktemp("policy")) as store:
        store.ops.set_delta_policy(policy)
        for step in range(5):
            kept.append(_bits(value))
            outer, inner = name.split(".")
            store.commit({outer: {inner: value}}, run="r", step=step)
            if update < 0:  # every value new
                noise = torch.randn(n, generator=g, dtype=torch.float64)
                value = noise.to(dtype) if dtype.is_floating_point else (noise * 50).to(torch.int64).to(dtype)
            elif dtype.is_floating_point:
                value = (value.double() * (1 + update * torch.randn(n, generator=g, dtype=torch.float64))) \
                    .to(dtype)
            elif update:
                value = value.clone()
                value[:: max(1, int(1 / update))] += 1
        for step, want in enumerate(kept):
            assert _bits(store.restore(f"r@{step}")[outer][inner]) == want
        assert store.ops.check(read_data=True).ok


def test_the_delta_policy_is_a_store_setting_with_run_overrides(tmp_path: Path) -> None:
    with _open(tmp_path / "s") as store:
        assert store.ops.delta_policy() == "balanced"
        store.ops.set_delta_policy("off")
        store.ops.set_delta_policy("max", run="fast")
        assert (store.ops.delta_policy(), store.ops.delta_policy("fast"), store.ops.delta_policy("x")) \
            == ("off", "max", "off")
        for bad in ("on", "", None, 1):
            with pytest.raises(InvalidArgumentError, match="off, balanced, max"):
                store.ops.set_delta_policy(bad)  # type: ignore[arg-type]
    with _open(tmp_path / "s") as store:  # kept in the catalog
        assert store.ops.delta_policy("fast") == "max"
        store.ops.set_delta_policy(None, run="fast")
        assert store.ops.delta_policy("fast") == "off"


def test_a_chain_length_that_was_set_overrides_the_policys_bound(tmp_path: Path) -> None:
    chain = ChainPolicy(3)
    assert chain.extend(CachedChunk(memoryview(b""), 2, key_bytes=1), 100, 90) is not None  # no cost bound
    g = torch.Generator().manual_seed(5)
    state = _state(g)
    with _open(tmp_path / "s") as store:
        store.ops.set_delta_policy("off")
        store.ops.set_delta_chain(3)
        for step in range(6):
            store.commit(state, run="r", step=step)
            state = _step(state, g)
        assert 1 <= store.ops.stats().longest_chain <= 3
