"""``copyplan.plan``: what a plan keeps of each version. A copy plans every version before it
sends anything, so a plan must not hold every version's tree: only the nodes the destination
lacks (each once across the plan) and the element sizes of the chunks it sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import casckpt
from casckpt.engine.copying import copyplan
from casckpt.engine.read.trees import store_nodes
from casckpt.testing.internals import internals

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}


def state(step: int) -> dict[str, Any]:
    """Many small tensors (packed extents, split dict nodes) that stay, a few that change, and
    whole tensors of several dtypes (extents of their own)."""
    g = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {f"layers.{i}.w": torch.randn(16, generator=g) for i in range(1200)}
    out["layers.1199.w"] = out["layers.1199.w"] + step
    out["big.f32"] = torch.randn(5000, generator=g) + step
    out["big.i64"] = torch.arange(3000, dtype=torch.int64) * step
    out["big.bf16"] = (torch.randn(6000, generator=g) + step).to(torch.bfloat16)
    out["step"] = step
    return out


def _plan(src: casckpt.Store, dst: casckpt.Store) -> copyplan.CopyPlan:
    source, dest = internals(src), internals(dst)
    rows = [source.core.row(v.id) for v in reversed(src.log("r"))]
    return copyplan.plan(source.catalog, dest.catalog, rows, store_nodes(source.context))


def _tree_nodes(src: casckpt.Store, version_id: str) -> set[bytes]:
    return set(internals(src).manifest(version_id).nodes)


def test_a_plan_keeps_each_node_the_destination_lacks_once(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        made = [src.commit(state(s), run="r", step=s) for s in range(1, 4)]
        planned = _plan(src, dst)
        every = [_tree_nodes(src, v.id) for v in made]
        assert all(len(nodes) > 8 for nodes in every)  # split dicts: trees of many nodes
        assert [set(v.nodes) for v in planned.versions] == every  # sizes of every node: ids only
        kept = [set(v.nodes.wanted) for v in planned.versions]  # what a copy expects to read again
        assert kept[0] == every[0]
        for got, tree, version in zip(kept, every, planned.versions, strict=True):
            assert got <= tree and {i for i in version.send if i in tree} <= got
        assert sum(len(k) for k in kept) == len(set().union(*every))  # each node kept once
        assert all(len(k) < len(t) // 2 for k, t in zip(kept[1:], every[1:], strict=True))
        src.copy("r@2", to=dst)
        again = _plan(src, dst)  # what the destination holds is neither sent nor kept
        assert [v.present for v in again.versions] == [True, True, False]
        assert set(again.versions[2].nodes.wanted) == every[2] - every[1] - every[0]


def test_a_plan_gives_each_chunk_sent_its_tensors_element_size(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        made = [src.commit(state(s), run="r", step=s) for s in range(1, 3)]
        for version, commit in zip(_plan(src, dst).versions, made, strict=True):
            whole = internals(src).manifest(commit.id)
            want = copyplan._aligns(whole, version.send)  # from the manifest decoded whole
            assert version.aligns == want
            assert {2, 4, 8} <= set(want.values())
