"""Golden data: the versions of manifest formats 1 and 2 that casckpt's own writers made
(tests/golden/store-formats, made by tests/golden/make_formats.py) restore bit-exact in every
later release: one-process (format 1), a DCP save by 2 ranks and a group commit of 2 ranks
(format 2), before and after their migration to tree manifests."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from doubles import ForkedPython

import casckpt
from casckpt.format.state import iter_leaves

GOLDEN = Path(__file__).parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))
from make_formats import dcp_state, one_state, rank_state  # noqa: E402

VERSIONS = {  # ref -> the id its writer gave it (the object id of its manifest)
    "one@0": "6f825969146674446bd87269294bb1253d1460cbef3744f21f24f4f3ce0095b0",  # format 1
    "dcp@1": "0d7f27b4dce508a17f6a8e671d50afea2ebfff911f9ebc1dd6b0fb73d5ab2e1e",  # format 2, DCP
    "grp@2": "2bc05dfba8d2f14f98300e803b487ad872228f974e422cdefebe413aff4b2003",  # format 2, group=
}


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    """A copy of the golden store (opening it may upgrade its catalog: never the original)."""
    copy = tmp_path / "store-formats"
    shutil.copytree(GOLDEN / "store-formats", copy)
    return copy


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _same(a: object, b: object) -> None:
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    assert la.keys() == lb.keys()
    for path, x in la.items():
        y = lb[path]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, path
            assert _bits(x) == _bits(y), path
        else:
            assert type(x) is type(y) and x == y, path


def _flat_values(state: dict[str, Any]) -> dict[str, Any]:
    """``dcp_state()`` as a one-process restore of the DCP save names it (values by dotted path)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _check_all(store: casckpt.Store) -> None:
    assert {f"{v.run}@{v.step}": v.id for v in store.log()} == VERSIONS
    one = store.restore("one@0")
    _same(one, one_state())
    assert one["model"]["w_t"].data_ptr() == one["model"]["w"].data_ptr()  # shared storage kept
    _same(store.restore("dcp@1"), _flat_values(dcp_state()))  # pieces assembled
    assert _bits(store.load_tensor("dcp@1", "model.emb")) == _bits(dcp_state()["model.emb"])
    for rank in (0, 1):
        _same(store.restore("grp@2", rank=rank), rank_state(rank))
    assert _bits(store.load_tensor("grp@2", "rank1/rng")) == _bits(rank_state(1)["rng"])
    detail = store.show("dcp@1")
    assert detail.world_size == 2 and detail.saved_with == "dcp"
    assert {t.path: t.shards for t in detail.tensors}["model.emb"] == 2
    assert store.show("grp@2").saved_with == "group"
    # DCP reads the pieces and reshards them (here: onto one process, whole tensors)
    blank: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                             for k, v in dcp_state().items()}
    blank["meta"] = {"lr": 0.0, "name": ""}
    dcp.load(blank, storage_reader=store.dcp_reader("dcp@1"))
    _same(blank, dcp_state())
    assert store.ops.check(read_data=True).ok


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_golden_formats_open_and_restore_bit_exact(golden: Path) -> None:
    with casckpt.open(golden, create=False) as store:
        _check_all(store)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_golden_formats_migrate_to_trees_and_still_restore_bit_exact(golden: Path) -> None:
    with casckpt.open(golden, create=False) as store:
        before = {ref: (store.show(ref).tensors, store.show(ref).values) for ref in VERSIONS}
        report = store.ops.migrate_trees()
        assert report.versions_migrated == 3 and store.ops.stats().versions_without_tree == 0
        assert store.ops.migrate_trees().versions_migrated == 0  # nothing left to do
        _check_all(store)  # ids unchanged: the documents stay as they are
        for ref, (tensors, values) in before.items():  # queries read the trees alike, ...
            detail = store.show(ref)
            assert detail.values == values, ref
            assert [replace(t, digest="") for t in detail.tensors] == \
                [replace(t, digest="") for t in tensors], ref
            # ... but for a DCP piece covering its whole tensor (a replicated one): the tree gives
            # it the digest of that tensor saved whole, not the one its format-2 row kept
            redigested = {t.path for t, was in zip(detail.tensors, tensors, strict=True)
                          if t.digest != was.digest}
            assert redigested == ({"model.bias", "optim.count"} if ref == "dcp@1" else set()), ref
        assert [c.path for c in store.diff("grp@2", "grp@2").changed] == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_migration_of_the_golden_formats_killed_with_sigkill_resumes(
        golden: Path, forked_python: ForkedPython) -> None:
    """kill -9 in the middle (one version migrated, the next one's nodes written, not published):
    the rerun completes, a third run finds nothing to do, every version restores bit-exact."""
    script = textwrap.dedent(f"""
        import os, signal
        import casckpt
        from casckpt.engine.maintenance import treemigrate
        treemigrate.BATCH_VERSIONS = 1
        publish, calls = treemigrate._publish_batch, []
        def dying(*args):
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            calls.append(1)
            publish(*args)
        treemigrate._publish_batch = dying
        with casckpt.open({str(golden)!r}, create=False) as store:
            store.ops.migrate_trees()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = forked_python.run(["-c", script], env=env, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    with casckpt.open(golden, create=False) as store:
        assert store.ops.stats().versions_without_tree == 2
        assert store.ops.migrate_trees().versions_migrated == 2
        assert store.ops.migrate_trees().versions_migrated == 0
        store.gc(grace=0)  # the killed run's lease and leftovers are reaped
        _check_all(store)


def test_load_tensor_of_a_group_version_names_the_rank_form_it_takes(golden: Path) -> None:
    """``load_tensor`` takes no ``group=`` or ``rank=``: a path naming no rank in a version
    saved rank by rank is refused with the ``rank0/path`` form, before and after migration."""
    from casckpt.errors import TensorNotFoundError

    with casckpt.open(golden, create=False) as store:
        for _ in range(2):
            with pytest.raises(TensorNotFoundError, match=r"'rank0/rng' \(ranks 0\.\.1\)") as raised:
                store.load_tensor("grp@2", "rng")
            assert "group=" not in str(raised.value) and "rank=" not in str(raised.value)
            assert _bits(store.load_tensor("grp@2", "rank1/rng")) == _bits(rank_state(1)["rng"])
            store.ops.migrate_trees()
